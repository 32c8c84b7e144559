"""A Docker engine stops by itself when its harness is gone (SIGKILL included): no pipe crosses into a
container, so the engine waits for a connection the harness must hold (a token and a heartbeat on a port
published on 127.0.0.1 only) and stops as on SIGTERM, its shared-memory files released, once it is lost.
The refusal probe goes with its harness too (its own watch, and the daemon removes it when it exits)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qualify.shm import SHM_PREFIX, shm_dir

from .conftest import DOCKER, ROOT, Home

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.usefixtures("no_leftover_containers")]

# The engine's silence limit (15 s) and its SIGTERM grace (10 s), with room for a loaded machine.
BOUND_S = 45.0


def _containers(label: str, *, running: bool) -> list[str]:
    args = [DOCKER, "ps", "--filter", f"label={label}", "--format", "{{.Names}}"]
    if not running:
        args.insert(2, "-a")
    return subprocess.run(args, capture_output=True, text=True).stdout.split()


def _run_of(pid: int) -> str | None:
    """The run id of the engine container whose harness is `pid`."""
    fmt = '{{.Label "org.qualify.run"}}\t{{.Names}}\t{{.Label "org.qualify.harness"}}'
    out = subprocess.run(
        [DOCKER, "ps", "--filter", "label=org.qualify.run", "--format", fmt], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        run_id, name, harness = ([*line.split("\t"), "", ""])[:3]
        with contextlib.suppress(ValueError, AttributeError):
            if name.startswith("qualify-engine-") and str(json.loads(harness).get("pid")) == str(pid):
                return run_id
    return None


def _wait_for(predicate, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def _stale_shm() -> set[str]:
    """Allocation files no live engine holds (what a killed engine would leave)."""
    out = set()
    for name in os.listdir(shm_dir()):
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(shm_dir(), name), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out.add(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return out


@pytest.mark.serial
def test_sigkill_of_the_harness_stops_the_engine_container_within_a_bound(
    home: Home, engine_image: str
) -> None:
    stale_before = _stale_shm()
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
        stderr=subprocess.PIPE,
        env=home.env(),
        cwd=ROOT,
    )
    try:
        # The engine container of this run is up (its harness is this process; other runs may share the
        # daemon).
        booted = _wait_for(lambda: _run_of(proc.pid) is not None, 240)
        assert booted is not None, "the engine container never ran"
        label = f"org.qualify.run={_run_of(proc.pid)}"
        # into the run: the engine boots or serves, the harness holds its watch (a CPU run can finish
        # about 10 s after its container starts, so not later than this)
        time.sleep(3)
        assert proc.poll() is None, "the run ended before the harness could be killed in it"
    finally:
        proc.kill()  # SIGKILL: the harness cannot stop anything itself
        proc.wait()
    stopped = _wait_for(lambda: not _containers(label, running=True), BOUND_S)
    assert stopped is not None, f"containers of the run still running {BOUND_S} s after the harness died"
    print(f"engine container stopped {stopped:.1f} s after the harness's SIGKILL")
    # Nothing of the probe is left, and the engine released its shared memory (it stopped as on SIGTERM).
    assert not [n for n in _containers(label, running=False) if n.startswith("qualify-refusal-")]
    assert _stale_shm() - stale_before == set()
    # The stopped engine container (its logs are the run's evidence) goes with the next gc, which also
    # closes the run with an aborted receipt.
    gc = home.qualify("gc", "--json")
    assert gc.code == 0, gc.stderr[-2000:]
    assert len(gc.summary()["closed_runs"]) == 1, gc.summary()
    assert not _containers(label, running=False), "a container of the run outlived gc"


def test_sigkill_during_the_refusal_probe_leaves_no_probe_behind(tmp_path: Path, engine_image: str) -> None:
    # A probe that does not refuse (a valid backend) serves until its harness's wait ends; here the harness
    # dies first.
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from qualify.launch.base import EngineOptions\n"
        "from qualify.launch.docker import DockerLauncher\n"
        f"launcher = DockerLauncher(EngineOptions(preset='tiny', kda_backend='auto'), {engine_image!r}, "
        f"Path({str(tmp_path / 'run')!r}))\n"
        "launcher._resolve_image()\n"
        "print(launcher.run_id, flush=True)\n"
        "launcher.run_refusal('torch', 300)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout is not None
        run_id = child.stdout.readline().strip()
        label = f"org.qualify.run={run_id}"
        assert _wait_for(lambda: bool(_containers(label, running=True)), 60) is not None
        time.sleep(5)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    gone = _wait_for(lambda: not _containers(label, running=False), BOUND_S)
    assert gone is not None, f"the refusal probe is still there {BOUND_S} s after its harness died"
    print(f"refusal probe gone {gone:.1f} s after the harness's SIGKILL")
