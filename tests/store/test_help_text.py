"""Help a person can act on: `--db` says what its default is, rather than naming a bare variable."""

from __future__ import annotations

import pytest

DB_HELP = "--db URL Store URL (default: $QUALIFY_DB_URL, else the SQLite file in the data dir)."


@pytest.mark.parametrize("command", [("run",), ("receipts", "list"), ("log", "verify")])
def test_db_option_says_what_its_default_is(cli, command) -> None:
    result = cli(*command, "--help")
    assert result.code == 0, result.err
    assert DB_HELP in " ".join(result.out.split())
