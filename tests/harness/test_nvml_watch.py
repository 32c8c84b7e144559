"""Without an NVIDIA driver the NVML watcher says `not_applicable` with its reason, explicitly."""

from __future__ import annotations

import os

import pytest

from qualify.watch.nvml import NvmlWatcher

HAS_NVIDIA = os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


@pytest.mark.skipif(HAS_NVIDIA, reason="this machine has an NVIDIA driver")
def test_no_nvidia_gpu_is_not_applicable_with_a_reason() -> None:
    w = NvmlWatcher().start()
    w.stop()
    ev = w.evidence()
    assert ev["status"] == "not_applicable"
    assert "NVML" in ev["reason"]
    assert ev["events"] == []


@pytest.mark.gpu
def test_nvml_watches_every_gpu() -> None:
    w = NvmlWatcher().start()
    try:
        assert w.status == "watching", w.reason
        assert w.devices and all(d["pci"] for d in w.devices)
    finally:
        w.stop()
    assert w.status == "stopped"
