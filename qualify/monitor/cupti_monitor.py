"""The harness's CUDA activity monitor, run INSIDE the engine's interpreter (stdlib + cupti-python only).

The launchers start the engine as `python <this file> <engine module> <args...>` (qualify/launch/monitor.py):
this file starts CUPTI activity recording before the engine's code is imported (so before CUDA initialises),
then runs the engine module as `__main__`, like `python -m`. The harness never imports this file; the
engine never needs to know it is there.

Channel: a Unix stream socket the harness owns. Locally it is one end of a socketpair the engine inherits
(its number in QUALIFY_MONITOR_FD); in a container it is a socket the harness listens on in a directory
mounted into it (QUALIFY_MONITOR_SOCKET). Both variables are removed from the environment before the engine
runs. Messages are JSON lines (docs/MONITOR.md):

    monitor -> harness  {"t": "hello", "v": 1, "pid": ..., "cupti": ..., "error": ..., "kinds": [...]}
    harness -> monitor  {"t": "open", "w": N}       start window N (records before it are dropped)
    harness -> monitor  {"t": "close", "w": N}      flush CUPTI, send window N
    monitor -> harness  {"t": "window", "w": N, "kernels": [...], "api": [...], "memory": [...], ...}

A window's kernels are aggregated by (name, grid, block, stream, graph id) with a count and the graph
node ids seen, so a report's size is bounded by the number of distinct launches, never by the run's length;
beyond the bounds below a report says `truncated`. Where CUPTI cannot be used (no package, no GPU) the
hello says why and every window comes back empty with that error: the harness decides what that means.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import socket
import struct
import sys
import threading
import time

PROTOCOL_VERSION = 1
FD_ENV = "QUALIFY_MONITOR_FD"
SOCKET_ENV = "QUALIFY_MONITOR_SOCKET"
MAX_KERNEL_KEYS = 4096  # distinct (name, grid, block, stream, graph) per window
MAX_NODE_IDS = 256  # graph node ids kept per kernel key
MAX_API = 2048  # graph API calls per window
MAX_MEMORY = 4096  # allocation / free records per window
MAX_NAME = 400  # characters of a kernel name
MAX_COMMAND = 4096  # bytes of one command line from the harness
MAX_RECORDS = 2_000_000  # raw records held for one open window (beyond: counted, the report truncated)
BUFFER_BYTES = 8 << 20
# Driver/runtime API calls whose records a window keeps (by name): graph creation, instantiation, launch.
API_WORDS = ("GraphInstantiate", "GraphLaunch", "StreamBeginCapture", "StreamEndCapture", "GraphExecUpdate")
KINDS = ("CONCURRENT_KERNEL", "MEMORY2")  # while a window is open
API_KINDS = ("DRIVER", "RUNTIME")  # while a window is open, narrowed to the graph calls where CUPTI allows
MAX_CBID = 1400


class Monitor:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.records: list[tuple] = []
        self.dropped = 0  # records that arrived while no window was open
        self.overflow = 0  # records of an open window beyond MAX_RECORDS
        self.window: int | None = None
        self.t_open = 0
        self.cupti = None
        self.error: str | None = None
        self.enabled: list[str] = []
        self.api_ids: dict[tuple[int, int], str] = {}  # (domain, cbid) -> name, only the graph calls
        self.cbids: dict[int, list[int]] = {}  # domain -> the callback ids this CUPTI knows
        self.costs: dict[str, float] = {}  # seconds of the open window's arm and flush
        self.delivered = [0, 0, 0.0]  # since the window opened: buffers, records, seconds in the callback
        self.driver_kind = -1
        self.arm_errors: list[str] = []
        self.api_mode = "none"  # selected: only the graph calls are recorded; all: every API call
        self.raw: RawBuffers | None = None  # CUPTI's buffers read through libcupti directly (see RawBuffers)
        self.buffers = "none"  # raw | cupti-python: which path hands the records to _keep
        self.raw_error: str | None = None  # why the raw path is not used, where it is not

    # ------------------------------------------------------------ CUPTI
    def start_cupti(self) -> None:
        try:
            from cupti import cupti  # noqa: PLC0415  (the engine's interpreter, never the harness)
        except Exception as exc:  # not installed, or its libcupti cannot load
            self.error = f"cupti-python not importable: {type(exc).__name__}: {exc}"[:300]
            return
        self.cupti = cupti
        self.driver_kind = int(cupti.ActivityKind.DRIVER)
        for domain in (1, 2):  # CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_CB_DOMAIN_RUNTIME_API
            for cbid in range(1, MAX_CBID):
                try:
                    name = str(cupti.get_callback_name(domain, cbid))
                except Exception:
                    continue
                self.cbids.setdefault(domain, []).append(cbid)  # the ids this CUPTI knows
                if any(w in name for w in API_WORDS):
                    self.api_ids[(domain, cbid)] = name
        try:
            self.raw = RawBuffers(cupti, self)
        except Exception as exc:  # no libcupti mapped, a layout unknown: cupti-python's objects instead
            self.raw_error = f"{type(exc).__name__}: {exc}"[:300]
        self.arm_errors = self.arm()  # once at start: the hello says whether recording works...
        self.disarm()  # ...and nothing is recorded (nor costs the engine anything) outside windows

    def arm(self) -> list[str]:
        """At every window's open: (re-)register the buffer callbacks and enable the kinds (another CUPTI
        client in the process, the torch profiler behind the engine's /probe, may have replaced or disabled
        them since). Returns the errors."""
        cupti = self.cupti
        if cupti is None:
            return [self.error or "no CUPTI"]
        errors = []
        self.buffers = "none"
        if self.raw is not None:
            err = self.raw.register()
            if err is None:
                self.buffers = "raw"
            else:
                errors.append(f"register raw buffer callbacks: {err}"[:200])
        if self.buffers == "none":
            try:
                cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
                self.buffers = "cupti-python"
            except Exception as exc:
                errors.append(f"register callbacks: {exc}"[:200])
        enabled = []
        for k in KINDS:
            try:
                cupti.activity_enable(getattr(cupti.ActivityKind, k))
                enabled.append(k)
            except Exception as exc:
                errors.append(f"enable {k}: {exc}"[:200])
        # With GRAPH_TRACE on, a replay is one record without its kernels: keep it off (per-kernel records
        # inside graphs carry their graph id and node id).
        with contextlib.suppress(Exception):
            cupti.activity_disable(cupti.ActivityKind.GRAPH_TRACE)
        # The API kinds on, then narrowed to the graph calls (cuptiActivityEnableDriverApi/RuntimeApi act only
        # on an enabled kind: on the H200, selecting calls with the kinds off recorded nothing); where the
        # narrowing is refused every call is recorded and the callback keeps the graph calls.
        self.api_mode = "all"
        for k in API_KINDS:
            try:
                cupti.activity_enable(getattr(cupti.ActivityKind, k))
            except Exception as exc:
                errors.append(f"enable {k}: {exc}"[:200])
                self.api_mode = "none"
        if self.api_mode == "all":
            try:
                for domain, fn in (
                    (1, cupti.activity_enable_driver_api),
                    (2, cupti.activity_enable_runtime_api),
                ):
                    # Only the ids this CUPTI names (an unknown one would raise; a call the narrowing
                    # missed is still dropped by the buffer callback, which keeps api_ids alone).
                    for cbid in self.cbids.get(domain) or range(1, MAX_CBID):
                        with contextlib.suppress(Exception):  # ids this CUPTI does not know
                            fn(cbid, 1 if (domain, cbid) in self.api_ids else 0)
                self.api_mode = "selected"
            except Exception as exc:
                errors.append(f"narrow API records: {exc}"[:200])
        if self.api_mode != "none":
            enabled.append(f"API:{self.api_mode}")
        self.enabled = enabled
        if "CONCURRENT_KERNEL" not in enabled:
            self.error = "; ".join(errors) or "kernel records could not be enabled"
        else:
            self.error = None
        return errors

    def disarm(self) -> None:
        """After a window: nothing more is recorded until the next one opens."""
        cupti = self.cupti
        if cupti is None:
            return
        for k in (*KINDS, *API_KINDS):
            with contextlib.suppress(Exception):
                cupti.activity_disable(getattr(cupti.ActivityKind, k))

    def _buffer_requested(self):
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities) -> None:
        t0 = time.perf_counter()
        out = []
        for r in activities:
            name = type(r).__name__
            try:
                if name.startswith("ActivityKernel"):
                    out.append(
                        (
                            "k",
                            r.start,
                            str(r.name)[:MAX_NAME],
                            (r.grid_x, r.grid_y, r.grid_z),
                            (r.block_x, r.block_y, r.block_z),
                            r.stream_id,
                            r.graph_id,
                            r.graph_node_id,
                        )
                    )
                elif name == "ActivityAPI":
                    key = (1 if r.kind == self.driver_kind else 2, r.cbid)
                    api = self.api_ids.get(key)
                    if api is not None:
                        out.append(("a", r.start, api, r.correlation_id, r.return_value))
                elif name.startswith("ActivityGraphTrace"):
                    out.append(("g", r.start, int(r.graph_id)))
                elif name.startswith("ActivityMemory") and not name.startswith("ActivityMemoryPool"):
                    out.append(
                        (
                            "m",
                            r.timestamp,
                            int(r.memory_operation_type),
                            int(r.bytes),
                            int(r.address),
                            int(r.memory_kind),
                        )
                    )
            except Exception:  # a record of a layout this version does not know: counted, not fatal
                out.append(("x", 0, name))
        self._keep(out, t0)

    def _keep(self, out: list[tuple], t0: float) -> None:
        """One delivered buffer's records (in summarise's tuples), from either path, kept for the open
        window; `t0` is when the buffer's callback began."""
        with self.lock:
            if self.window is None:
                self.dropped += len(out)
            elif len(self.records) + len(out) > MAX_RECORDS:
                self.overflow += len(out)
            else:
                self.records.extend(out)
            d = self.delivered
            d[0] += 1
            d[1] += len(out)
            d[2] += time.perf_counter() - t0

    def flush(self) -> str | None:
        if self.cupti is None:
            return None
        try:
            self.cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
            return None
        except Exception as exc:
            return f"flush: {exc}"[:200]

    def now(self) -> int:
        try:
            return int(self.cupti.get_timestamp()) if self.cupti is not None else 0
        except Exception:
            return 0

    # ------------------------------------------------------------ windows
    def open(self, w: int) -> None:
        t0 = time.perf_counter()
        errors = self.arm() if self.cupti is not None else []
        t1 = time.perf_counter()
        self.flush()
        with self.lock:
            self.records = []
            self.overflow = 0
            self.window = w
            self.t_open = self.now()
            self.arm_errors = errors
            self.costs = {"arm": t1 - t0, "flush_open": time.perf_counter() - t1}
            self.delivered = [0, 0, 0.0]

    def close(self, w: int) -> dict:
        t_close = self.now()
        t0 = time.perf_counter()
        flush_error = self.flush()
        t1 = time.perf_counter()
        self.disarm()
        t2 = time.perf_counter()
        with self.lock:
            recs, self.records = self.records, []
            overflow, self.overflow = self.overflow, 0
            same = self.window == w
            self.window = None
            t_open = self.t_open
            buffers, delivered, callback_s = self.delivered
        report = summarise(recs, t_open, t_close)
        # The monitor's own seconds in this window's open and close (what a window costs the run).
        # flush_close includes the buffer callback's own seconds (`callback`, summed over the buffers CUPTI
        # delivered while the window was open, on its own thread or inside the flush).
        costs = {**self.costs, "flush_close": t1 - t0, "disarm": t2 - t1, "callback": callback_s}
        costs["summarise"] = time.perf_counter() - t2
        if overflow:
            report["truncated"] = True
        report.update(
            records_over_limit=overflow,
            buffers_delivered=buffers,
            records_delivered=delivered,
            t="window",
            w=w,
            opened=same,
            t_open=t_open,
            t_close=t_close,
            enabled=list(self.enabled),
            buffers=self.buffers,
            dropped_outside=self.dropped,
            error=self.error or flush_error,
            arm_errors=self.arm_errors,
            costs_s={k: round(v, 6) for k, v in costs.items()},
        )
        return report

    # ------------------------------------------------------------ channel
    def send(self, msg: dict) -> bool:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self.send_lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def serve(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return  # the harness closed its end: nothing more to report
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self.command(line)
            if len(buf) > MAX_COMMAND:
                buf = b""  # a line this long is no command of the harness's

    def command(self, line: bytes) -> None:
        try:
            cmd = json.loads(line)
            w = int(cmd["w"])
        except (ValueError, KeyError, TypeError):
            self.send({"t": "error", "error": "unreadable command"})
            return
        if cmd.get("t") == "open":
            self.open(w)
            self.send({"t": "opened", "w": w})
        elif cmd.get("t") == "close":
            self.send(self.close(w))


# The record layouts the raw path reads, as cupti-python's numpy dtypes name them for the libcupti it binds
# (dtype name, the fields in the order they are kept). The tuples it builds are summarise's, as the
# cupti-python path builds them from its objects.
RAW_LAYOUTS = {
    "kernel": (
        "activity_kernel10_dtype",
        (
            "start",
            "name",
            "grid_x",
            "grid_y",
            "grid_z",
            "block_x",
            "block_y",
            "block_z",
            "stream_id",
            "graph_id",
            "graph_node_id",
        ),
    ),
    "api": ("activity_api_dtype", ("start", "cbid", "correlation_id", "return_value")),
    "memory": (
        "activity_memory4_dtype",
        ("timestamp", "memory_operation_type", "bytes", "address", "memory_kind"),
    ),
    "graph": ("activity_graph_trace2_dtype", ("start", "graph_id")),
}
RAW_KINDS = {  # record kind -> layout
    "KERNEL": "kernel",
    "CONCURRENT_KERNEL": "kernel",
    "DRIVER": "api",
    "RUNTIME": "api",
    "MEMORY2": "memory",
    "GRAPH_TRACE": "graph",
}
_STRUCT_CODES = {
    ("u", 1): "B",
    ("i", 1): "b",
    ("u", 2): "H",
    ("i", 2): "h",
    ("u", 4): "I",
    ("i", 4): "i",
    ("u", 8): "Q",
    ("i", 8): "q",
    ("V", 8): "Q",
}


def layout_struct(fields: dict, names: tuple[str, ...]) -> struct.Struct:
    """A little-endian struct reading `names` (in that order) at their offsets; `fields` maps a name to
    (kind letter, size, offset), as numpy's dtype.fields gives them."""
    order = sorted(names, key=lambda n: fields[n][2])
    fmt, at = "<", 0
    for n in order:
        kind, size, off = fields[n]
        if off < at:
            raise ValueError(f"field {n} overlaps the one before it")
        fmt += "x" * (off - at) + _STRUCT_CODES[(kind, size)]
        at = off + size
    st = struct.Struct(fmt)
    perm = tuple(order.index(n) for n in names)
    return st if perm == tuple(range(len(names))) else _Reordered(st, perm)


class _Reordered:
    """A struct whose fields lie in another order than they are asked for."""

    def __init__(self, st: struct.Struct, perm: tuple[int, ...]) -> None:
        self.st, self.perm, self.size = st, perm, st.size

    def unpack_from(self, buf, off: int = 0) -> tuple:
        v = self.st.unpack_from(buf, off)
        return tuple(v[i] for i in self.perm)


def raw_records(view, offsets, kinds: dict, structs: dict, api_ids: dict, driver_kind: int, name_of) -> list:
    """summarise's tuples from the records at `offsets` of one buffer (`view`, any bytes-like): the record
    kind is the first u32 of a record; kinds this monitor did not ask for are skipped, as on the other path;
    `name_of(pointer)` reads a kernel's name (a C string CUPTI owns)."""
    out = []
    kind_at = struct.Struct("<I").unpack_from
    for off in offsets:
        kind = "?"
        try:
            (kind,) = kind_at(view, off)
            what = kinds.get(kind)
            if what is None:
                continue
            v = structs[what].unpack_from(view, off)
            if what == "kernel":
                out.append(("k", v[0], name_of(v[1])[:MAX_NAME], v[2:5], v[5:8], v[8], v[9], v[10]))
            elif what == "api":
                api = api_ids.get((1 if kind == driver_kind else 2, v[1]))
                if api is not None:
                    out.append(("a", v[0], api, v[2], v[3]))
            elif what == "memory":
                out.append(("m", v[0], v[1], v[2], v[3], v[4]))
            else:
                out.append(("g", v[0], v[1]))
        except Exception:  # a record this monitor cannot read: counted, not fatal
            out.append(("x", 0, f"kind {kind}"))
    return out


class RawBuffers:
    """CUPTI's activity buffers handed to and read from libcupti through ctypes, without cupti-python's
    per-record objects (numpy-backed: on the H200 85-135 us a kernel record between them and the reads of
    their fields, most of a window's close). The library is the one cupti-python loaded (found in this
    process's maps, never a second copy); the record layouts are cupti-python's own dtypes for it; records
    are walked with cuptiActivityGetNextRecord. Raises where any of that is missing."""

    REQ = ctypes.CFUNCTYPE(
        None,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    )
    DONE = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
    )

    def __init__(self, cupti, mon: Monitor) -> None:
        self.mon = mon
        path = self._loaded_library()
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.cuptiActivityRegisterCallbacks.argtypes = [self.REQ, self.DONE]
        lib.cuptiActivityRegisterCallbacks.restype = ctypes.c_int
        lib.cuptiActivityGetNextRecord.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        lib.cuptiActivityGetNextRecord.restype = ctypes.c_int
        self.structs = {}
        for what, (dtype_name, names) in RAW_LAYOUTS.items():
            dt = getattr(cupti, dtype_name)
            fields = {n: (dt.fields[n][0].kind, dt.fields[n][0].itemsize, dt.fields[n][1]) for n in names}
            self.structs[what] = layout_struct(fields, names)
        self.kinds = {int(getattr(cupti.ActivityKind, k)): w for k, w in RAW_KINDS.items()}
        self.live: dict[int, ctypes.Array] = {}  # buffers CUPTI holds, kept alive here
        self.pool: list[ctypes.Array] = []  # buffers handed back, reused
        self.lock = threading.Lock()
        self._req, self._done = (
            self.REQ(self._requested),
            self.DONE(self._completed),
        )  # referenced: never freed

    @staticmethod
    def _loaded_library() -> str:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "/libcupti.so" in path:
                    return path
        raise RuntimeError("libcupti is not mapped in this process")

    def register(self) -> str | None:
        rc = self.lib.cuptiActivityRegisterCallbacks(self._req, self._done)
        return None if rc == 0 else f"cuptiActivityRegisterCallbacks returned {rc}"

    def _requested(self, buffer, size, max_records) -> None:
        with self.lock:
            buf = self.pool.pop() if self.pool else None
        if buf is None or len(buf) != BUFFER_BYTES + 8:
            buf = (ctypes.c_uint8 * (BUFFER_BYTES + 8))()
        base = ctypes.addressof(buf)
        aligned = (base + 7) & ~7  # CUPTI's ACTIVITY_RECORD_ALIGNMENT
        with self.lock:
            self.live[aligned] = buf
        buffer[0] = aligned
        size[0] = BUFFER_BYTES
        max_records[0] = 0

    def _completed(self, ctx, stream, buffer, size, valid) -> None:
        t0 = time.perf_counter()
        with self.lock:
            buf = self.live.pop(buffer, None)
        if buf is None:
            return
        try:
            base = ctypes.addressof(buf)  # offsets into buf (the buffer CUPTI got is aligned within it)
            offsets = []
            rec = ctypes.c_void_p(None)
            nxt = self.lib.cuptiActivityGetNextRecord
            while len(offsets) < MAX_RECORDS and nxt(buffer, valid, ctypes.byref(rec)) == 0:
                offsets.append(rec.value - base)
            mon = self.mon
            out = raw_records(
                memoryview(buf), offsets, self.kinds, self.structs, mon.api_ids, mon.driver_kind, _c_string
            )
        except Exception as exc:  # never raise into CUPTI's thread
            out = [("x", 0, f"raw buffer: {exc}"[:200])]
        finally:
            with self.lock:
                if len(self.pool) < 4:
                    self.pool.append(buf)
        self.mon._keep(out, t0)


