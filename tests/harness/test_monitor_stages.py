"""The order of the monitor's GPU runs (tests/harness/test_monitor_gpu.py): the two honest runs first, side
by side, then the rest at once; a subset asked for keeps that order. Checked here, without a GPU."""

from __future__ import annotations

from .test_monitor_gpu import RUNS, stages


def test_the_honest_runs_go_first_side_by_side_and_the_rest_at_once() -> None:
    assert stages(list(RUNS)) == [
        ["honest-triton", "honest-b12x"],
        ["eager-one-size", "b12x-runs-triton", "recapture", "monitor-silenced", "unmonitored"],
    ]
    assert stages(["recapture", "honest-b12x"]) == [["honest-b12x"], ["recapture"]]
    assert stages(["recapture"]) == [["recapture"]]
    assert stages([]) == []
