"""The `db`, `keys`, `receipts` and `log` command families, run as `qualify` runs them: results for people
and as JSON, and bad input answered with one line, exit code 2 and nothing written."""

from __future__ import annotations

import json
import re
import socket

import pytest

from receipts import keys
from receipts.checkpoint import NoteVerifier, verify_tlog_proof
from receipts.keys import SigningKey
from receipts.testing import synthetic_envelope


def mode(path) -> int:
    return path.stat().st_mode & 0o777


def _one_line_error(result) -> str:
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    assert "Traceback" not in result.err
    return lines[0]


def _envelopes_file(path, key: SigningKey, numbers, **kwargs):
    path.write_text("".join(json.dumps(synthetic_envelope(key, n, **kwargs)) + "\n" for n in numbers))
    return path


@pytest.fixture
def node(cli, home, db_url):
    """A store made through the CLI: the default operator key (trusted) and three imported receipts."""
    assert cli("keys", "generate", "--db", db_url).code == 0
    key = SigningKey.load(home / "keys" / "operator.key")
    result = cli(
        "receipts", "import", _envelopes_file(home / "in.jsonl", key, range(3)), "--db", db_url, "--json"
    )
    assert result.code == 0, result.err
    return {"url": db_url, "key": key, "ids": [r["id"] for r in json.loads(result.out)]}


def test_db_upgrade_creates_the_store_and_current_reports_head(cli, home) -> None:
    assert not (home / "qualify.db").exists()
    assert cli("db", "upgrade").code == 0
    assert (home / "qualify.db").exists()
    current = json.loads(cli("db", "current", "--json").out)
    assert current["at_head"] and current["revision"] == current["head"]


