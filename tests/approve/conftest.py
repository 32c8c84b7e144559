"""Fixtures for the approval, API and report tests: a SQLite store with a trusted operator key, and a way
to append real signed receipts (realistic predicates from approve_predicates) about a subject; `home` and
`cli_log` for the command-line tests (a private QUALIFY_HOME and a store made as `qualify run` makes one)."""

from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.commands._common import load_log_signer
from receipts import dsse, keys
from receipts.canonical import canonical_json
from receipts.checkpoint import NoteSigner
from receipts.statement import PREDICATE_TYPE, STATEMENT_TYPE, config_digest
from receipts.store import Store

from .approve_predicates import CONFIG, predicate

SUBJECT = "sha256:" + hashlib.sha256(b"engine build 1").hexdigest()
OTHER_SUBJECT = "sha256:" + hashlib.sha256(b"engine build 2").hexdigest()


def statement(subject: str, pred: dict[str, Any]) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": "engine-image", "digest": {"sha256": subject.removeprefix("sha256:")}},
            {"name": "engine-config", "digest": {"sha256": config_digest(CONFIG).removeprefix("sha256:")}},
        ],
        "predicateType": PREDICATE_TYPE,
        "predicate": pred,
    }


@dataclass
class Log:
    """A store under test, its file, the operator key it trusts and a receipt appender."""

    store: Store
    url: str
    path: Path
    key: keys.SigningKey
    key_path: Path

    def add(self, subject: str = SUBJECT, key: keys.SigningKey | None = None, **kwargs: Any) -> str:
        """Append a signed receipt about `subject`; kwargs go to approve_predicates.predicate()."""
        payload = canonical_json(statement(subject, predicate(**kwargs)))
        envelope = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, payload, key or self.key)
        return self.store.append_receipt(envelope).id

    def raw(self, sql: str, *params: Any) -> None:
        """Run SQL as an attacker with file access would, triggers dropped first (they forbid it)."""
        con = sqlite3.connect(self.path)
        try:
            for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
                con.execute(f"DROP TRIGGER {name}")
            con.execute(sql, params)
            con.commit()
        finally:
            con.close()


@pytest.fixture
def make_log(tmp_path: Path) -> Iterator[Callable[[], Log]]:
    opened: list[Store] = []

    def make() -> Log:
        path = tmp_path / f"store{len(opened)}.db"
        url = f"sqlite:///{path}"
        store = Store.open(url, log_signer=NoteSigner("qualify.test/log", Ed25519PrivateKey.generate()))
        opened.append(store)
        key = keys.generate()
        key_path = key.save(tmp_path / f"operator{len(opened)}.key")
        store.trust_key(key.public_key(), "operator")
        return Log(store=store, url=url, path=path, key=key, key_path=key_path)

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def log(make_log: Callable[[], Log]) -> Log:
    return make_log()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QUALIFY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QUALIFY_DB_URL", raising=False)
    return tmp_path / "home"


@pytest.fixture
def cli_log(home: Path, tmp_path: Path):
    """A store made the way `qualify run` makes one: the log key and operator key in QUALIFY_HOME."""
    path = tmp_path / "cli.db"
    store = Store.open(f"sqlite:///{path}", log_signer=load_log_signer(create=True))
    key = keys.generate()
    key_path = key.save(home / "keys" / "operator.key")
    store.trust_key(key.public_key(), "operator")
    log = Log(store=store, url=f"sqlite:///{path}", path=path, key=key, key_path=key_path)
    yield log
    store.close()


TOKEN = "t" * 32


def start_serve(
    home: Path, db_url: str, tmp_path: Path
) -> tuple[subprocess.Popen[bytes], int, dict[str, Any]]:
    """`qualify serve` as a real process with a private token file; returns it, its port and its /health
    answer once it serves (the test fails with the server's output if it never does)."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "QUALIFY_HOME": str(home)}
    args = ["serve", "--port", str(port), "--db", db_url, "--token-file", str(token)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qualify.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for _ in range(100):
        try:
            return proc, port, httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    out, _ = proc.communicate(timeout=10)
    pytest.fail(f"qualify serve did not start: {out.decode(errors='replace')[-1000:]}")
