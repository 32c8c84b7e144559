"""No run is lost and nothing outlives it: every catchable signal to `qualify run` stores an aborted receipt
and stops the engine; a SIGKILLed harness's engine exits by itself, leaves no shared-memory file, and its run
is closed with an `aborted: harness killed` receipt by the next `qualify run` or `qualify gc`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qualify.launch.base import EngineOptions, harness_alive, harness_identity
from qualify.launch.local import LocalLauncher
from qualify.shm import SHM_PREFIX, shm_dir

from .conftest import ROOT, Home

pytestmark = pytest.mark.slow


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no longer runs
    except OSError:
        return True


def _wait_gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def _shm_files(pid: int) -> list[str]:
    # A sandboxed engine's own pid is 2, so another run's engine names its files alike: the tests that look
    # are `serial` (`make test` runs them when no other test runs an engine).
    return [n for n in os.listdir(shm_dir()) if n.startswith(f"{SHM_PREFIX}{pid}-")]


def _start_run(home: Home, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "qualify.cli", "run", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or home.env(),
        cwd=ROOT,
    )


def _engine_ready(home: Home, within_s: float = 60) -> tuple[int, int]:
    """The first engine that printed its ready line in this home's (only) run: (its host pid, as the
    launcher logged it; its own pid, as it printed it: 2 inside its sandbox's pid namespace, which also
    names its shared-memory files)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        for log in home.path.glob("runs/*/engine.log"):
            host = own = None
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("# qualify: engine host pid "):
                    host = int(line.split()[5])
                if "QUALIFY_ENGINE_READY" in line:
                    own = int(line.rsplit("pid=", 1)[1])
            if host is not None and own is not None:
                return host, own
        time.sleep(0.1)
    raise AssertionError("the engine never became ready")


@pytest.mark.serial
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_store_an_aborted_receipt_and_stop_the_engine(home: Home, sig: int) -> None:
    proc = _start_run(home)
    engine, own = _engine_ready(home)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-2000:]
    s = json.loads(out)
    assert s["verdict"] == "aborted" and signal.Signals(sig).name in s["reasons"][0]
    (p,) = home.predicates()
    assert p["verdict"] == "aborted"
    assert _wait_gone(engine, 5) and not _shm_files(own)
    assert home.verify_all().code == 0


@pytest.mark.serial
def test_a_sigkilled_harness_takes_its_engine_along_and_the_next_run_closes_its_run(home: Home) -> None:
    proc = _start_run(home)
    engine, own = _engine_ready(home)
    assert _shm_files(own), "the tiny engine holds shared-memory allocations while it runs"
    proc.kill()
    proc.communicate(timeout=10)
    # Nobody stops it: its sandbox dies with its parent (bwrap --die-with-parent, SIGKILL to the whole pid
    # namespace), whatever the engine does; the shared-memory files it could not release are swept by the
    # next engine, the next run's supervisor or `qualify gc`.
    assert _wait_gone(engine, 15), "the engine outlived its SIGKILLed harness"
    assert home.predicates() == []
    # The next run (here one whose own boot is cut short) closes the killed run first.
    nxt = home.qualify("run", "--json", "--timeout", "0.2")
    assert nxt.code == 1, nxt.stderr[-2000:]
    assert "whose harness was killed" in nxt.stderr
    closed, own = home.predicates()
    assert closed["verdict"] == "aborted"
    assert any("aborted: harness killed" in (c["reason"] or "") for c in closed["checks"])
    assert own["verdict"] == "aborted"
    assert home.verify_all().code == 0
    # Closed once: a later gc finds nothing more to close.
    gc = home.qualify("gc", "--json", "--no-docker")
    assert gc.code == 0 and json.loads(gc.stdout)["closed_runs"] == []
    assert not _shm_files(own)


def test_gc_closes_a_killed_run_and_never_a_live_one(home: Home) -> None:
    proc = _start_run(home)
    _engine_ready(home)
    live = home.qualify("gc", "--json", "--no-docker")
    assert live.code == 0 and json.loads(live.stdout)["closed_runs"] == []  # its harness holds the lock
    proc.kill()
    proc.communicate(timeout=10)
    gc = home.qualify("gc", "--json", "--no-docker")
    assert gc.code == 0, gc.stderr
    (closed,) = json.loads(gc.stdout)["closed_runs"]
    assert Path(closed["run_dir"], "receipt.dsse.json").is_file()
    (p,) = home.predicates()
    assert p["verdict"] == "aborted"


