"""faults: no restarts (the launcher's count, and workers re-forked under the launched process as /proc
shows them), no fatal Xid, no OOM (container or CUDA), the process answering `/health` is the one that
answered it at boot, and the engine is not dead: a real generation answers at the end."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, engine_says, fail_unless, observed
from qualify.client import EngineError, EngineUnreachable
from qualify.protocol import CompletionRequest, dcp_ranks_lost
from qualify.watch.procs import resolve_ns_pid

FINAL_GENERATION_TIMEOUT_S = 30.0  # a live engine answers 4 tokens well within this
LOG_LINES = 5000  # of the engine's log read for lost DCP ranks


def run(ctx: Context) -> Outcome:
    status = ctx.launcher.status()
    watch = ctx.xid_watch()
    events = ctx.xid_events()
    fatal = [e for e in events if e.fatal]
    cuda_oom: int | None = None
    metrics_oom: float | None = None
    answer: dict = {}
    serving: dict = {}
    try:
        resp = ctx.client.complete(
            CompletionRequest(prompt="Still alive?", max_tokens=4), timeout_s=FINAL_GENERATION_TIMEOUT_S
        )
        answer = {"answered": True, "tokens": [c.token_ids for c in resp.choices]}
        serving = _serving_now(ctx, ctx.client.health().pid)
        cuda_oom = ctx.client.describe().counters.cuda_oom
        metrics = ctx.client.metrics()
        metrics_oom = sum(v for k, v in metrics.items() if "oom" in k.lower())
    except (EngineUnreachable, EngineError) as exc:
        answer = {"answered": False, "error": str(exc)[:300]}
    ctx.facts["cuda_oom"] = cuda_oom or 0
    ctx.facts["engine_dead"] = not answer.get("answered", False)
    hidden = ctx.procs.restarts() if ctx.procs is not None else []
    restarts = status.restart_count + len(hidden)
    evidence = {
        "launcher": status.to_evidence(),
        "process_tree": ctx.procs.evidence() if ctx.procs is not None else "not a host process tree",
        "xid_watch": watch,
        "xid_events": [e.to_evidence() for e in events],
        "fatal_xid": [e.code for e in fatal],
        "cuda_oom": cuda_oom,
        "metrics_oom_total": metrics_oom,
        "final_generation": answer,
    }
    conditions = {
        # The supervisor (local) or docker inspect (container) counts restarts, and /proc shows workers
        # re-forked under the launched process: the harness's own view.
        "no_restarts": observed(
            restarts == 0,
            f"launcher restarts {status.restart_count}, workers replaced under the launched process "
            f"{len(hidden)}" + (f": {hidden[:3]}" if hidden else ""),
        ),
        "no_fatal_xid": observed(not fatal, f"fatal Xid {[e.code for e in fatal]}" if fatal else None),
        # CUDA OOM is counted inside the engine: only its word.
        "no_cuda_oom": engine_says((cuda_oom or 0) == 0 and not metrics_oom, f"cuda_oom {cuda_oom}"),
        "engine_alive": observed(status.alive),
        "engine_answers": observed(bool(answer.get("answered")), answer.get("error")),
    }
    boot = ctx.facts.get("serving_process")
    if boot is not None and answer.get("answered"):
        evidence["serving_process"] = {"boot": boot, "end": serving}
        same = bool(serving) and (serving.get("pid"), serving.get("start_ticks")) == (
            boot["pid"],
            boot["start_ticks"],
        )
        # /health's pid is the engine's number (mapped through /proc): `engine`.
        conditions["same_serving_process_as_at_boot"] = engine_says(same, f"boot {boot}, end {serving}")
    if ctx.launcher.kind == "docker":  # only docker can kill for memory; locally it could never fail
        conditions["no_container_oom"] = observed(not status.oom_killed)
    if ctx.request.dcp is not None:
        # Rank 0 names a lost follower rank in its log before it exits (qualify/engine/dcp.py).
        lost = dcp_ranks_lost(ctx.launcher.logs_tail(LOG_LINES))
        evidence["dcp_ranks_lost"] = lost
        conditions["no_dcp_rank_lost"] = engine_says(not lost, "; ".join(lost) or None)
    if ctx.target == "gpu":
        # "No fatal Xid" only means something where Xids were watched: a GPU target needs a live source.
        conditions["xid_watched"] = observed(watch.get("state") == "active", watch.get("reason"))
    return fail_unless(conditions, evidence)


def _serving_now(ctx: Context, health_pid: int) -> dict:
    """The host process that `/health`'s pid names now, in the launched tree ({} when none, or several)."""
    if ctx.procs is None:
        return {}
    hits = resolve_ns_pid(health_pid, ctx.procs.sample().values())
    if len(hits) != 1:
        return {"health_pid": health_pid, "matches": [p.pid for p in hits]}
    return {"pid": hits[0].pid, "start_ticks": hits[0].start, "health_pid": health_pid}


CHECK = Check("faults", run, timeout_s=60.0, needs_engine=False)
