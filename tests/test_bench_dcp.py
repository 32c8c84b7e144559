"""bench/dcp.py runs end to end on CPU (gloo, tiny shapes), records what it compares, and records the DCP
sizes it could not run as skipped with a reason (on a GPU host with too few GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dcp_bench_compares_rank_counts_in_one_run_on_cpu(tmp_path):
    out = tmp_path / "dcp.json"
    args = ["--device", "cpu", "--context", "256", "--ranks", "1,2", "--rounds", "2", "--replays", "1"]
    args += ["--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "bench" / "dcp.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["median_us"]) == {"1", "2"} and all(v > 0 for v in res["median_us"].values())
    assert res["speedup_vs_dcp1"]["1"] == 1.0 and "not a GPU figure" in res["timing"]
    assert res["provenance"]["script"] == "bench/dcp.py" and "excluded" in res["what"]
