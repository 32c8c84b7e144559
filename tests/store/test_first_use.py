"""The first use of a store is race-free: the log's origin and first entries are chosen under the writer
lock, and the log key is created whole, so concurrent first uses (`qualify keys generate` on an empty
PostgreSQL store, one data dir) all succeed and agree on one log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from receipts.store import Store
from receipts.verify import verify_log

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_first_uses_of_an_empty_postgresql_store_all_succeed(
    pg_url: str, tmp_path: Path, round_: int
) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_")}
    env.update(QUALIFY_HOME=str(home), QUALIFY_DB_URL=pg_url)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "qualify.cli", "keys", "generate", "--out", str(tmp_path / f"k{i}.key")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(PROCESSES)
    ]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    assert [code for code, _ in results] == [0] * PROCESSES, [err[-600:] for _, err in results]
    with Store.open(pg_url) as store:
        assert store.size() == PROCESSES
        assert len(store.signer_keys()) == PROCESSES
        assert verify_log(store).ok
        origin = store.origin
    assert origin is not None and origin.startswith("qualify.local/")
