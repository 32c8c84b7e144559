"""What one monitor window costs on a GPU, and where: the harness's CUDA activity monitor
(qualify/monitor/cupti_monitor.py) driven in this process, without an engine, around replays of a CUDA
graph of tiny kernels (or the same kernels launched eagerly).

For each configuration a window is opened, the work runs, and the window is closed; the close's flush, the
buffer callback's own seconds, the buffers CUPTI delivered and the kernel records the report holds are
kept, the median over --repeats windows. Configurations vary one thing at a time against the monitor as it
ships: the path that reads CUPTI's buffers (raw through libcupti, or cupti-python's objects), the flush
flag (forced / plain), the activity buffer size, a device sync before the close, CUPTI's periodic flush,
and whether the kinds are disabled between windows. A configuration whose report misses kernel records is
marked (`complete: false`): a faster flush that loses records is no option.

    python bench/monitor_flush.py --out bench/results/monitor-flush-h200-DATE.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402
from qualify.monitor import cupti_monitor as cm  # noqa: E402  (stdlib + cupti only)

KERNELS = 100  # per graph replay / eager round


def _measure(
    mon,
    run,
    expect: int,
    repeats: int,
    *,
    flag: int,
    sync: bool,
    keep_armed: bool,
    disable_first: bool,
    torch,
) -> dict:
    flush_s, callback_s, buffers, found, opened = [], [], [], [], []
    w = 1000
    for i in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if keep_armed:  # the window opens without re-arming (the kinds stayed enabled since the last one)
            mon.flush()
            with mon.lock:
                mon.records, mon.window, mon.t_open = [], w + i, mon.now()
                mon.delivered = [0, 0, 0.0]
                mon.costs = {}
        else:
            mon.open(w + i)
        opened.append(time.perf_counter() - t0)
        run()
        if sync:
            torch.cuda.synchronize()
        t_close = mon.now()
        if disable_first:
            mon.disarm()
        t1 = time.perf_counter()
        try:
            mon.cupti.activity_flush_all(flag)
        except Exception as exc:  # noqa: BLE001
            return {"error": f"flush: {exc}"[:200]}
        flush_s.append(time.perf_counter() - t1)
        if not keep_armed and not disable_first:
            mon.disarm()
        with mon.lock:
            recs, mon.records = mon.records, []
            b, _, cb = mon.delivered
            mon.window = None
        rep = cm.summarise(recs, mon.t_open, t_close)
        callback_s.append(cb)
        buffers.append(b)
        found.append(sum(k["count"] for k in rep["kernels"]))
    return {
        "open_s": round(statistics.median(opened), 6),
        "flush_close_s": round(statistics.median(flush_s), 6),
        "flush_close_max_s": round(max(flush_s), 6),
        "callback_s": round(statistics.median(callback_s), 6),
        "buffers_delivered": statistics.median(buffers),
        "kernel_records": min(found),
        "expected": expect,
        "complete": min(found) >= expect,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    a, b = socket.socketpair()
    mon = cm.Monitor(a)
    mon.start_cupti()  # before CUDA initialises, as the launcher does
    import torch  # noqa: PLC0415

    if mon.cupti is None or not torch.cuda.is_available():
        write_result({"skipped": mon.error or "no CUDA device"}, args.out)
        return
    x = torch.zeros(256, device="cuda")
    torch.cuda.synchronize()

    def eager(rounds: int):
        def go():
            for _ in range(rounds * KERNELS):
                x.add_(1.0)

        return go

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        eager(1)()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager(1)()
    torch.cuda.synchronize()

    def replays(k: int):
        def go():
            for _ in range(k):
                g.replay()

        return go

    base = {"flag": 1, "sync": True, "keep_armed": False, "disable_first": False}
    rows = []

    raw = mon.raw
    names: dict[str, set] = {}

    def row(
        label: str,
        work: str,
        k: int,
        buffer_bytes: int = cm.BUFFER_BYTES,
        period_ms: int | None = None,
        path: str = "raw",
        **over,
    ):
        cfg = {**base, **over}
        saved = cm.BUFFER_BYTES
        cm.BUFFER_BYTES = buffer_bytes
        mon.raw = raw if path == "raw" else None
        if period_ms is not None:
            mon.cupti.activity_flush_period(period_ms)
        try:
            run = replays(k) if work == "graph" else eager(k)
            mon.open(1)  # warm this configuration's buffers once
            run()
            torch.cuda.synchronize()
            rep = mon.close(1)
            names[f"{mon.buffers} {work} {k}"] = sorted({(x["name"], x["graph"] > 0) for x in rep["kernels"]})
            if cfg["keep_armed"]:
                mon.arm()
            r = _measure(mon, run, k * KERNELS, args.repeats, torch=torch, **cfg)
            if cfg["keep_armed"]:
                mon.disarm()
        finally:
            mon.raw = raw
            cm.BUFFER_BYTES = saved
            if period_ms is not None:
                mon.cupti.activity_flush_period(0)
        rows.append(
            {
                "config": label,
                "path": mon.buffers,
                "work": work,
                "rounds": k,
                "buffer_bytes": buffer_bytes,
                "period_ms": period_ms,
                **cfg,
                **r,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)

    for path in ("raw", "cupti-python"):
        for k in (0, 1, 6, 60):
            row("as shipped", "graph", k, path=path)
        row("as shipped", "eager", 6, path=path)
    row("plain flush (flag 0)", "graph", 6, flag=0)
    row("no sync before close", "graph", 6, sync=False)
    for size in (1 << 20, 128 << 10):
        row(f"buffer {size >> 10} KiB", "graph", 6, buffer_bytes=size)
    row("periodic flush 10 ms", "graph", 6, period_ms=10)
    row("kinds disabled before the flush", "graph", 6, disable_first=True)
    row("kinds kept enabled", "graph", 6, keep_armed=True)
    row("kinds kept enabled, plain flush", "graph", 6, keep_armed=True, flag=0)
    write_result(
        {
            "what": "seconds of one monitor window's close (CUPTI flush and the buffer callback), median of "
            f"{args.repeats} windows per configuration, {KERNELS} kernels per graph replay or eager round",
            "cupti_api_mode": mon.api_mode,
            "raw_buffers": {"library": getattr(raw, "path", None), "error": mon.raw_error},
            # The kernel names (and whether inside a graph) each path's first window of a row reported:
            # the raw path reads the same records as cupti-python's objects.
            "same_kernels_both_paths": all(
                names.get(f"raw {w} {k}") == names.get(f"cupti-python {w} {k}")
                for w, k in (("graph", 1), ("graph", 6), ("graph", 60), ("eager", 6))
            ),
            "kernel_names": names,
            "rows": rows,
        },
        args.out,
    )
    b.close()


if __name__ == "__main__":
    main()
