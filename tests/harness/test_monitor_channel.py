"""The harness's CUDA activity monitor on a CPU machine: the real monitor file runs inside a (fake) engine's
interpreter through the launcher's hook, with tests/harness/fake_cupti standing in for cupti-python. What is
proven here is the protocol (hello, windows opened and closed by the harness, one report per window), the
aggregation and bounds of a report, and that silence or a closed channel is reported as such, never as an
empty success; what a real GPU records is tests/data/monitor's part."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from qualify.checks.monitor import window_costs
from qualify.launch.monitor import MONITOR_FILE, EngineMonitor, monitor_command
from qualify.watch import cupti

from .conftest import ROOT

FAKE = Path(__file__).resolve().parent / "fake_cupti"


def _start(tmp_path: Path, **env: str) -> tuple[EngineMonitor, subprocess.Popen]:
    mon = EngineMonitor(tmp_path / "run")
    extra, fds = mon.local_boot()
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_")}
    full.update(extra, **env, PYTHONPATH=os.pathsep.join([str(FAKE), str(ROOT)]))
    cmd = monitor_command(sys.executable, "tests.harness.fake_cuda_engine", [])
    proc = subprocess.Popen(cmd, env=full, pass_fds=fds, cwd=ROOT, stdin=subprocess.DEVNULL)
    mon.after_spawn()
    return mon, proc


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[EngineMonitor, subprocess.Popen]]:
    mon, proc = _start(tmp_path)
    yield mon, proc
    proc.kill()
    proc.wait()
    mon.close()


def _window(mon: EngineMonitor, label: str, seconds: float = 0.2) -> cupti.Window:
    with mon.window(label) as w:
        time.sleep(seconds)
    return cupti.parse_window(w.report)


def test_the_launcher_runs_the_monitor_file_first_and_the_module_as_main() -> None:
    cmd = monitor_command("/usr/bin/python3", "qualify.engine", ["serve", "--port", "0"])
    assert cmd == ["/usr/bin/python3", str(MONITOR_FILE), "qualify.engine", "serve", "--port", "0"]


def test_a_window_reports_the_kernels_graphs_calls_and_memory_recorded_between_open_and_close(
    started: tuple[EngineMonitor, subprocess.Popen],
) -> None:
    mon, _ = started
    w = _window(mon, "one")
    assert mon.hello is not None and mon.hello["error"] is None, mon.hello
    assert "CONCURRENT_KERNEL" in mon.hello["kinds"] and not mon.hello["torch_imported_before"]
    # No libcupti is mapped into the fake engine: its records come through cupti-python's objects, and the
    # hello says why the raw path is not used.
    assert mon.hello["buffers"] == "cupti-python" and "libcupti" in mon.hello["raw_error"], mon.hello
    assert w.reported and not w.truncated, w
    assert w.graph_ids == {42}
    assert w.names(in_graph=True) == {"_kda_decode_kernel", "rmsnorm", "linear_small"}
    assert w.names(in_graph=False) == {"argmax"}
    # Launches are aggregated with a count: a window's size does not grow with its length.
    assert len(w.kernels) == 4 and w.launches(in_graph=True) >= 3 * 10
    assert w.calls("GraphLaunch") >= 10
    second = _window(mon, "two")
    assert second.allocations == []  # the allocation happened before window one opened, and is not repeated
    assert [x["label"] for x in mon.windows] == ["one", "two"]
    assert (mon.run_dir / "monitor.jsonl").read_text().count("\n") == 2
    # Each report says what its open and close cost the run, and the monitor check sums them.
    costs = mon.windows[0]["costs_s"]
    assert set(costs) == {"arm", "flush_open", "flush_close", "disarm", "summarise", "callback"}
    assert all(isinstance(v, float) and v >= 0 for v in costs.values())
    assert set(window_costs(mon.windows)) == set(costs)


def test_a_report_is_bounded_and_says_when_it_was_truncated(tmp_path: Path) -> None:
    mon, proc = _start(tmp_path, FAKE_CUDA_NAMES="5000")
    try:
        w = _window(mon, "many", 0.5)
    finally:
        proc.kill()
        proc.wait()
        mon.close()
    assert w.truncated and len(w.kernels) <= 4096


def test_a_silenced_monitor_answers_with_empty_windows_that_fail_the_conditions(tmp_path: Path) -> None:
    mon, proc = _start(tmp_path, QUALIFY_LIAR_MONITOR="silent")
    try:
        w = _window(mon, "before decode 1x1")
    finally:
        proc.kill()
        proc.wait()
        mon.close()
    assert w.empty and w.missing is None
    steps = [cupti.StepWindows((1, 1), w, [w])]
    found = cupti.capture_conditions(steps, "triton")
    assert not found["capture_every_size_replayed_its_graph"][0]


def test_a_monitor_whose_channel_the_engine_closed_is_reported_missing(tmp_path: Path) -> None:
    mon, proc = _start(tmp_path, QUALIFY_LIAR_MONITOR="close")
    try:
        w = _window(mon, "x")
    finally:
        proc.kill()
        proc.wait()
        mon.close()
    assert w.missing is not None and not w.reported
    ok, why = cupti.hello_condition(mon.hello, mon.lost)
    assert not ok and why


def test_without_cupti_the_hello_says_why_and_windows_carry_the_error(tmp_path: Path) -> None:
    mon = EngineMonitor(tmp_path / "run")
    extra, fds = mon.local_boot()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_")}
    env.update(extra, PYTHONPATH=str(ROOT))  # no fake cupti on the path
    code = "import time; time.sleep(5)"
    proc = subprocess.Popen(
        [sys.executable, str(MONITOR_FILE), "runpy_stub"],
        env={**env, "STUB": code},
        pass_fds=fds,
        cwd=tmp_path,
    )
    (tmp_path / "runpy_stub.py").write_text("import os; exec(os.environ['STUB'])\n")
    mon.after_spawn()
    try:
        w = _window(mon, "w")
    finally:
        proc.kill()
        proc.wait()
        mon.close()
    assert mon.hello is not None and "cupti-python not importable" in mon.hello["error"]
    assert not w.reported and "cupti" in (w.error or "")
    assert not cupti.hello_condition(mon.hello, mon.lost)[0]


def test_a_switched_off_monitor_gives_windows_that_say_so(tmp_path: Path) -> None:
    mon = EngineMonitor(tmp_path / "run", enabled=False)
    assert mon.local_boot() == ({}, ())
    with mon.window("w") as w:
        pass
    assert "switched off" in w.report["missing"]


def test_a_container_gets_the_monitor_file_read_only_and_a_socket_of_the_harness(tmp_path: Path) -> None:
    from qualify.launch.base import EngineOptions
    from qualify.launch.docker import DockerLauncher
    from qualify.launch.monitor import CONTAINER_DIR

    launcher = DockerLauncher(EngineOptions("tiny", "auto"), "img", tmp_path / "run")
    # An image without an ENTRYPOINT, as the reference engine's: no Docker daemon is asked here.
    launcher._image = SimpleNamespace(attrs={"Config": {"Entrypoint": None}})
    cmd = launcher.command(monitored=True)
    assert cmd[:3] == ["python", f"{CONTAINER_DIR}/cupti_monitor.py", "qualify.engine"] and "serve" in cmd
    assert launcher.command()[:3] == ["python", "-m", "qualify.engine"]  # the refusal probe: no monitor
    env, volumes = launcher.monitor.docker_mount()
    try:
        assert volumes[str(MONITOR_FILE.parent)] == {"bind": CONTAINER_DIR, "mode": "ro"}
        (sock_dir,) = (k for k, v in volumes.items() if v["mode"] == "rw")
        assert Path(sock_dir, "monitor.sock").exists() and env["QUALIFY_MONITOR_SOCKET"].endswith(
            "monitor.sock"
        )
    finally:
        launcher.monitor.close()
    assert not Path(sock_dir).exists()