def _c_string(ptr: int) -> str:
    return ctypes.string_at(ptr).decode("utf-8", "replace") if ptr else ""


def summarise(recs: list[tuple], t_open: int, t_close: int) -> dict:
    """Records within [t_open, t_close] (CUPTI timestamps; all when the clock is unknown), bounded."""
    keys: dict[tuple, list] = {}
    api: list[list] = []
    memory: list[list] = []
    graph_traces: dict[str, int] = {}  # graph id -> replays seen as one record (GRAPH_TRACE was on)
    unknown = 0
    truncated = False
    inside = (lambda t: t_open <= t <= t_close) if t_close else (lambda t: True)
    for r in recs:
        kind = r[0]
        if kind == "x":
            unknown += 1
            continue
        if not inside(r[1]):
            continue
        if kind == "k":
            key = r[2:7]
            entry = keys.get(key)
            if entry is None:
                if len(keys) >= MAX_KERNEL_KEYS:
                    truncated = True
                    continue
                entry = keys[key] = [0, set()]
            entry[0] += 1
            if r[7] and len(entry[1]) < MAX_NODE_IDS:
                entry[1].add(r[7])
        elif kind == "g":
            graph_traces[str(r[2])] = graph_traces.get(str(r[2]), 0) + 1
        elif kind == "a":
            if len(api) < MAX_API:
                api.append([r[2], r[1], r[3], r[4]])
            else:
                truncated = True
        elif kind == "m":
            if len(memory) < MAX_MEMORY:
                memory.append(
                    ["alloc" if r[2] == 1 else "free" if r[2] == 2 else str(r[2]), r[3], r[4], r[5], r[1]]
                )
            else:
                truncated = True
    kernels = [
        {
            "name": k[0],
            "grid": list(k[1]),
            "block": list(k[2]),
            "stream": k[3],
            "graph": k[4],
            "count": v[0],
            "nodes": sorted(v[1]),
        }
        for k, v in keys.items()
    ]
    return {
        "kernels": kernels,
        "api": api,
        "memory": memory,
        "unknown_records": unknown,
        "truncated": truncated,
        "graph_traces": graph_traces,
    }


