"""The harness's CUDA activity monitor through the real `qualify run` path on a GPU (scripts/gpu-check
monitor): the honest proxy engine qualifies with --spec mtp:3 on triton and on b12x with every monitored
condition present, holding and `monitored`; four lying engines are rejected by the monitored condition that
catches their lie while their own counters keep telling the story they chose.

The runs go in two stages, each with a data dir of its own: the two honest runs side by side, then the
five others at once. (All seven at once fitted one H200; on one H100 on 2026-12-05 the honest runs, which
must hold every timed condition, failed `graph_steps_faster_than_eager` or the speculation timing rule with
the GPU and the host shared seven ways, while every liar was still rejected for its lie. The liars are
judged by monitored conditions, which no load moves.) With QUALIFY_MONITOR_TRACES=DIR every run's monitor
windows, receipt predicate and summary are copied there (how tests/data/monitor/ was recorded:
tests/data/monitor/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, check

pytestmark = pytest.mark.gpu

RUN_TIMEOUT_S = 380  # per stage
STAGES = (("honest-triton", "honest-b12x"),)  # then every other run, at once
SPEC = ("--spec", "mtp:3", "--layout", "2304,2304,2304,9216")
RUNS: dict[str, tuple[str | None, tuple[str, ...], dict[str, str]]] = {
    "honest-triton": (None, ("--preset", "proxy", "--kda-backend", "triton", *SPEC), {}),
    "honest-b12x": (None, ("--preset", "proxy", "--kda-backend", "b12x", *SPEC), {}),
    "eager-one-size": ("graph_eager_one_size", ("--preset", "proxy", "--kda-backend", "triton", *SPEC), {}),
    "b12x-runs-triton": ("b12x_runs_triton", ("--preset", "proxy", "--kda-backend", "b12x", *SPEC), {}),
    "recapture": ("recapture_after_reload", ("--preset", "proxy", "--kda-backend", "triton", *SPEC), {}),
    "monitor-silenced": ("monitor_off", ("--preset", "proxy", "--kda-backend", "triton", *SPEC), {}),
    # The operator's switch: the honest engine without the monitor (its cost, beside honest-triton).
    "unmonitored": (
        None,
        ("--preset", "proxy", "--kda-backend", "triton", *SPEC),
        {"QUALIFY_MONITOR": "off"},
    ),
}


def _env(home: Path, liar: str | None, extra: dict[str, str]) -> dict[str, str]:
    keep = ("QUALIFY_BWRAP", "QUALIFY_ENGINE_PATH", "QUALIFY_CACHE_DIR")  # how gpu-check sets up the sandbox
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k in keep}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["QUALIFY_HOME"] = str(home)
    if liar:
        env["QUALIFY_ENGINE_MODULE"] = f"tests.liars.{liar}"
    return {**env, **extra}


def _collect(name: str, home: Path, proc: subprocess.CompletedProcess | None, out: Path | None) -> dict:
    import sqlite3

    preds: list[dict[str, Any]] = []
    db = home / "qualify.db"
    if db.exists():
        with sqlite3.connect(db) as c:
            preds = [json.loads(r[0]) for r in c.execute("SELECT predicate FROM receipts ORDER BY log_idx")]
    windows = sorted(home.glob("runs/*/monitor.jsonl"))
    result = {"name": name, "predicate": preds[-1] if preds else None, "windows": windows, "proc": proc}
    if out is not None:
        dest = out / name
        dest.mkdir(parents=True, exist_ok=True)
        for w in windows:
            shutil.copy(w, dest / "monitor.jsonl")
        if preds:
            (dest / "predicate.json").write_text(json.dumps(preds[-1], indent=1))
        if proc is not None:
            (dest / "stdout.json").write_text(proc.stdout or "")
            (dest / "stderr.txt").write_text((proc.stderr or "")[-20000:])
        for log in home.glob("runs/*/engine.log"):
            (dest / "engine.log.tail").write_text(
                "\n".join(log.read_text(errors="replace").splitlines()[-200:])
            )
    return result


def _start(name: str, home: Path) -> subprocess.Popen:
    liar, args, extra = RUNS[name]
    cmd = [sys.executable, "-m", "qualify.cli", "run", "--json", "--timeout", str(RUN_TIMEOUT_S - 30), *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(home, liar, extra)
    )


def stages(wanted: list[str]) -> list[list[str]]:
    """The runs asked for, in the order they go: each of STAGES' groups (those of it asked for), then the
    rest at once; empty stages dropped."""
    first = [[n for n in group if n in wanted] for group in STAGES]
    rest = [n for n in wanted if not any(n in group for group in STAGES)]
    return [g for g in (*first, rest) if g]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    traces = os.environ.get("QUALIFY_MONITOR_TRACES")
    out = Path(traces) if traces else None
    only = os.environ.get("QUALIFY_MONITOR_RUNS")
    wanted = [k for k in RUNS if not only or k in only.split(",")]
    results: dict[str, dict] = {}
    for stage in stages(wanted):
        homes = {name: tmp_path_factory.mktemp(name) for name in stage}
        procs = {name: _start(name, homes[name]) for name in stage}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for name, p in procs.items():
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            done = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
            results[name] = _collect(name, homes[name], done, out)
    return results


def _monitor(r: dict) -> dict[str, Any]:
    assert r["predicate"] is not None, (r["proc"].stderr or "")[-3000:]
    return check(r["predicate"], "monitor")


def _failing(r: dict) -> dict[str, str]:
    return {k: c["detail"] for k, c in _monitor(r)["conditions"].items() if not c["holds"]}


@pytest.mark.parametrize("name", ["honest-triton", "honest-b12x"])
def test_the_honest_engine_qualifies_with_every_monitored_condition(runs: dict, name: str) -> None:
    if name not in runs:
        pytest.skip(f"{name} not asked for (QUALIFY_MONITOR_RUNS)")
    p = runs[name]["predicate"]
    assert p is not None and p["verdict"] == "qualified", (
        _failing(runs[name]),
        runs[name]["proc"].stdout[-3000:],
    )
    mon = _monitor(runs[name])
    assert mon["status"] == "pass"
    conds = mon["conditions"]
    for prefix in ("capture_", "backend_", "reload_"):
        assert any(k.startswith(prefix) for k in conds), conds
    assert all(c["source"] == "monitored" and c["holds"] for c in conds.values())
    # The engine's own counters stay beside them as its word.
    assert check(p, "capture")["conditions"]["graph_mode_used"]["source"] == "engine"


def _rejected_by(runs: dict, name: str, conditions: set[str]) -> dict[str, str]:
    if name not in runs:
        pytest.skip(f"{name} not asked for (QUALIFY_MONITOR_RUNS)")
    p = runs[name]["predicate"]
    assert p is not None and p["verdict"] == "rejected", runs[name]["proc"].stdout[-3000:]
    failing = _failing(runs[name])
    assert conditions <= set(failing), failing
    return failing


def test_an_engine_that_runs_one_size_eagerly_is_rejected(runs: dict) -> None:
    failing = _rejected_by(runs, "eager-one-size", {"capture_no_step_kernel_ran_eagerly"})
    assert "2x" in failing["capture_no_step_kernel_ran_eagerly"]
    # Its counters said graph for every step.
    p = runs["eager-one-size"]["predicate"]
    assert check(p, "capture")["conditions"]["graph_mode_used"]["holds"]


def test_an_engine_that_runs_triton_while_reporting_b12x_is_rejected(runs: dict) -> None:
    failing = _rejected_by(
        runs,
        "b12x-runs-triton",
        {"backend_resolved_kernels_in_every_step", "backend_no_kernels_of_other_backends"},
    )
    assert "triton" in failing["backend_no_kernels_of_other_backends"]


def test_an_engine_that_recaptures_after_reload_is_rejected(runs: dict) -> None:
    _rejected_by(runs, "recapture", {"reload_same_graphs_replayed", "reload_no_graph_instantiated"})
    p = runs["recapture"]["predicate"]
    assert check(p, "reload")["conditions"]["no_recapture"]["holds"]  # its counters say none


def test_an_engine_that_silences_the_monitor_is_rejected(runs: dict) -> None:
    failing = _rejected_by(runs, "monitor-silenced", {"capture_every_size_replayed_its_graph"})
    assert failing


def test_without_the_monitor_a_gpu_run_does_not_qualify_and_says_it_was_switched_off(runs: dict) -> None:
    failing = _rejected_by(runs, "unmonitored", {"monitor_reported_from_the_engine"})
    assert "switched off" in json.dumps(_monitor(runs["unmonitored"]))
    assert failing
