"""NVML Xid watcher (nvidia-ml-py): critical-Xid events of every GPU for the whole run.

Without an NVIDIA driver or GPU it reports `not_applicable` with the reason, explicitly, never silence. It is
live only when Xid event registration succeeded on every GPU and its event loop is running (`live()`).
"""

from __future__ import annotations

import ctypes
import threading
from datetime import UTC, datetime
from typing import Any

from qualify.watch.xid import XidEvent, classify

_WAIT_MS = 500


class NvmlWatcher:
    def __init__(self) -> None:
        self.status = "not_started"  # watching | not_applicable | error | stopped
        self.reason: str | None = None
        self.lost_at: str | None = None  # RFC 3339: when a running event loop failed
        self.devices: list[dict[str, Any]] = []
        self.driver: str | None = None
        self.events: list[XidEvent] = []
        self._nvml: Any = None
        self._set: Any = None
        self._handles: dict[Any, str] = {}
        self._device_handles: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> NvmlWatcher:
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; say so rather than pass silently
            self.status, self.reason = "error", f"nvidia-ml-py is not installed ({exc})"
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # LibraryNotFound / DriverNotLoaded / NoPermission: no NVIDIA GPU we can watch on this machine.
            self.status = "not_applicable"
            self.reason = f"no NVIDIA driver or GPU: NVML init failed ({exc})"
            return self
        self._nvml = pynvml
        try:
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                self.status, self.reason = "not_applicable", "NVML sees no GPU"
                pynvml.nvmlShutdown()
                self._nvml = None
                return self
            self._set = pynvml.nvmlEventSetCreate()
            for i in range(count):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                pci = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
                info = {"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)), "pci": pci}
                try:
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._set)
                    info["xid_events"] = "registered"
                except pynvml.NVMLError as exc:
                    info["xid_events"] = f"not supported: {exc}"
                self._handles[_addr(h)] = pci
                self._device_handles.append(h)
                self.devices.append(info)
        except pynvml.NVMLError as exc:
            self.status, self.reason = "error", f"NVML setup failed: {exc}"
            self._shutdown()
            return self
        self.status = "watching"
        unregistered = [d["index"] for d in self.devices if d.get("xid_events") != "registered"]
        if unregistered:
            self.reason = f"Xid events could not be registered on GPU {unregistered}"
        self._thread = threading.Thread(target=self._loop, name="nvml-watch", daemon=True)
        self._thread.start()
        return self

    @property
    def registered_all(self) -> bool:
        """Xid event registration succeeded on every device NVML lists (and there is at least one)."""
        return bool(self.devices) and all(d.get("xid_events") == "registered" for d in self.devices)

    def live(self) -> bool:
        """Registered on every GPU, and the event loop is running (or ran until `stop()` without failing)."""
        if not self.registered_all:
            return False
        if self.status == "watching":
            return self._thread is not None and self._thread.is_alive()
        return self.status == "stopped"

    def compute_pids(self) -> dict[int, list[int]] | None:
        """pid -> indices of the GPUs it runs compute work on, as the driver lists them; None when NVML is
        not running here. The harness's own view of which process is on which GPU."""
        if self._nvml is None or not self._device_handles:
            return None
        out: dict[int, list[int]] = {}
        try:
            for index, handle in enumerate(self._device_handles):
                for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    out.setdefault(int(proc.pid), []).append(index)
        except self._nvml.NVMLError:
            return None
        return out

    def device_memory(self) -> dict[int, tuple[int, int]] | None:
        """GPU index -> (free bytes, total bytes) as the driver counts them; None when NVML is not running
        here."""
        if self._nvml is None or not self._device_handles:
            return None
        out: dict[int, tuple[int, int]] = {}
        try:
            for index, handle in enumerate(self._device_handles):
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out[index] = (int(info.free), int(info.total))
        except self._nvml.NVMLError:
            return None
        return out

    def compute_memory(self) -> dict[int, dict[int, int | None]] | None:
        """pid -> {GPU index: bytes of device memory it holds there (None where the driver does not say,
        as in some containers)}; None when NVML is not running here."""
        if self._nvml is None or not self._device_handles:
            return None
        out: dict[int, dict[int, int | None]] = {}
        try:
            for index, handle in enumerate(self._device_handles):
                for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    out.setdefault(int(proc.pid), {})[index] = int(used) if isinstance(used, int) else None
        except self._nvml.NVMLError:
            return None
        return out

    def _lose(self, reason: str) -> None:
        self.lost_at = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        self.status, self.reason = "error", f"{reason} at {self.lost_at}"

    def _loop(self) -> None:
        try:
            self._wait_events()
        except Exception as exc:  # the loop must never end silently while the status reads "watching"
            self._lose(f"NVML event loop failed: {type(exc).__name__}: {exc}")

    def _wait_events(self) -> None:
        pynvml = self._nvml
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(self._set, _WAIT_MS)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as exc:
                self._lose(f"NVML event wait failed: {exc}")
                return
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                ev = classify(
                    int(data.eventData), source="nvml", device=self._handles.get(_addr(data.device))
                )
                with self._lock:
                    self.events.append(ev)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._shutdown()
        if self.status == "watching":
            self.status = "stopped"

    def _shutdown(self) -> None:
        if self._nvml is None:
            return
        try:
            if self._set is not None:
                self._nvml.nvmlEventSetFree(self._set)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
        self._nvml = None

    def snapshot(self) -> list[XidEvent]:
        with self._lock:
            return list(self.events)

    def evidence(self) -> dict:
        return {
            "status": self.status,
            "reason": self.reason,
            "lost_at": self.lost_at,
            "registered_all": self.registered_all,
            "driver": self.driver,
            "devices": self.devices,
            "events": [e.to_evidence() for e in self.snapshot()],
        }


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _addr(handle: Any) -> int | None:
    """A device handle's pointer value: the key that ties an event back to its GPU."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
