"""Fixtures for the store suite: a store on each dialect with a log key and a trusted operator key, raw
SQL access as a database superuser would have it, and the CLI run the way `qualify` runs it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.cli import main
from receipts import keys
from receipts.checkpoint import NoteSigner
from receipts.models import APPEND_ONLY_TABLES
from receipts.store import Store

ORIGIN = "qualify.test/log"


@pytest.fixture
def log_signer() -> NoteSigner:
    return NoteSigner(ORIGIN, Ed25519PrivateKey.generate())


@pytest.fixture
def operator() -> keys.SigningKey:
    return keys.generate("ed25519")


@pytest.fixture
def store(db_url: str, log_signer: NoteSigner, operator: keys.SigningKey) -> Iterator[Store]:
    """An empty store (either dialect) that trusts `operator` (log entry 0)."""
    s = Store.open(db_url, log_signer=log_signer)
    s.trust_key(operator.public_key(), "test operator")
    yield s
    s.close()


class Raw:
    """Plain SQL on the store's database, bypassing the store: what an administrator can do."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.dialect = self.engine.dialect.name

    def execute(self, sql: str, **params: object) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(sql), params)

    def scalar(self, sql: str, **params: object) -> object:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {
                t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in APPEND_ONLY_TABLES
            }

    def triggers(self) -> set[str]:
        with self.engine.connect() as conn:
            if self.dialect == "sqlite":
                rows = conn.execute(sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger'"))
            else:
                rows = conn.execute(sa.text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"))
            return {r[0] for r in rows}

    def drop_triggers(self) -> None:
        """What a superuser can always do: remove the append-only triggers."""
        with self.engine.begin() as conn:
            if self.dialect == "sqlite":
                for (name,) in conn.execute(
                    sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger'")
                ).all():
                    conn.execute(sa.text(f'DROP TRIGGER "{name}"'))
            else:
                rows = conn.execute(
                    sa.text("SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal")
                ).all()
                for name, table in rows:
                    conn.execute(sa.text(f'DROP TRIGGER "{name}" ON {table}'))

    def drop_insert_guards(self) -> None:
        """What the owner can do: remove the insert guards of migration 0002 (keeping the append-only
        triggers), so that a test can plant rows the writer role may not insert."""
        with self.engine.begin() as conn:
            if self.dialect == "sqlite":
                rows = conn.execute(
                    sa.text(
                        "SELECT name, tbl_name FROM sqlite_master "
                        "WHERE type = 'trigger' AND name LIKE '%_guard_%'"
                    )
                ).all()
            else:
                rows = conn.execute(
                    sa.text(
                        "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal "
                        "AND (tgname LIKE '%_insert_guard' OR tgname = 'log_entries_sealed')"
                    )
                ).all()
            for name, table in rows:
                conn.execute(
                    sa.text(f'DROP TRIGGER "{name}"' + ("" if self.dialect == "sqlite" else f" ON {table}"))
                )

    def close(self) -> None:
        self.engine.dispose()


@pytest.fixture
def raw(db_url: str) -> Iterator[Raw]:
    r = Raw(db_url)
    yield r
    r.close()


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private QUALIFY_HOME (keys, default SQLite store) for CLI tests."""
    path = tmp_path / "home"
    monkeypatch.setenv("QUALIFY_HOME", str(path))
    monkeypatch.delenv("QUALIFY_DB_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return path


@pytest.fixture
def cli(home: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `qualify ARGS...` through qualify.cli.main, so that exit codes are the real ones."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        code = exit_info.value.code
        return CliResult(code if isinstance(code, int) else (0 if code is None else 1), out, err)

    return run


@pytest.fixture
def raw_pg(pg_url: str) -> Iterator[Raw]:
    r = Raw(pg_url)
    yield r
    r.close()


@pytest.fixture
def raw_sqlite(sqlite_url: str) -> Iterator[Raw]:
    r = Raw(sqlite_url)
    yield r
    r.close()