def test_keys_generate_writes_0600_trusts_and_lists(cli, home) -> None:
    result = cli("keys", "generate", "--algorithm", "p256", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    path = home / "keys" / "operator.key"
    assert data["path"] == str(path) and mode(path) == 0o600 and data["trusted_at"] == 0
    assert mode(home / "keys" / "log.key") == 0o600  # the log key is made on first use
    listed = json.loads(cli("keys", "list", "--json").out)
    assert [(k["keyid"], k["algorithm"], k["status"]) for k in listed] == [(data["keyid"], "p256", "trusted")]
    assert "p256" in cli("keys", "list").out
    again = cli("keys", "generate")
    assert "already exists" in _one_line_error(again)


def test_keys_export_trust_and_revoke_round_trip(cli, home, tmp_path) -> None:
    assert cli("keys", "generate", "--no-trust").code == 0
    assert not (home / "qualify.db").exists()  # --no-trust touches no store
    pem = cli("keys", "export-public").out
    assert pem.startswith("-----BEGIN PUBLIC KEY-----")
    public = tmp_path / "op.pub"
    public.write_text(pem)
    trusted = json.loads(cli("keys", "trust", public, "--note", "from a file", "--json").out)
    assert trusted["status"] == "trusted" and trusted["note"] == "from a file"
    assert cli("keys", "export-public", trusted["keyid"][:12]).out == pem
    revoked = json.loads(cli("keys", "revoke", trusted["keyid"][:12], "--reason", "rotated", "--json").out)
    assert (revoked["status"], revoked["revoked_at"], revoked["reason"]) == ("revoked", 1, "rotated")


def test_receipts_list_show_and_filters(cli, node) -> None:
    url = node["url"]

    def listed(*args: str) -> list:
        return json.loads(cli("receipts", "list", *args, "--db", url, "--json").out)["items"]

    newest_first = listed()
    assert [r["id"] for r in newest_first] == node["ids"][::-1]
    assert [r["log_index"] for r in newest_first] == [3, 2, 1]
    assert listed("--verdict", "rejected") == []
    assert len(listed("--since", "2000-01-01")) == 3
    assert listed("--since", "1d") == []
    digest = newest_first[1]["subjects"][0]["digest"]
    assert [r["id"] for r in listed("--subject", digest)] == [node["ids"][1]]
    shown = json.loads(cli("receipts", "show", node["ids"][0][:10], "--db", url, "--json").out)
    assert shown["predicate"]["verdict"] == "qualified" and shown["log_index"] == 1
    envelope = cli("receipts", "show", node["ids"][0], "--envelope", "--db", url).out
    assert json.loads(envelope)["payloadType"] == "application/vnd.in-toto+json"
    human = cli("receipts", "show", node["ids"][0], "--db", url).out
    assert node["ids"][0] in human and re.search(r"^  boot\s+pass", human, re.M)


def test_receipts_verify_and_prove(cli, node, home) -> None:
    url = node["url"]
    reports = json.loads(cli("receipts", "verify", "--all", "--db", url, "--json").out)
    assert [r["ok"] for r in reports] == [True, True, True]
    assert cli("receipts", "verify", node["ids"][2], "--db", url).code == 0
    proof = cli("receipts", "prove", node["ids"][1], "--db", url).out
    assert proof.startswith("c2sp.org/tlog-proof@v1\nindex 2\n")
    vkey = cli("log", "vkey", "--db", url).out.strip()
    envelope = cli("receipts", "show", node["ids"][1], "--envelope", "--db", url).out.strip().encode()
    from receipts import merkle

    parsed, cp = verify_tlog_proof(proof, merkle.leaf_hash(envelope), [NoteVerifier.from_vkey(vkey)])
    assert (parsed.index, cp.size) == (2, 4)


def test_export_then_import_on_another_node(cli, node, tmp_path, sqlite_url) -> None:
    exported = tmp_path / "receipts.jsonl"
    assert cli("receipts", "export", "--format", "jsonl", "--out", exported, "--db", node["url"]).code == 0
    assert len(exported.read_text().splitlines()) == 3
    other = f"sqlite:///{tmp_path / 'other.db'}"
    # The other node has no log yet, so it trusts no signer: nothing is imported, and nothing is created
    # (no database, no log key).
    refused = _one_line_error(cli("receipts", "import", exported, "--db", other))
    assert "no store at" in refused and "qualify keys trust" in refused
    assert not (tmp_path / "other.db").exists()
    public = tmp_path / "op.pub"
    public.write_text(node["key"].public_key().public_pem().decode())
    assert cli("keys", "trust", public, "--db", other).code == 0
    imported = json.loads(cli("receipts", "import", exported, "--db", other, "--json").out)
    assert [r["id"] for r in imported] == node["ids"]
    assert "already in the log" in _one_line_error(cli("receipts", "import", exported, "--db", other))


def test_log_checkpoint_and_verify(cli, node, home) -> None:
    url = node["url"]
    checkpoint = json.loads(cli("log", "checkpoint", "--db", url, "--json").out)
    assert checkpoint["size"] == 4 and checkpoint["note"].startswith(checkpoint["origin"] + "\n4\n")
    saved = home / "cp.txt"
    assert cli("log", "checkpoint", "--out", saved, "--db", url).code == 0
    assert (
        cli("receipts", "import", _envelopes_file(home / "more.jsonl", node["key"], [7, 8]), "--db", url).code
        == 0
    )
    report = json.loads(cli("log", "verify", "--checkpoint", saved, "--db", url, "--json").out)
    assert report["ok"] and report["size"] == 6 and report["external_checkpoint"]["size"] == 4
    assert report["checkpoints_checked"] == 6
    assert "log OK: 6 entries" in cli("log", "verify", "--db", url).out


def test_receipts_schema_prints_the_statement_schema(cli) -> None:
    schema = json.loads(cli("receipts", "schema").out)
    assert schema["$id"] == "https://in-toto.io/Statement/v1"
    predicate = json.loads(cli("receipts", "schema", "--predicate").out)
    assert "verdict" in predicate["properties"]


# ------------------------------------------------------------ bad input: one line, exit 2, nothing written


def test_malformed_envelope_files_write_nothing(cli, home, tmp_path) -> None:
    key = keys.generate()
    cases = {
        "not-json.json": "{not json",
        "empty.jsonl": "\n\n",
        "not-envelope.json": json.dumps({"hello": "world"}),
        "bad-base64.json": json.dumps(
            {"payloadType": "application/vnd.in-toto+json", "payload": "%%", "signatures": []}
        ),
        "not-a-statement.json": json.dumps(synthetic_envelope(key, 1) | {"payload": "e30="}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        _one_line_error(cli("receipts", "import", path))
    _one_line_error(cli("receipts", "import", tmp_path / "missing.json"))
    assert not home.exists() or not any(home.rglob("*"))  # no store, no log key


def test_unknown_receipt_ids_write_nothing(cli, node, raw) -> None:
    before = raw.counts()
    url = node["url"]
    for args in (
        ("receipts", "show", "deadbeef" * 8),
        ("receipts", "show", "xyz"),
        ("receipts", "verify", "0000"),
        ("receipts", "prove", "abcdabcd"),
        ("keys", "revoke", "ffffffffffff"),
        ("keys", "export-public", "ffffffffffff"),
    ):
        assert re.search(r"\bno (receipt|key)\b|not a receipt id", _one_line_error(cli(*args, "--db", url)))
    assert raw.counts() == before


def test_reads_of_a_store_that_does_not_exist_create_nothing(cli, home) -> None:
    assert "no store at" in _one_line_error(cli("receipts", "show", "abcd"))
    assert "no store at" in _one_line_error(cli("log", "verify"))
    assert "no store at" in _one_line_error(cli("db", "current"))
    assert json.loads(cli("receipts", "list", "--json").out)["items"] == []
    assert not (home / "qualify.db").exists()


def test_unreadable_key_files_are_refused(cli, home, tmp_path) -> None:
    key = keys.generate()
    loose = tmp_path / "loose.key"
    loose.write_bytes(key.private_pem())
    loose.chmod(0o644)
    assert "chmod 600" in _one_line_error(cli("keys", "export-public", "--key", loose))
    assert "does not exist" in _one_line_error(cli("keys", "export-public", "--key", tmp_path / "nope.key"))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    assert "not a PEM public key" in _one_line_error(cli("keys", "trust", garbage))
    private = tmp_path / "private.pem"
    private.write_bytes(key.private_pem())
    private.chmod(0o600)
    assert "private key" in _one_line_error(cli("keys", "trust", private))
    assert not (home / "qualify.db").exists()


def test_a_world_readable_log_key_is_refused_before_anything_is_appended(cli, node, home, raw) -> None:
    before = raw.counts()
    (home / "keys" / "log.key").chmod(0o644)
    more = _envelopes_file(home / "more.jsonl", node["key"], [9])
    assert "chmod 600" in _one_line_error(cli("receipts", "import", more, "--db", node["url"]))
    assert raw.counts() == before


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_database_that_cannot_connect_is_one_line_and_nothing_is_written(cli, home, tmp_path) -> None:
    url = f"postgresql+psycopg://nobody@127.0.0.1:{_closed_port()}/qualify"
    message = _one_line_error(cli("keys", "generate", "--db", url))
    assert message.startswith("error: cannot connect to DB URL") and "check --db / QUALIFY_DB_URL" in message
    public = tmp_path / "op.pub"
    public.write_text(keys.generate().public_key().public_pem().decode())
    for args in (("db", "upgrade"), ("keys", "trust", public), ("receipts", "list"), ("log", "verify")):
        assert "cannot connect" in _one_line_error(cli(*args, "--db", url))
    assert not (home / "keys").exists()  # neither the operator key nor the log key was written
    for bad in ("not a url", "mysql://x@localhost/db", f"sqlite:///{tmp_path}/file.txt/below/qualify.db"):
        (tmp_path / "file.txt").write_text("a file, not a directory")
        _one_line_error(cli("db", "upgrade", "--db", bad))
    assert not (tmp_path / "file.txt" / "below").exists()
