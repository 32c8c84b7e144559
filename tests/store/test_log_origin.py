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


def test_log_vkey_and_verify_name_the_store_given_not_the_local_key(cli, home, tmp_path, monkeypatch) -> None:
    """A data dir whose own log key belongs to its own log, pointed at another host's store with --db:
    `log vkey` prints that store's log key (said to come from the store), and checks do not report the
    other log as forged because the local key is not its key."""
    mine, theirs = (f"sqlite:///{tmp_path / name}.db" for name in ("mine", "theirs"))
    assert cli("keys", "generate", "--db", mine, "--out", tmp_path / "m.key").code == 0
    monkeypatch.setenv("QUALIFY_HOME", str(tmp_path / "other-home"))
    assert cli("keys", "generate", "--db", theirs, "--out", tmp_path / "t.key").code == 0
    their_vkey = cli("log", "vkey", "--db", theirs).out.strip()
    monkeypatch.setenv("QUALIFY_HOME", str(home))
    my_vkey = cli("log", "vkey", "--db", mine).out.strip()

    shown = cli("log", "vkey", "--db", theirs)
    assert shown.code == 0 and shown.out.strip() == their_vkey != my_vkey
    assert "the key the store records" in shown.err
    for vkey, url in ((my_vkey, mine), (their_vkey, theirs)):
        origin = json.loads(cli("log", "checkpoint", "--db", url, "--json").out)["origin"]
        assert vkey.split("+")[0] == origin
    result = cli("log", "verify", "--db", theirs)
    assert result.code == 0, result.err
    assert cli("log", "verify", "--db", theirs, "--vkey", my_vkey).code == 1  # pinned wrong key: refused


def test_a_log_made_before_key_name_equals_origin_keeps_verifying_and_growing(sqlite_url, operator) -> None:
    """Logs created when checkpoints were signed as `qualify.local/<host>` under the origin
    `qualify.local/<host>/<id>` keep that key name: the verifier keys auditors hold still verify them."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from receipts.checkpoint import NoteSigner, open_checkpoint
    from receipts.store import Store
    from receipts.testing import synthetic_envelope

    legacy = NoteSigner("qualify.local/vm", Ed25519PrivateKey.generate())
    with Store.open(sqlite_url) as old:
        old._signer, old._origin = legacy, "qualify.local/vm/0123abcd"  # as the store used to sign
        old.trust_key(operator.public_key(), "operator")
        old.append_receipt(synthetic_envelope(operator, 0))
    with Store.open(sqlite_url, log_signer=NoteSigner("renamed/anything", legacy.private_key)) as store:
        store.append_receipt(synthetic_envelope(operator, 1))
        note = store.latest_checkpoint()
        assert store.log_signer is not None and store.log_signer.vkey() == legacy.vkey()
        assert open_checkpoint(note, [legacy.verifier()], origin="qualify.local/vm/0123abcd").size == 3
        assert verify_log(store, verifiers=[legacy.verifier()]).size == 3
