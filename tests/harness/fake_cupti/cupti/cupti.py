"""Fake `cupti.cupti` (see the package docstring): activity kinds, buffer callbacks, flush, timestamps."""

from __future__ import annotations

import enum
import threading
import time


class ActivityKind(enum.IntEnum):
    CONCURRENT_KERNEL = 10
    DRIVER = 5
    RUNTIME = 6
    MEMORY2 = 49
    GRAPH_TRACE = 55


_CALLS = {
    (1, 500): "cuGraphInstantiateWithFlags",
    (1, 501): "cuGraphLaunch",
    (1, 502): "cuStreamBeginCapture_v2",
}
_lock = threading.Lock()
_enabled: set[int] = set()
_selected: set[tuple[int, int]] = set()  # (domain, cbid) whose API records are on
_pending: list[object] = []
_callbacks: tuple | None = None


class _Record:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


class ActivityKernel9(_Record):
    pass


class ActivityAPI(_Record):
    pass


class ActivityMemory4(_Record):
    pass


def get_callback_name(domain: int, cbid: int) -> str:
    name = _CALLS.get((domain, cbid))
    if name is None:
        raise ValueError("unknown callback id")
    return name


def activity_register_callbacks(requested, completed) -> None:
    global _callbacks
    _callbacks = (requested, completed)


def activity_enable(kind: int) -> None:
    _enabled.add(int(kind))


def activity_disable(kind: int) -> None:
    _enabled.discard(int(kind))


def activity_enable_driver_api(cbid: int, enable: int) -> None:
    (_selected.add if enable else _selected.discard)((1, cbid))


def activity_enable_runtime_api(cbid: int, enable: int) -> None:
    (_selected.add if enable else _selected.discard)((2, cbid))


def get_timestamp() -> int:
    return time.monotonic_ns()


def activity_flush_all(flag: int) -> None:
    with _lock:
        out, _pending[:] = list(_pending), []
    if _callbacks is not None and out:
        _callbacks[1](out)


# ------------------------------------------------------------ what the fake engine "launches"
def kernel(name: str, graph: int = 0, node: int = 0, grid: tuple[int, int, int] = (1, 1, 1)) -> None:
    if ActivityKind.CONCURRENT_KERNEL in _enabled:
        rec = ActivityKernel9(
            start=get_timestamp(), name=name, grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=128,
            block_y=1, block_z=1, stream_id=7, graph_id=graph, graph_node_id=node,
        )  # fmt: skip
        with _lock:
            _pending.append(rec)


def api(cbid: int) -> None:
    if ActivityKind.DRIVER in _enabled or (1, cbid) in _selected:
        rec = ActivityAPI(start=get_timestamp(), kind=int(ActivityKind.DRIVER), cbid=cbid, correlation_id=1,
                          return_value=0)  # fmt: skip
        with _lock:
            _pending.append(rec)


def memory(nbytes: int, alloc: bool = True) -> None:
    if ActivityKind.MEMORY2 in _enabled:
        op = 1 if alloc else 2
        rec = ActivityMemory4(
            timestamp=get_timestamp(), memory_operation_type=op, bytes=nbytes, address=1 << 40, memory_kind=2
        )
        with _lock:
            _pending.append(rec)
