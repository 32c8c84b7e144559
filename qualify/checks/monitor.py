"""monitor: what the harness's CUDA activity monitor recorded inside the engine process (`monitored`
evidence, qualify/watch/cupti.py): at every captured plan the decode/verify steps of a graph-mode request
replay that plan's FULL CUDA graph with no step kernel run eagerly and the KDA kernels only inside it; those
KDA kernels are the resolved backend's and no other backend's; after each in-place reload the same graphs
replay, none is instantiated and no parameter-sized memory is allocated. The engine's own counters stay in
the capture, backend and reload checks as `engine` evidence. A CPU target has nothing to monitor: skip."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from qualify.checks.base import PROMPTS, Check, Cond, Context, Outcome, fail_unless
from qualify.launch.monitor import MONITOR_FILE
from qualify.protocol import ReloadRequest
from qualify.watch import cupti
from qualify.watch.cupti import MONITORED

DECODE_TOKENS = 6  # per request of a decode window: 5 decode (or at least 1 verify) steps after the prefill
OTHER_SEED_OFFSET = 7919


def monitored(holds: bool, detail: str | None = None) -> Cond:
    """Recorded inside the engine process by the harness's monitor: not the engine's code, but its address
    space (docs/MONITOR.md)."""
    return Cond(bool(holds), MONITORED, detail)


def monitor_file_digest() -> str:
    """sha256 of the monitor file the launchers run inside the engine (the receipt names what watched)."""
    return hashlib.sha256(MONITOR_FILE.read_bytes()).hexdigest()


def plans_of(d: Any) -> list[tuple[int, int]]:
    """(requests, tokens per request) the engine was asked to capture, largest first: every capture size at
    1 + num_spec tokens per request and, with speculation, the same request counts for plain decode."""
    tpr = 1 + d.capacity.num_spec
    sizes = sorted({int(s) for s in d.config.get("capture_sizes") or []}, reverse=True)
    plans = [(s // tpr, tpr) for s in sizes if s % tpr == 0]
    if tpr > 1:
        plans += [(n, 1) for n, _ in plans]
    return plans


def _prompts(n: int, attempt: int = 1) -> list[str]:
    return [f"{PROMPTS[(i + attempt - 1) % len(PROMPTS)]} #{i}.{attempt}" for i in range(n)]


def _decode(
    ctx: Context, mon: Any, plan: tuple[int, int], label: str, max_tokens: int, attempt: int = 1
) -> set:
    """One graph-mode request of plan[0] prompts inside a window; the graph ids the monitor saw in it."""
    n, t = plan
    with mon.window(label) as w:
        ctx.generate(_prompts(n, attempt), mode="graph", speculative=t > 1, max_tokens=max_tokens)
    return cupti.parse_window(w.report).graph_ids


def _steps(
    ctx: Context, mon: Any, plan: tuple[int, int], phase: str, done: Callable[[set[int]], bool]
) -> set:
    """The decode windows of one plan and phase: again with other prompts (up to cupti.ATTEMPTS) until one
    replayed the plan's own graph (`done`), since a request that ends early shrinks the batch."""
    seen: set[int] = set()
    for attempt in range(1, cupti.ATTEMPTS + 1):
        ids = _decode(
            ctx, mon, plan, cupti.label_step(phase, "decode", plan, attempt), DECODE_TOKENS, attempt
        )
        seen |= ids
        if done(ids):
            break
    return seen


def run(ctx: Context) -> Outcome:
    mon = getattr(ctx.launcher, "monitor", None)
    if ctx.target == "cpu":
        return Outcome(
            "skip",
            {"monitor": mon.status() if mon else None},
            "not applicable: a CPU target has no CUDA activity to monitor",
        )
    if mon is None:
        why = f"the {ctx.launcher.kind} launcher starts no monitor"
        cond = {"monitor_reported_from_the_engine": monitored(False, why)}
        return fail_unless(cond, {})
    d = ctx.client.describe()
    backend = d.backend.resolved
    plans = plans_of(d)
    if not ctx.captured or not plans:
        cond = {
            "capture_every_size_replayed_its_graph": monitored(False, f"no captured graphs (plans {plans})")
        }
        return fail_unless(cond, {"monitor": mon.status()})
    # The steps at every captured plan, fewest requests first (a plan's own graph is what no smaller plan
    # replayed): prefill only, then with decode/verify steps.
    own: dict[tuple[int, int], set[int]] = {}
    smaller: dict[int, set[int]] = {}
    for p in sorted(plans, key=lambda p: (p[1], p[0])):
        _decode(ctx, mon, p, cupti.label_step("before", "baseline", p), 1)
        before = smaller.setdefault(p[1], set())
        ids = _steps(ctx, mon, p, "before", lambda ids, b=before: bool(ids - b))
        own[p] = ids - before
        before |= ids
    seed = int(d.config.get("seed", 0)) + OTHER_SEED_OFFSET
    same_path = None
    for name in cupti.RELOADS:
        req = ReloadRequest() if name == "same" else ReloadRequest(seed=seed) if name == "other" else None
        if req is None:
            req = ReloadRequest(path=same_path)
        with mon.window(f"reload {name}"):
            resp = ctx.client.reload(req, timeout_s=ctx.remaining())
        same_path = same_path or resp.weights_path
        for p in plans:
            _steps(ctx, mon, p, f"after {name}", lambda ids, mine=own.get(p, set()): bool(ids & mine))
    weights_bytes = (ctx.facts.get("weights_file") or {}).get("bytes")
    found, evidence = cupti.evaluate(mon.windows, plans, backend, weights_bytes, mon.hello, mon.lost)
    conds = {name: monitored(holds, detail) for name, (holds, detail) in found.items()}
    status = {**mon.status(), "file_sha256": monitor_file_digest()}
    status["window_costs_s"] = window_costs(mon.windows)
    return fail_unless(conds, {"monitor": status, **evidence})


def window_costs(windows: list[Any]) -> dict[str, float]:
    """The monitor's own seconds per phase of a window (arm, flushes, disarm, summarise), summed over the
    windows whose report gives them: what the windows cost the run."""
    out: dict[str, float] = {}
    for w in windows:
        costs = w.get("costs_s") if isinstance(w, dict) else None
        if isinstance(costs, dict):
            for k, v in costs.items():
                if isinstance(v, int | float) and isinstance(k, str) and len(out) < 16:
                    out[k] = round(out.get(k, 0.0) + float(v), 4)
    return out


CHECK = Check("monitor", run, timeout_s=300.0)
