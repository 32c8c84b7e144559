"""Monitor traces recorded on the H200 (tests/data/monitor/h200, README there): every monitored condition is
recomputed from the run's monitor.jsonl alone, must equal what its receipt says, and must show what the run
is for: the honest engine holds them all, each liar fails the condition that names its lie."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from qualify.watch import cupti

from .conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "monitor" / "h200"
# run -> conditions that must fail (empty: all must hold)
EXPECT: dict[str, set[str]] = {
    "honest-triton": set(),
    "honest-b12x": set(),
    "eager-one-size": {"capture_no_step_kernel_ran_eagerly"},
    "b12x-runs-triton": {"backend_resolved_kernels_in_every_step", "backend_no_kernels_of_other_backends"},
    "monitor-silenced": {"capture_every_size_replayed_its_graph"},
    "unmonitored": {"monitor_reported_from_the_engine", "capture_every_size_replayed_its_graph"},
    "recapture": {"reload_same_graphs_replayed", "reload_no_graph_instantiated"},
}
RUNS = (
    sorted(p.name for p in RECORDED.iterdir() if (p / "monitor.jsonl.gz").is_file())
    if RECORDED.is_dir()
    else []
)


def _monitor_check(pred: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pred["checks"] if c["name"] == "monitor")


def test_the_recorded_runs_are_committed() -> None:
    assert set(EXPECT) <= set(RUNS), f"missing recordings: {sorted(set(EXPECT) - set(RUNS))}"
    assert (RECORDED / "RECORDED").is_file(), "h200/RECORDED must say commit, command, device and date"


@pytest.mark.parametrize("run", sorted(EXPECT))
def test_a_recorded_run_judged_again_from_its_windows(run: str) -> None:
    d = RECORDED / run
    windows = [
        json.loads(line) for line in gzip.decompress((d / "monitor.jsonl.gz").read_bytes()).splitlines()
    ]
    pred = json.loads(gzip.decompress((d / "predicate.json.gz").read_bytes()))
    check = _monitor_check(pred)
    ev = check["evidence"]
    mon = ev["monitor"]
    plans = [tuple(p) for p in ev["plans"]]
    found, _ = cupti.evaluate(
        windows, plans, ev["backend"], ev.get("weights_bytes"), mon.get("hello"), mon.get("lost")
    )
    stored = {k: c["holds"] for k, c in check["conditions"].items()}
    assert {k: v[0] for k, v in found.items()} == stored
    assert all(c["source"] == "monitored" for c in check["conditions"].values())
    failing = {k for k, (holds, _) in found.items() if not holds}
    want = EXPECT.get(run)
    assert want is not None, f"{run}: no expectation for this recording"
    assert (failing == set()) if not want else want <= failing, {k: found[k][1] for k in failing}
    assert pred["verdict"] == ("qualified" if not want else "rejected")