def test_a_timeout_shorter_than_the_boot_aborts_and_does_not_reject(home: Home) -> None:
    ran = home.qualify("run", "--json", "--timeout", "0.5")
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "aborted", s
    assert "run timeout" in s["reasons"][0] and "boot" in s["reasons"][0]


@pytest.mark.serial
@pytest.mark.parametrize("kernel_says", [False, True])
def test_a_sigkilled_engine_is_recorded_as_such_with_oom_only_from_the_kernels_record(
    home: Home, tmp_path: Path, kernel_says: bool
) -> None:
    kmsg = tmp_path / "kmsg.txt"
    kmsg.write_text("")
    proc = _start_run(home, env=home.env(QUALIFY_KMSG_SOURCE=str(kmsg)))
    engine, own = _engine_ready(home)  # the kernel's log names the host pid
    os.kill(engine, signal.SIGKILL)
    if kernel_says:
        with kmsg.open("a") as f:
            f.write(f"Out of memory: Killed process {engine} (python) total-vm:1000kB, anon-rss:900kB\n")
    out, err = proc.communicate(timeout=120)
    s = json.loads(out)
    faults = s["faults"]
    assert "killed by signal 9 (SIGKILL)" in faults["engine_exits"], faults
    assert faults["oom"]["kernel"] == ("observed" if kernel_says else "unknown")
    assert faults["oom"]["container"] is False
    assert not _shm_files(own)  # the supervisor swept what the killed engine could not release
    assert home.verify_all().code == 0


def test_an_engine_refusing_its_configuration_is_not_restarted(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"}
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="bogus"),
        tmp_path / "run",
        env={**env, "QUALIFY_HOME": str(tmp_path / "home")},
    )
    try:
        with pytest.raises(RuntimeError, match="refused its configuration"):
            launcher.start(60)
    finally:
        final = launcher.stop()
    assert final.restart_count == 0 and final.detail["boots"] == 1
    assert final.detail["refused_at_construction"] is True


def test_a_harness_identity_lives_exactly_as_long_as_its_process() -> None:
    assert harness_alive(harness_identity()) is True
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ident = {**harness_identity(), "pid": str(child.pid)}
    with open(f"/proc/{child.pid}/stat") as fh:
        ident["start"] = fh.read().rsplit(")", 1)[1].split()[19]
    assert harness_alive(ident) is True
    child.kill()
    child.wait()
    assert harness_alive(ident) is False
    assert harness_alive({**harness_identity(), "start": "1"}) is False  # same pid, another process
    assert harness_alive({**harness_identity(), "host": "elsewhere"}) is None  # not ours to judge


@pytest.mark.serial
def test_a_crashed_engines_shared_memory_is_swept_by_its_supervisor(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"}
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="auto"),
        tmp_path / "run",
        max_restarts=0,  # no next engine to sweep on its way up: the supervisor must
        env={**env, "QUALIFY_HOME": str(tmp_path / "home"), "QUALIFY_ENGINE_FAULT": "crash-after-boot:0.5"},
    )
    try:
        launcher.start(60)
        pid = launcher.status().detail["pid"]
        assert _wait_gone(pid, 30)
        end = time.monotonic() + 10
        while launcher.status().detail["exit_codes"] == [] and time.monotonic() < end:
            time.sleep(0.05)
        assert not _shm_files(pid)  # os._exit: it released nothing itself
        assert launcher.status().detail["exits"] == ["exited with code 3"]
    finally:
        launcher.stop()


def test_the_cgroups_oom_kill_count_is_the_kernels_record_too(tmp_path: Path) -> None:
    from qualify.watch.oom import cgroup_oom_kills, kernel_oom

    (tmp_path / "proc-cgroup").write_text("0::/user.slice/run-1.scope\n")
    events = tmp_path / "cg" / "user.slice" / "run-1.scope" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    before = cgroup_oom_kills(tmp_path / "cg", tmp_path / "proc-cgroup")
    events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    after = cgroup_oom_kills(tmp_path / "cg", tmp_path / "proc-cgroup")
    assert (before, after) == (1, 2)
    assert kernel_oom([-9], [10], [], before, after) == "observed"
    assert kernel_oom([-9], [10], [], after, after) == "unknown"
    assert kernel_oom([-9], [10], [], None, None) == "unknown"  # no cgroup v2 here: unknown, never False
    assert kernel_oom([3], [10], [10], before, after) is None  # not SIGKILLed: nothing to say
    assert cgroup_oom_kills(tmp_path / "nowhere", tmp_path / "proc-cgroup") is None
