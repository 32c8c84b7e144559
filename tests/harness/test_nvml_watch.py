"""The NVML watcher is live only with Xid event registration confirmed on every GPU and its event loop
running; without an NVIDIA driver it says `not_applicable` with its reason. The CPU tests drive the
watcher's own logic through a stand-in `pynvml` module (what NVML answers is not what they test); the
`gpu` test asserts registration against the real driver (scripts/gpu-check runs `-m gpu tests/harness`)."""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from typing import Any

import pytest

from qualify.watch.nvml import NvmlWatcher

HAS_NVIDIA = os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


class _NVMLError(Exception):
    pass


class _Timeout(_NVMLError):
    pass


def _stand_in_pynvml(*, devices: int, refuse_register: set[int], wait_fails: threading.Event) -> Any:
    """A `pynvml` with `devices` GPUs: registration raises on the indices in `refuse_register`; the event
    wait times out until `wait_fails` is set, then raises an NVML error."""
    m = types.ModuleType("pynvml")
    m.NVMLError, m.NVMLError_Timeout = _NVMLError, _Timeout
    m.nvmlEventTypeXidCriticalError = 8
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: b"999.0"
    m.nvmlDeviceGetCount = lambda: devices
    m.nvmlEventSetCreate = lambda: object()
    m.nvmlEventSetFree = lambda s: None
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: f"GPU {h}"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"0000:0{h}:00.0".encode())

    def register(handle: int, _types: int, _set: object) -> None:
        if handle in refuse_register:
            raise _NVMLError("Not Supported")

    def wait(_set: object, ms: int) -> Any:
        if wait_fails.is_set():
            raise _NVMLError("Unknown Error")
        time.sleep(ms / 1000 / 50)
        raise _Timeout()

    m.nvmlDeviceRegisterEvents, m.nvmlEventSetWait_v2 = register, wait
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=4000, usedGpuMemory=1 << 20),
        types.SimpleNamespace(pid=h, usedGpuMemory=None),
    ]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(free=(h + 1) << 30, total=80 << 30, used=0)
    return m


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    def install(devices: int = 2, refuse_register: set[int] = frozenset()) -> threading.Event:
        fails = threading.Event()
        monkeypatch.setitem(sys.modules, "pynvml", _stand_in_pynvml(
            devices=devices, refuse_register=set(refuse_register), wait_fails=fails
        ))  # fmt: skip
        return fails

    return install


def test_registered_on_every_gpu_with_a_running_loop_is_live(stand_in) -> None:
    stand_in(devices=2)
    w = NvmlWatcher().start()
    try:
        assert w.status == "watching" and w.registered_all and w.live()
        assert w.compute_pids() == {4000: [0, 1], 0: [0], 1: [1]}  # pid -> the GPUs it computes on
        # pid -> {GPU: device memory it holds}, None where the driver does not report it
        assert w.compute_memory() == {4000: {0: 1 << 20, 1: 1 << 20}, 0: {0: None}, 1: {1: None}}
        assert w.device_memory() == {0: (1 << 30, 80 << 30), 1: (2 << 30, 80 << 30)}  # (free, total)
    finally:
        w.stop()
    assert w.status == "stopped" and w.live()


def test_a_gpu_that_refuses_registration_makes_the_watch_not_live(stand_in) -> None:
    stand_in(devices=2, refuse_register={1})
    w = NvmlWatcher().start()
    try:
        assert not w.registered_all and not w.live()
        assert "[1]" in (w.reason or "")
    finally:
        w.stop()
    assert not w.live()


def test_an_event_loop_that_fails_mid_run_is_not_live_and_says_since_when(stand_in) -> None:
    fails = stand_in(devices=1)
    w = NvmlWatcher().start()
    assert w.live()
    fails.set()
    deadline = time.monotonic() + 3
    while w.status == "watching" and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop()
    assert w.status == "error" and not w.live()
    assert "event wait failed" in (w.reason or "") and (w.lost_at or "").endswith("Z")


@pytest.mark.skipif(HAS_NVIDIA, reason="this machine has an NVIDIA driver")
def test_no_nvidia_gpu_is_not_applicable_with_a_reason() -> None:
    w = NvmlWatcher().start()
    w.stop()
    ev = w.evidence()
    assert ev["status"] == "not_applicable"
    assert "NVML" in ev["reason"]
    assert ev["events"] == [] and not w.live()


@pytest.mark.gpu
def test_nvml_registers_xid_events_on_every_gpu() -> None:
    w = NvmlWatcher().start()
    try:
        assert w.status == "watching", w.reason
        assert w.devices and all(d["pci"] for d in w.devices)
        assert all(d["xid_events"] == "registered" for d in w.devices), w.devices
        assert w.registered_all and w.live()
        assert isinstance(w.compute_pids(), dict)  # the driver answers which processes run on each GPU
        free = w.device_memory() or {}
        assert free and all(0 < f <= t for f, t in free.values())  # (free, total) bytes per GPU
        time.sleep(1.2)  # more than two event waits: the loop is still running
        assert w.live(), w.reason
    finally:
        w.stop()
    assert w.status == "stopped" and w.live()
