"""The run's Xid watch state from its two watchers: active only with a live source, a replayed file never
active, a lost source unavailable on a GPU host with the time it was lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from qualify.run.pipeline import Pipeline
from receipts.statement import Faults


def _watcher(live: bool, **fields: Any) -> SimpleNamespace:
    base = {"kind": None, "source": None, "status": "not_started", "reason": None, "lost_at": None,
            "lines_read": 0, "devices": []}  # fmt: skip
    return SimpleNamespace(**{**base, **fields}, live=lambda: live)


def _state(kmsg: SimpleNamespace, nvml: SimpleNamespace, gpu_host: bool) -> dict[str, Any]:
    run = SimpleNamespace(kmsg=kmsg, nvml=nvml, _host_has_gpu=lambda: gpu_host)
    return Pipeline._xid_watch(run)  # type: ignore[arg-type]


LOST = "2026-12-01T14:00:00.5Z"
NO_NVML = _watcher(False, status="not_applicable", reason="NVML init failed")


@pytest.mark.parametrize("gpu_host", [True, False])
def test_a_replayed_file_is_never_active(gpu_host: bool) -> None:
    km = _watcher(False, kind="file", source="file:/tmp/x", status="replayed")
    nv = _watcher(True, status="stopped", devices=[{"index": 0}])  # even beside a live NVML
    w = _state(km, nv, gpu_host)
    assert w["state"] == "replayed" and "not a live watch" in w["reason"]


def test_a_lost_kernel_log_on_a_gpu_host_is_unavailable_since_it_was_lost() -> None:
    km = _watcher(False, kind="kmsg", source="/dev/kmsg", status="unavailable", lost_at=LOST,
                  reason=f"/dev/kmsg read failed: Input/output error at {LOST}")  # fmt: skip
    w = _state(km, NO_NVML, gpu_host=True)
    assert w["state"] == "unavailable" and w["since"] == LOST and "Input/output error" in w["reason"]
    faults = Faults(xid_watch=w["state"], xid_watch_reason=w["reason"], xid_watch_lost_at=w["since"])
    assert faults.blocking("gpu") == ["Xid watch unavailable on a gpu target"]


def test_nvml_not_registered_everywhere_leaves_only_a_live_kernel_log() -> None:
    nv = _watcher(False, status="watching", reason="Xid events could not be registered on GPU [1]")
    assert (
        _state(_watcher(False, kind="kmsg", source="/dev/kmsg", status="unavailable"), nv, True)["state"]
        == "unavailable"
    )
    live_log = _watcher(True, kind="kmsg", source="/dev/kmsg", status="watching")
    w = _state(live_log, nv, True)
    assert w["state"] == "active" and "/dev/kmsg" in w["reason"]


def test_no_gpu_is_not_applicable_and_live_nvml_is_active() -> None:
    assert _state(_watcher(False), NO_NVML, gpu_host=False)["state"] == "not_applicable"
    nv = _watcher(True, status="watching", devices=[{"index": 0}, {"index": 1}])
    assert _state(_watcher(False), nv, gpu_host=True)["state"] == "active"


def test_reading_the_kernel_log_on_a_host_without_a_gpu_is_not_watching() -> None:
    """Root can read /dev/kmsg on any host, but with no NVIDIA GPU there is no Xid to watch for: a CPU
    receipt must not say "watched for the whole run"."""
    live_log = _watcher(True, kind="kmsg", source="/dev/kmsg", status="watching", lines_read=812)
    w = _state(live_log, NO_NVML, gpu_host=False)
    assert w["state"] == "not_applicable" and "no NVIDIA GPU" in w["reason"]
    assert "/dev/kmsg" in w["reason"]  # the reason still says what was read
