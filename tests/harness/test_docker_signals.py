"""Docker runs end as cleanly as local ones: a SIGTERM during the backend-refusal probe aborts the run (never
a check failure) and removes the probe; containers whose harness is gone are removed by the next
`qualify run --launcher docker` or `qualify gc`, and the killed run gets its aborted receipt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qualify.launch.base import EngineOptions, harness_identity
from qualify.launch.docker import HARNESS_LABEL, LABEL, DockerLauncher, reap_orphans
from qualify.run.pipeline import RunInterrupted, _signals_raise

from .conftest import DOCKER, ROOT, Home

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.usefixtures("no_leftover_containers")]


def _labelled(run_id: str) -> list[str]:
    r = subprocess.run(
        [DOCKER, "ps", "-a", "--filter", f"label={LABEL}={run_id}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
    )
    return r.stdout.split()


def test_sigterm_during_the_refusal_probe_aborts_and_removes_the_probe(
    tmp_path: Path, engine_image: str
) -> None:
    launcher = DockerLauncher(
        EngineOptions(preset="tiny", kda_backend="auto"), engine_image, tmp_path / "run"
    )
    launcher._resolve_image()
    launcher.command = lambda kda_backend=None: ["sleep", "60"]  # type: ignore[method-assign]  # a slow probe
    threading.Timer(3.0, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(RunInterrupted, match="SIGTERM"), _signals_raise():
        launcher.run_refusal("bogus", 50)
    assert _labelled(launcher.run_id) == []


def test_containers_of_a_gone_harness_are_reaped_and_a_live_ones_kept(engine_image: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = {**harness_identity(), "pid": str(child.pid), "start": "0"}
    made = []
    for name, ident in (("dead", dead), ("live", harness_identity())):
        labels = {LABEL: f"reap-{name}-{os.getpid()}", HARNESS_LABEL: json.dumps(ident)}
        args = [f"--label={k}={v}" for k, v in labels.items()]
        subprocess.run([DOCKER, "create", *args, "--name", f"qualify-reap-{name}-{os.getpid()}", engine_image,
                        "sleep", "60"], check=True, capture_output=True)  # fmt: skip
        made.append(labels[LABEL])
    try:
        removed = reap_orphans()
        assert f"qualify-reap-dead-{os.getpid()}" in removed
        assert _labelled(made[0]) == [] and _labelled(made[1]) != []
    finally:
        subprocess.run([DOCKER, "rm", "-f", f"qualify-reap-live-{os.getpid()}"], capture_output=True)


def test_a_sigkilled_docker_run_is_closed_and_its_container_removed_by_gc(
    home: Home, engine_image: str
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qualify.cli",
            "run",
            "--launcher",
            "docker",
            "--image",
            engine_image,
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=home.env(),
        cwd=ROOT,
    )
    end = time.monotonic() + 90
    while time.monotonic() < end:
        progress = list(home.path.glob("runs/*/progress.json"))
        if progress and json.loads(progress[0].read_text()).get("checks"):
            break  # booted: the engine container runs
        time.sleep(0.2)
    run_dir = progress[0].parent
    run_id_containers = subprocess.run(
        [DOCKER, "ps", "-a", "--filter", f"label={HARNESS_LABEL}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    proc.kill()
    proc.wait(timeout=10)
    gc = home.qualify("gc", "--json")
    assert gc.code == 0, gc.stderr
    out = json.loads(gc.stdout)
    assert [c["run_dir"] for c in out["closed_runs"]] == [str(run_dir)]
    assert set(out["removed_containers"]) & set(run_id_containers)
    (p,) = home.predicates()
    assert p["verdict"] == "aborted" and p["request"]["launcher"] == "docker"
    assert p["engine"]["image_digest"], "the closed run names the image it was qualifying"
    assert home.verify_all().code == 0


def test_a_container_refusing_its_configuration_is_not_restarted(tmp_path: Path, engine_image: str) -> None:
    opts = EngineOptions(preset="tiny", kda_backend="bogus")
    launcher = DockerLauncher(opts, engine_image, tmp_path / "run")
    try:
        with pytest.raises(RuntimeError, match="refused its configuration"):
            launcher.start(60)
    finally:
        final = launcher.stop()
    assert final.restart_count == 0 and final.detail["exit_codes"] == [2], final
