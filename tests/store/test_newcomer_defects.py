"""Issue 25's defects, as a new user met them: a mistyped --db, a refused import that left files behind,
key ids cut short in a pipe, a hint said twice, a busy port, a tampered store read as bad input, a repair
that called a failing log clean, and a --help that imported every command."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from receipts import keys
from receipts.keys import SigningKey
from receipts.testing import synthetic_envelope

from .conftest import Raw


def _one_line(result, code: int = 2) -> str:
    assert result.code == code, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    return lines[0]


def _log(cli, home, url: str, n: int = 3) -> SigningKey:
    assert cli("keys", "generate", "--db", url).code == 0
    key = SigningKey.load(home / "keys" / "operator.key")
    path = home / "in.jsonl"
    path.write_text("".join(json.dumps(synthetic_envelope(key, i)) + "\n" for i in range(n)))
    assert cli("receipts", "import", path, "--db", url).code == 0
    return key


def test_a_mistyped_db_is_no_store_not_an_empty_one(cli, home, tmp_path, sqlite_url) -> None:
    _log(cli, home, sqlite_url)
    typo = tmp_path / "qualifyy.db"
    for args in (
        ("receipts", "list"),
        ("receipts", "export"),
        ("receipts", "export", "--out", tmp_path / "x"),
    ):
        line = _one_line(cli(*args, "--db", f"sqlite:///{typo}"))
        assert f"no store at {typo}" in line
    assert not typo.exists() and not (tmp_path / "x").exists()
    # The same through $QUALIFY_DB_URL; only the default store of a data dir with no runs yet lists empty.
    other = cli("receipts", "list", "--db", sqlite_url, "--json")
    assert json.loads(other.out)["total"] == 3


def test_listing_before_the_first_run_is_still_empty_not_an_error(cli, home) -> None:
    listed = cli("receipts", "list")
    assert listed.code == 0 and "no receipts match" in listed.out
    assert not (home / "qualify.db").exists()


def test_a_refused_import_creates_no_database_and_no_key(cli, home, tmp_path) -> None:
    key = keys.generate()
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(synthetic_envelope(key, 1)) + "\n")
    target = tmp_path / "fresh.db"
    line = _one_line(cli("receipts", "import", path, "--db", f"sqlite:///{target}"))
    assert "no store at" in line and "qualify keys trust" in line
    assert not target.exists()
    assert not (home / "keys" / "log.key").exists()
    # The default store too.
    _one_line(cli("receipts", "import", path))
    assert not (home / "qualify.db").exists() and not (home / "keys").exists()
    # A store that exists but has no entries (and so no log key yet): refused, and still no key made.
    assert cli("db", "upgrade", "--db", f"sqlite:///{target}").code == 0
    line = _one_line(cli("receipts", "import", path, "--db", f"sqlite:///{target}"))
    assert "not by a trusted key" in line
    assert not (home / "keys" / "log.key").exists()


def test_piped_keys_list_prints_whole_key_ids(cli, home, sqlite_url) -> None:
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    assert (
        cli("keys", "generate", "--algorithm", "p256", "--out", home / "p.key", "--db", sqlite_url).code == 0
    )
    listed = json.loads(cli("keys", "list", "--db", sqlite_url, "--json").out)
    out = cli("keys", "list", "--db", sqlite_url).out  # captured: not a terminal
    for info in listed:
        assert len(info["keyid"]) == 64 and info["keyid"] in out
    # What a script cuts out of the table is a key id that `keys revoke` takes.
    first = next(line for line in out.splitlines() if listed[0]["keyid"] in line)
    column = next(word for word in first.replace("│", " ").split() if len(word) == 64)
    assert cli("keys", "revoke", column, "--db", sqlite_url).code == 0


def test_the_database_hint_is_said_once(cli) -> None:
    url = "postgresql://nobody:pw@127.0.0.1:1/none"
    for args in (("receipts", "list"), ("keys", "list"), ("run", "--layout", "2304,2304,2304,9216")):
        line = _one_line(cli(*args, "--db", url))
        assert line.count("check --db / QUALIFY_DB_URL") == 1, line
        assert "pw" not in line.replace("postgresql://nobody:***", "")


def test_serve_on_a_busy_port_is_one_line_and_exit_2(cli, home, sqlite_url) -> None:
    _log(cli, home, sqlite_url, n=1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "qualify.cli", "serve", "--port", str(port), "--db", sqlite_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], result.stderr
    assert "--port" in lines[0] and result.stdout == ""


def test_reading_a_tampered_store_exits_1_as_the_verifiers_do(cli, home, sqlite_url) -> None:
    _log(cli, home, sqlite_url)
    raw = Raw(sqlite_url)
    try:
        raw.drop_triggers()
        raw.execute("UPDATE receipts SET verdict = 'rejected'")
    finally:
        raw.close()
    listed = cli("receipts", "list", "--db", sqlite_url)
    assert "disagrees with the row" in _one_line(listed, code=1)


def test_repair_does_not_call_a_log_that_fails_verification_clean(cli, home, sqlite_url, tmp_path) -> None:
    _log(cli, home, sqlite_url)
    evidence = tmp_path / "evidence.jsonl"
    clean = cli("log", "repair", "--evidence", evidence, "--reason", "check", "--db", sqlite_url)
    assert clean.code == 0 and "nothing to repair" in clean.out and "log verifies" in clean.out
    raw = Raw(sqlite_url)
    try:
        raw.drop_triggers()
        # A rewrite inside the signed part of the log: no repair may touch it, and it is not "nothing".
        raw.execute("UPDATE log_entries SET envelope = :e WHERE idx = 2", e=b'{"payload":"x"}')
    finally:
        raw.close()
    assert cli("log", "verify", "--db", sqlite_url).code == 1
    tampered = cli(
        "log", "repair", "--evidence", tmp_path / "e2.jsonl", "--reason", "check", "--db", sqlite_url
    )
    line = _one_line(tampered, code=1)
    assert "nothing to repair" not in tampered.out + tampered.err
    assert "does not verify" in line and "qualify log verify" in line
    assert not (tmp_path / "e2.jsonl").exists()


def test_help_imports_no_command_module_and_every_command_resolves(cli) -> None:
    code = (
        "import sys; from qualify.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('qualify.commands.', 'sqlalchemy', "
        "'pydantic', 'receipts.store'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    import click

    from qualify.cli import COMMANDS
    from qualify.cli import cli as root

    ctx = click.Context(root)
    for name in COMMANDS:
        command = root.get_command(ctx, name)
        assert command is not None and command.name == name, name
        assert cli(*name.split(), "--help").code == 0
    listed = cli("--help").out
    assert all(name in listed for name in COMMANDS)


@pytest.mark.parametrize("group", ["receipts", "keys", "log", "approve", "audit", "db", "serve", "gc"])
def test_a_groups_help_loads_no_database_or_model_library(group: str) -> None:
    """`qualify <group> --help` imports the group's module only: SQLAlchemy, pydantic, jinja2, CEL and
    the registry client wait until a command needs them (bench/startup.py measures the time)."""
    heavy = ("sqlalchemy", "pydantic", "jinja2", "celpy", "oras", "fastapi")
    code = (
        "import sys; from qualify.cli import main\n"
        f"try:\n    main([{group!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules if m.startswith({heavy!r})}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
