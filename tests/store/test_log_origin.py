"""Each log has an origin of its own, so a checkpoint of one log checked against another is named as
such ("belongs to log X"), not reported as rewritten history; verification messages read as sentences."""

from __future__ import annotations

import json

from receipts.checkpoint import Checkpoint, sign_checkpoint
from receipts.errors import TamperError
from receipts.verify import verify_log


def test_two_stores_of_one_data_dir_get_their_own_origin_and_keep_it(cli, home, tmp_path) -> None:
    urls = [f"sqlite:///{tmp_path / name}.db" for name in ("a", "b")]
    for url in urls:
        assert cli("keys", "generate", "--db", url, "--out", tmp_path / f"{url[-4]}.key").code == 0
    origins = [json.loads(cli("log", "checkpoint", "--db", url, "--json").out)["origin"] for url in urls]
    assert origins[0] != origins[1]
    assert all(o.startswith("qualify.local/") and o.count("/") == 2 for o in origins)
    # Appending again keeps the origin recorded at creation.
    assert cli("keys", "generate", "--db", urls[0], "--out", tmp_path / "c.key").code == 0
    assert json.loads(cli("log", "checkpoint", "--db", urls[0], "--json").out)["origin"] == origins[0]

    kept = tmp_path / "a.checkpoint"
    assert cli("log", "checkpoint", "--db", urls[0], "--out", kept).code == 0
    result = cli("log", "verify", "--db", urls[1], "--checkpoint", kept)
    assert result.code == 2, (result.out, result.err)
    assert f"this checkpoint belongs to log {origins[0]!r}, not {origins[1]!r}" in result.err
    assert "rewritten" not in result.err


def test_a_checkpoint_of_another_origin_is_named_by_the_library_check(store, operator, log_signer) -> None:
    other = sign_checkpoint(Checkpoint("qualify.test/other-log", 1, store.root(1)), log_signer)
    try:
        verify_log(store, checkpoint_text=other, verifiers=[log_signer.verifier()])
    except TamperError as error:
        message = str(error)
    assert message.startswith("log verification failed: the external checkpoint belongs to log ")
    assert "'qualify.test/other-log', not to this log ('qualify.test/log')" in message


def test_a_rewritten_history_message_is_one_sentence(store, operator, log_signer) -> None:
    wrong = sign_checkpoint(Checkpoint(log_signer.name, 1, b"\1" * 32), log_signer)
    try:
        verify_log(store, checkpoint_text=wrong, verifiers=[log_signer.verifier()])
    except TamperError as error:
        message = str(error)
    assert message.startswith(
        "log verification failed: the log's first 1 entries no longer hash to the external checkpoint's root"
    )