def _channel() -> socket.socket | None:
    fd = os.environ.pop(FD_ENV, None)
    path = os.environ.pop(SOCKET_ENV, None)
    try:
        if fd is not None:
            s = socket.socket(fileno=int(fd))
            s.set_inheritable(False)  # the engine's children do not get the harness's channel
            return s
        if path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            return s
    except (OSError, ValueError):
        return None
    return None


def start() -> Monitor | None:
    """Start recording and serve the harness's channel on a daemon thread; None without a channel."""
    sock = _channel()
    if sock is None:
        return None
    mon = Monitor(sock)
    mon.start_cupti()
    version = None
    if mon.cupti is not None:
        try:
            from importlib.metadata import version as dist_version  # noqa: PLC0415

            version = dist_version("cupti-python")
        except Exception:
            version = "unknown"
    mon.send(
        {
            "t": "hello",
            "v": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "cupti": version,
            "error": mon.error,
            "kinds": mon.enabled,
            "api_mode": mon.api_mode,
            "buffers": mon.buffers,
            "raw_error": mon.raw_error,
            "arm_errors": mon.arm_errors,
            "api_calls": sorted(set(mon.api_ids.values()))[:64],
            "torch_imported_before": "torch" in sys.modules,
        }
    )
    threading.Thread(target=mon.serve, name="qualify-monitor", daemon=True).start()
    return mon


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: cupti_monitor.py ENGINE_MODULE [ARGS...]")
    module, args = argv[0], argv[1:]
    # `python -m` semantics for the engine: sys.path[0] is the working directory (not this file's folder),
    # except under -P / -I, where nothing is prepended.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        if getattr(sys.flags, "safe_path", False):
            sys.path.pop(0)
        else:
            sys.path[0] = os.getcwd()
    globals()["MONITOR"] = start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
