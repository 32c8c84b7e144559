"""`qualify run --timeout` bounds the whole run, the store's append included: a writer that holds the store's
lock for longer makes the run give up at its deadline with one line naming the lock, and the signed receipt
is kept in the run directory rather than lost."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

from tests.harness.conftest import ROOT, Home

TIMEOUT_S = 25  # below the store's own 30 s lock wait, so an unbounded append would show


def test_a_held_writer_lock_cannot_stretch_the_run_past_its_timeout(home: Home) -> None:
    assert home.qualify("keys", "generate").code == 0  # the store exists and trusts the key before the run
    holder = sqlite3.connect(home.db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock for the whole run
    try:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "qualify.cli", "run", "--timeout", str(TIMEOUT_S), "--json"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S + 120,
            env=home.env(),
            cwd=ROOT,
        )
        elapsed = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert proc.returncode != 0
    # The deadline, a short grace for the append, the engine's stop and the interpreter: not the store's
    # own 30 s lock wait on top of the run.
    assert elapsed < TIMEOUT_S + 10, (elapsed, proc.stderr[-2000:])
    last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1]
    assert "lock" in last.lower(), proc.stderr[-2000:]
    kept = list((home.path / "runs").glob("*/receipt.dsse.json"))
    assert len(kept) == 1, proc.stderr[-2000:]
    assert home.predicates() == []  # nothing reached the store while the lock was held
