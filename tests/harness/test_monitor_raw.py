"""The monitor's raw buffer path (qualify/monitor/cupti_monitor.py, RawBuffers): records read at the offsets
a layout names give the same tuples the cupti-python path builds from its objects, and what it cannot read
is counted, never dropped silently. The libcupti side runs only on a GPU (bench/monitor_flush.py compares
both paths there); here the layouts are synthetic, with fields out of order and padding as CUPTI's are."""

from __future__ import annotations

import struct

import pytest

from qualify.monitor import cupti_monitor as cm

# A kernel record with its fields in another order than asked, gaps between them (kind first, as in CUPTI).
KERNEL = {
    "start": ("u", 8, 8),
    "grid_x": ("i", 4, 16),
    "grid_y": ("i", 4, 20),
    "grid_z": ("i", 4, 24),
    "block_x": ("i", 4, 28),
    "block_y": ("i", 4, 32),
    "block_z": ("i", 4, 36),
    "stream_id": ("u", 4, 44),
    "name": ("i", 8, 48),
    "graph_node_id": ("u", 8, 64),
    "graph_id": ("u", 4, 72),
}
API = {
    "cbid": ("u", 4, 4),
    "start": ("u", 8, 8),
    "correlation_id": ("u", 4, 24),
    "return_value": ("u", 4, 28),
}
MEMORY = {
    "memory_operation_type": ("u", 4, 4),
    "memory_kind": ("u", 4, 8),
    "timestamp": ("u", 8, 16),
    "address": ("u", 8, 24),
    "bytes": ("u", 8, 32),
}
GRAPH = {"start": ("u", 8, 8), "graph_id": ("u", 4, 24)}
SIZE = 80
K_KERNEL, K_DRIVER, K_RUNTIME, K_MEMORY, K_GRAPH, K_OTHER = 10, 5, 6, 49, 38, 3


def _structs() -> dict:
    layouts = {"kernel": KERNEL, "api": API, "memory": MEMORY, "graph": GRAPH}
    return {w: cm.layout_struct(layouts[w], cm.RAW_LAYOUTS[w][1]) for w in layouts}


def _record(kind: int, layout: dict, **values) -> bytes:
    buf = bytearray(SIZE)
    struct.pack_into("<I", buf, 0, kind)
    for name, v in values.items():
        k, size, off = layout[name]
        struct.pack_into("<" + cm._STRUCT_CODES[(k, size)], buf, off, v)
    return bytes(buf)


def test_records_read_at_their_offsets_give_the_cupti_python_paths_tuples() -> None:
    names = {0x1000: "_kda_decode_kernel", 0x2000: "argmax"}
    recs = [
        _record(
            K_KERNEL,
            KERNEL,
            start=7,
            name=0x1000,
            grid_x=2,
            grid_y=1,
            grid_z=1,
            block_x=128,
            block_y=1,
            block_z=1,
            stream_id=13,
            graph_id=42,
            graph_node_id=3,
        ),
        _record(
            K_KERNEL,
            KERNEL,
            start=8,
            name=0x2000,
            grid_x=1,
            grid_y=1,
            grid_z=1,
            block_x=32,
            block_y=1,
            block_z=1,
            stream_id=7,
            graph_id=0,
            graph_node_id=0,
        ),
        _record(K_DRIVER, API, cbid=514, start=9, correlation_id=77, return_value=0),
        _record(K_RUNTIME, API, cbid=999, start=10, correlation_id=78, return_value=0),  # not a graph call
        _record(
            K_MEMORY,
            MEMORY,
            memory_operation_type=1,
            memory_kind=3,
            timestamp=11,
            address=0xABC,
            bytes=1 << 20,
        ),
        _record(K_GRAPH, GRAPH, start=12, graph_id=42),
        _record(K_OTHER, KERNEL),  # a kind this monitor did not ask for: skipped, as on the other path
    ]
    view = memoryview(b"".join(recs))
    kinds = {K_KERNEL: "kernel", K_DRIVER: "api", K_RUNTIME: "api", K_MEMORY: "memory", K_GRAPH: "graph"}
    api_ids = {(1, 514): "cuGraphLaunch"}
    out = cm.raw_records(
        view, [i * SIZE for i in range(len(recs))], kinds, _structs(), api_ids, K_DRIVER, names.__getitem__
    )
    assert out == [
        ("k", 7, "_kda_decode_kernel", (2, 1, 1), (128, 1, 1), 13, 42, 3),
        ("k", 8, "argmax", (1, 1, 1), (32, 1, 1), 7, 0, 0),
        ("a", 9, "cuGraphLaunch", 77, 0),
        ("m", 11, 1, 1 << 20, 0xABC, 3),
        ("g", 12, 42),
    ]
    rep = cm.summarise(out, 0, 100)
    assert [(k["name"], k["graph"], k["nodes"]) for k in rep["kernels"]] == [
        ("_kda_decode_kernel", 42, [3]),
        ("argmax", 0, []),
    ]
    assert rep["api"] == [["cuGraphLaunch", 9, 77, 0]] and rep["graph_traces"] == {"42": 1}
    assert rep["memory"] == [["alloc", 1 << 20, 0xABC, 3, 11]]


def test_a_record_that_cannot_be_read_is_counted_as_unknown() -> None:
    kinds = {K_KERNEL: "kernel"}
    short = memoryview(struct.pack("<I", K_KERNEL) + bytes(12))  # a kernel record cut short
    out = cm.raw_records(short, [0], kinds, _structs(), {}, K_DRIVER, lambda p: "x")
    assert out == [("x", 0, f"kind {K_KERNEL}")]
    assert cm.summarise(out, 0, 0)["unknown_records"] == 1


def test_a_layout_with_overlapping_or_unknown_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        cm.layout_struct({"a": ("u", 8, 0), "b": ("u", 4, 4)}, ("a", "b"))
    with pytest.raises(KeyError):
        cm.layout_struct({"a": ("f", 8, 0)}, ("a",))  # a float field is no field this monitor reads


def test_without_libcupti_mapped_the_raw_path_says_why() -> None:
    with pytest.raises(RuntimeError, match="libcupti"):
        cm.RawBuffers._loaded_library()
