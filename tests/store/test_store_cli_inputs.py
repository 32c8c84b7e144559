"""More bad input for the CLI: output files that cannot be written, unreadable --vkey files, and a machine
without the log key of an existing log. Each is one line, exit 2, and nothing is written."""

from __future__ import annotations

import json
import shutil

from receipts.keys import SigningKey
from receipts.testing import synthetic_envelope

from .test_store_cli import _one_line_error, node  # noqa: F401 - `node` is a fixture


def test_output_files_that_cannot_be_written_are_one_line(cli, node, tmp_path) -> None:  # noqa: F811
    missing = tmp_path / "no" / "such" / "dir" / "out"
    url = node["url"]
    for args in (
        ("log", "checkpoint", "--out", missing),
        ("receipts", "export", "--out", missing),
        ("receipts", "prove", node["ids"][0], "--out", missing),
        ("keys", "export-public", "--out", missing),
    ):
        assert _one_line_error(cli(*args, "--db", url)).startswith(f"error: cannot write {missing}")
    assert not missing.parent.exists()


def test_a_vkey_file_that_is_not_text_is_one_line_and_approve_writes_nothing(
    cli,
    node,  # noqa: F811
    tmp_path,
) -> None:
    vkey = tmp_path / "log.vkey"
    vkey.write_bytes(b"\xff\xfe not a verifier key")
    url = node["url"]
    assert "--vkey file" in _one_line_error(cli("log", "verify", "--vkey", vkey, "--db", url))
    assert "--vkey file" in _one_line_error(cli("receipts", "verify", "--all", "--vkey", vkey, "--db", url))
    policy = tmp_path / "fleet.toml"
    policy.write_text('verdict = "qualified"\n')
    before = json.loads(cli("log", "checkpoint", "--json", "--db", url).out)["size"]
    subject = "sha256:" + "a" * 64
    message = _one_line_error(
        cli("approve", "--policy", policy, "--subject", subject, "--vkey", vkey, "--db", url)
    )
    assert "--vkey file" in message
    assert json.loads(cli("log", "checkpoint", "--json", "--db", url).out)["size"] == before


def test_a_machine_without_the_log_key_appends_nothing_and_makes_no_stray_key(
    cli,
    node,  # noqa: F811
    home,
    tmp_path,
) -> None:
    url = node["url"]
    if url.startswith("sqlite"):
        # This machine's default store is that file; keep the test about the missing log key.
        assert (home / "keys" / "log.key").exists()
    shutil.move(home / "keys" / "log.key", tmp_path / "log.key.elsewhere")
    envelopes = tmp_path / "more.jsonl"
    key = SigningKey.load(home / "keys" / "operator.key")
    envelopes.write_text(json.dumps(synthetic_envelope(key, 50)) + "\n")
    before = json.loads(cli("log", "checkpoint", "--json", "--db", url).out)["size"]
    for args in (("receipts", "import", envelopes), ("keys", "revoke", key.keyid[:12])):
        message = _one_line_error(cli(*args, "--db", url))
        assert "no log key at" in message
        assert not (home / "keys" / "log.key").exists()
    assert json.loads(cli("log", "checkpoint", "--json", "--db", url).out)["size"] == before
