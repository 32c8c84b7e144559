"""`qualify run --timeout` bounds the whole run, the store's append included: a writer that holds the store's
lock for longer makes the run give up at its deadline with one line naming the lock, and the signed receipt
is kept in the run directory rather than lost. The bound is the process's own wall time (the interpreter's
start and the engine's stop count too), on SQLite and on PostgreSQL. The kept receipt is reconciled by the
next `qualify gc` or `qualify run`: appended once the lock is free, listed with the command that appends it
while it is not."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from receipts.db import PG_WRITER_LOCK
from tests.harness.conftest import ROOT, Home

TIMEOUT_S = 20  # below the store's own 30 s lock wait, so an unbounded append would show
# What may pass after --timeout: the interpreter's exit, this test's own process start and wait, and a
# check that overruns its deadline on a loaded machine (before issue 27 the run's clock started after the
# interpreter's start, and a 2 s lock grace and a 5 s stop came after the deadline: 25 to 34 s for 20).
SLACK_S = 4.0


@contextlib.contextmanager
def _held(url: str) -> Iterator[None]:
    """Another writer holding the store's single-writer lock for the whole run."""
    if url.startswith("sqlite"):
        holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn, conn.begin():
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_WRITER_LOCK})
            yield
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_held_writer_lock_cannot_stretch_the_run_past_its_timeout(
    home: Home, dialect: str, request
) -> None:
    url = f"sqlite:///{home.db}" if dialect == "sqlite" else request.getfixturevalue("pg_url")
    env = home.env(QUALIFY_DB_URL=url)
    assert home.qualify("keys", "generate", env=env).code == 0  # the store exists and trusts the key
    with _held(url):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "qualify.cli", "run", "--timeout", str(TIMEOUT_S), "--json"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S + 120,
            env=env,
            cwd=ROOT,
        )
        elapsed = time.monotonic() - started
    assert proc.returncode != 0
    # --timeout is the whole run: not the deadline plus the engine's stop plus a lock wait on top.
    assert elapsed < TIMEOUT_S + SLACK_S, (elapsed, proc.stderr[-2000:])
    print(f"{dialect}: qualify run --timeout {TIMEOUT_S} with the writer lock held took {elapsed:.1f} s")
    last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1]
    assert "lock" in last.lower(), proc.stderr[-2000:]
    kept = list((home.path / "runs").glob("*/receipt.dsse.json"))
    assert len(kept) == 1, proc.stderr[-2000:]
    rid = hashlib.sha256(kept[0].read_bytes()).hexdigest()
    if dialect == "sqlite":
        assert home.predicates() == []  # nothing reached the store while the lock was held
        with _held(url):  # still held: gc names the receipt and the exact command, within a short wait
            listed = home.qualify("gc", "--no-docker", "--json", env=env)
        assert listed.code == 0, listed.stderr[-2000:]
        (item,) = json.loads(listed.stdout)["reconciled_receipts"]
        assert item["receipt_id"] == rid and item["log_index"] is None
        assert item["command"] == f"qualify receipts import {kept[0]}" and "lock" in item["problem"]
        stored = home.qualify("gc", "--no-docker", "--json", env=env)
        (item,) = json.loads(stored.stdout)["reconciled_receipts"]
        assert item["receipt_id"] == rid and item["log_index"] == 1
        assert (
            json.loads(home.qualify("gc", "--no-docker", "--json", env=env).stdout)["reconciled_receipts"]
            == []
        )
    else:
        # The next run appends it before its own.
        again = home.qualify("run", "--timeout", str(TIMEOUT_S), "--json", env=env, timeout=TIMEOUT_S + 60)
        assert f"stored receipt {rid}" in again.stderr, again.stderr[-2000:]
    shown = home.qualify("receipts", "show", rid, "--json", env=env)
    assert shown.code == 0 and json.loads(shown.stdout)["id"] == rid
