"""GPU timing the benchmarks share: each contender captured in a CUDA graph and timed by GPU events in
interleaved rounds, eager timings beside (labelled), the copy ceiling, a profiler's per-kernel split."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench._common import interleaved_medians

TIMING = (
    "each contender's call prepared once (host metadata built before timing), captured in a CUDA graph of "
    "its own and timed by CUDA events in {rounds} interleaved rounds, the order rotating; us: one replay "
    "alone; us_streamed: {streamed} replays back to back / {streamed}; eager_us: {streamed} eager calls "
    "back to back / {streamed} (the same events, host launch gaps included); medians over all rounds"
)


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn warmed up on a side stream, then captured in a CUDA graph of its own."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def events_us(fn: Callable[[], object], n: int = 1) -> float:
    """GPU time of n calls of fn back to back, by events, per call in µs."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def time_contenders(
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int = 20,
    singles: int = 10,
    streamed: int = 10,
    eager: bool = True,
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Capture every call, then time all of them in interleaved rounds: µs per call (see TIMING).
    Returns (timings, unavailable) where unavailable names the calls that failed to run or capture."""
    graphs, failed = {}, {}

    def replay_checked(label: str, when: str) -> None:
        try:
            for _ in range(3):
                graphs[label].replay()
            torch.cuda.synchronize()
        except Exception as e:  # a fault poisons the context: say which contender's graph it was, and when
            raise RuntimeError(f"contender {label!r} faulted on graph replay {when}: {e}") from e

    for label, fn in calls.items():
        try:
            graphs[label] = capture(fn)
        except torch.AcceleratorError as e:  # a device fault is sticky: nothing after it can run
            raise RuntimeError(f"contender {label!r} faulted while running or capturing: {e}") from e
        except Exception as e:  # a peer that cannot run or capture is reported, not dropped
            failed[label] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            continue
        replay_checked(label, "right after its capture")
    for label in graphs:
        replay_checked(label, "after every contender was captured and warmed")

    def measure(label: str) -> dict[str, list[float]]:
        g = graphs[label]
        out = {
            "us": [events_us(g.replay) for _ in range(singles)],
            "us_streamed": [events_us(g.replay, streamed)],
        }
        if eager:
            out["eager_us"] = [events_us(calls[label], streamed)]
        return out

    medians = interleaved_medians({k: lambda k=k: measure(k) for k in graphs}, rounds)
    return {k: {m: round(x, 2) for m, x in ms.items()} for k, ms in medians.items()}, failed


def warm_up_clocks(seconds: float = 0.5) -> None:
    """Keep the GPU busy for a moment so the first contender does not pay for the clocks ramping up."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def copy_bandwidth(sizes_mib: tuple[int, ...] = (256, 1024)) -> dict[str, object]:
    """Device copy bandwidth (bytes read + written) in TB/s, each size timed both eagerly and captured in
    a graph (interleaved); `max` is the larger of all, the ceiling the kernels are held against."""
    result: dict[str, object] = {}
    for mib in sizes_mib:
        nbytes = mib << 20
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)
        t, _ = time_contenders({"copy": lambda src=src, dst=dst: dst.copy_(src)}, rounds=5)
        c = t["copy"]
        result[f"{mib}MiB"] = {
            "graph_TBps": round(2 * nbytes / (c["us_streamed"] * 1e-6) / 1e12, 3),
            "eager_TBps": round(2 * nbytes / (c["eager_us"] * 1e-6) / 1e12, 3),
        }
        del src, dst
    result["max"] = max(v for r in result.values() if isinstance(r, dict) for v in r.values())
    return result


def profile_kernels(fn: Callable[[], object], *, calls: int = 5) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every CUDA kernel of `calls` calls of fn back to back (profiler),
    after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [
        (ev.name, ev.time_range.start, ev.time_range.elapsed_us())
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]


def breakdown(
    events: list[tuple[str, float, float]], calls: int, top: int | None = 12
) -> list[dict[str, object]]:
    """GPU time per kernel name for one call (the mean over `calls`), largest first."""
    totals: dict[str, list[float]] = {}
    for name, _, us in events:
        t = totals.setdefault(name, [0.0, 0])
        t[0] += us
        t[1] += 1
    rows = [
        {"kernel": name[:120], "us_per_call": round(us / calls, 2), "launches_per_call": n / calls}
        for name, (us, n) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_call"])[:top]


def launch_sequence(events: list[tuple[str, float, float]], calls: int) -> list[dict[str, object]]:
    """One call's kernels in launch order, each with its mean duration over `calls` identical calls back to
    back (a captured graph's replays): where one kernel name launches several times in a call (a
    projection kind per layer), the launches apart."""
    ordered = sorted(events, key=lambda e: e[1])
    if not ordered or len(ordered) % calls:
        raise ValueError(f"{len(ordered)} kernels do not split into {calls} equal calls")
    per = len(ordered) // calls
    out: list[dict[str, object]] = []
    for i in range(per):
        same = [ordered[c * per + i] for c in range(calls)]
        names = sorted({name for name, _, _ in same})
        if len(names) != 1:
            raise ValueError(f"launch {i} differs between calls: {names}")
        out.append({"i": i, "kernel": names[0][:120], "us": round(sum(us for _, _, us in same) / calls, 2)})
    return out


def kernel_breakdown(
    fn: Callable[[], object], *, calls: int = 5, top: int | None = 12
) -> list[dict[str, object]]:
    """GPU time per kernel name for one call of fn (profiler, mean over `calls` calls), largest first."""
    return breakdown(profile_kernels(fn, calls=calls), calls, top)


def launch_totals(rows: list[dict[str, object]]) -> dict[str, float]:
    """Kernel launches and summed kernel time per call over every row of an untruncated breakdown."""
    return {
        "launches_per_call": round(sum(r["launches_per_call"] for r in rows), 1),
        "kernel_us_per_call": round(sum(r["us_per_call"] for r in rows), 2),
    }
