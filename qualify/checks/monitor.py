"""monitor: what the harness's CUDA activity monitor recorded inside the engine process (`monitored`
evidence, qualify/watch/cupti.py): at every captured plan the decode/verify steps of a graph-mode request
replay that plan's FULL CUDA graph with no step kernel run eagerly and the KDA kernels only inside it; those
KDA kernels are the resolved backend's and no other backend's; after each in-place reload the same graphs
replay, none is instantiated and no parameter-sized memory is allocated. The engine's own counters stay in
the capture, backend and reload checks as `engine` evidence. A CPU target has nothing to monitor: skip."""

from __future__ import annotations

from typing import Any

from qualify.checks.base import PROMPTS, Check, Cond, Context, Outcome, fail_unless
from qualify.protocol import ReloadRequest
from qualify.watch import cupti
from qualify.watch.cupti import MONITORED, ReloadWindows, StepWindows

DECODE_TOKENS = 6  # per request of a decode window: 5 decode (or at least 1 verify) steps after the prefill
OTHER_SEED_OFFSET = 7919


def monitored(holds: bool, detail: str | None = None) -> Cond:
    """Recorded inside the engine process by the harness's monitor: not the engine's code, but its address
    space (docs/MONITOR.md)."""
    return Cond(bool(holds), MONITORED, detail)


def plans_of(d: Any) -> list[tuple[int, int]]:
    """(requests, tokens per request) the engine was asked to capture, largest first: every capture size at
    1 + num_spec tokens per request and, with speculation, the same request counts for plain decode."""
    tpr = 1 + d.capacity.num_spec
    sizes = sorted({int(s) for s in d.config.get("capture_sizes") or []}, reverse=True)
    plans = [(s // tpr, tpr) for s in sizes if s % tpr == 0]
    if tpr > 1:
        plans += [(n, 1) for n, _ in plans]
    return plans


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(n)]


def _step(ctx: Context, mon: Any, plan: tuple[int, int], phase: str) -> StepWindows:
    n, t = plan
    prompts = _prompts(n)
    with mon.window(f"{phase} baseline {n}x{t}") as wb:
        ctx.generate(prompts, mode="graph", speculative=t > 1, max_tokens=1)
    with mon.window(f"{phase} decode {n}x{t}") as wd:
        ctx.generate(prompts, mode="graph", speculative=t > 1, max_tokens=DECODE_TOKENS)
    steps = 1 if t > 1 else DECODE_TOKENS - 1
    return StepWindows(plan, cupti.parse_window(wb.report), cupti.parse_window(wd.report), steps)


def _after(ctx: Context, mon: Any, plans: list[tuple[int, int]], phase: str) -> dict[tuple[int, int], Any]:
    out = {}
    for n, t in plans:
        with mon.window(f"{phase} decode {n}x{t}") as w:
            ctx.generate(_prompts(n), mode="graph", speculative=t > 1, max_tokens=DECODE_TOKENS)
        out[(n, t)] = cupti.parse_window(w.report)
    return out


def _reload(ctx: Context, mon: Any, name: str, req: ReloadRequest, plans: list[tuple[int, int]]) -> Any:
    with mon.window(f"reload {name}") as w:
        resp = ctx.client.reload(req, timeout_s=ctx.remaining())
    return resp, ReloadWindows(
        name,
        cupti.parse_window(w.report),
        _after(ctx, mon, plans, f"after {name}"),
        from_file=req.seed is None,
    )


def run(ctx: Context) -> Outcome:
    mon = getattr(ctx.launcher, "monitor", None)
    if ctx.target == "cpu":
        return Outcome(
            "skip",
            {"monitor": mon.status() if mon else None},
            "not applicable: a CPU target has no CUDA activity to monitor",
        )
    if mon is None:
        cond = {"monitor_started": monitored(False, f"the {ctx.launcher.kind} launcher starts no monitor")}
        return fail_unless(cond, {})
    d = ctx.client.describe()
    backend = d.backend.resolved
    plans = plans_of(d)
    if not ctx.captured or not plans:
        cond = {"monitor_graphs_to_watch": monitored(False, f"no captured graphs to watch (plans {plans})")}
        return fail_unless(cond, {"monitor": mon.status()})
    before = [_step(ctx, mon, p, "before") for p in plans]
    seed = int(d.config.get("seed", 0)) + OTHER_SEED_OFFSET
    same, r_same = _reload(ctx, mon, "same", ReloadRequest(), plans)
    _, r_other = _reload(ctx, mon, "other", ReloadRequest(seed=seed), plans)
    _, r_back = _reload(ctx, mon, "back", ReloadRequest(path=same.weights_path), plans)
    reloads = [r_same, r_other, r_back]
    weights_bytes = (ctx.facts.get("weights_file") or {}).get("bytes")
    hello_ok, hello_detail = cupti.hello_condition(mon.hello, mon.lost)
    conds: dict[str, Cond] = {"monitor_started_in_the_engine": monitored(hello_ok, hello_detail)}
    for name, (holds, detail) in {
        **cupti.capture_conditions(before, backend),
        **cupti.backend_conditions(before, backend),
        **cupti.reload_conditions(before, reloads, weights_bytes),
    }.items():
        conds[name] = monitored(holds, detail)
    evidence = {
        "monitor": mon.status(),
        "backend": backend,
        "plans": [list(p) for p in plans],
        "steps": cupti.step_findings(before, backend),
        "reloads": {
            r.name: {
                "graph_ids_after": {f"{p[0]}x{p[1]}": sorted(w.graph_ids) for p, w in r.after.items()},
                "instantiations": r.reload.calls("GraphInstantiate"),
                "allocated_bytes": sum(r.reload.allocations),
                "allocations": len(r.reload.allocations),
                "from_file": r.from_file,
            }
            for r in reloads
        },
        "weights_bytes": weights_bytes,
        "signatures": {k: [p.pattern for p in v] for k, v in cupti.KDA_SIGNATURES.items()},
    }
    return fail_unless(conds, evidence)


CHECK = Check("monitor", run, timeout_s=300.0)
