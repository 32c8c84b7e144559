"""dcp (only with --dcp N): the engine runs N ranks, each registering the layout, each a live process; its
greedy output equals a DCP 1 reference engine's (same build, same weights) before and after an in-place
reload, under the coherence rule."""

from __future__ import annotations

import contextlib
from typing import Any

from qualify.checks.base import (
    GEN_TOKENS,
    PROMPTS,
    Check,
    Context,
    Outcome,
    coherence,
    engine_says,
    fail_unless,
    observed,
)
from qualify.client import EngineClient
from qualify.launch.base import EngineOptions, proc_stat
from qualify.protocol import CompletionRequest, ReloadRequest

REFERENCE_BOOT_S = 300.0


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process on this host, read from /proc by the harness; None if gone."""
    fields = proc_stat(pid)
    try:
        return (fields[0], int(fields[1])) if fields else None
    except (IndexError, ValueError):
        return None


def rank_processes(ranks: dict[int, dict[str, Any]], engine_pid: int | None) -> dict[int, str]:
    """Per rank, what the harness sees: rank 0 must be the process it launched, every other rank a live
    child of rank 0. 'ok' or what is wrong."""
    out: dict[int, str] = {}
    for rank, r in sorted(ranks.items()):
        st = proc_state(r["pid"])
        if st is None or st[0] == "Z":
            out[rank] = f"pid {r['pid']} is not running"
        elif rank == 0 and r["pid"] != engine_pid:
            out[rank] = f"pid {r['pid']} is not the engine the harness launched ({engine_pid})"
        elif rank > 0 and st[1] != engine_pid:
            out[rank] = f"pid {r['pid']} is not a child of the launched engine (parent {st[1]})"
        else:
            out[rank] = "ok"
    return out


def reference_options(ctx: Context) -> EngineOptions:
    r = ctx.request
    return EngineOptions(
        preset=r.preset,
        kda_backend=r.kda_backend,
        num_spec=r.num_spec,
        extra_args=("--dcp-size", "1", "--dcp-ranks", "1"),
    )


def _reference_tokens(ctx: Context) -> tuple[Any, str | None, dict[str, Any]]:
    """Boot a DCP 1 engine of the same build, generate the check's prompts eagerly, stop it."""
    ref = ctx.launcher.sibling(reference_options(ctx), "dcp1-reference")
    client: EngineClient | None = None
    try:
        url = ref.start(min(REFERENCE_BOOT_S, ctx.remaining()))
        client = EngineClient(url, timeout_s=max(1.0, ctx.remaining()))
        resp = client.complete(CompletionRequest(prompt=PROMPTS, max_tokens=GEN_TOKENS, mode="eager"))
        weights = client.describe().engine.weights_digest
        return resp, weights, {"url": url, "launcher": ref.identity()}
    finally:
        if client is not None:
            client.close()
        with contextlib.suppress(Exception):
            ref.stop(5.0)


def run(ctx: Context) -> Outcome:
    want = ctx.request.dcp or 1
    d = ctx.client.describe()
    ranks = d.dcp_ranks
    spans = d.layout.spans
    per_rank = {
        r.rank: {
            "pid": r.pid,
            "device": r.device,
            "spans": [g.span for g in r.groups],
            "nbytes": [g.nbytes for g in r.groups],
        }
        for r in ranks
    }
    local = ctx.launcher.kind == "local"
    engine_pid = ctx.launcher.status().detail.get("pid") if local else None
    procs = rank_processes(per_rank, engine_pid) if local else {}
    ref, ref_weights, ref_info = _reference_tokens(ctx)
    before = ctx.generate()
    coh_before = coherence(ref, before, reask=ctx.reask())  # teacher forcing before the reload
    reloaded = ctx.client.reload(ReloadRequest(), timeout_s=ctx.remaining())
    after = ctx.generate()
    coh_after = coherence(ref, after, reask=ctx.reask())
    evidence = {
        "requested_ranks": want,
        "dcp_mode": d.dcp_mode,
        "ranks": per_rank,
        "rank_processes": procs or "not observable from the harness (pids are the container's)",
        "reference": {**ref_info, "weights_digest": ref_weights},
        "dcp_vs_dcp1": coh_before,
        "reload": {"census": reloaded.census.model_dump(mode="json"), "seconds": reloaded.seconds},
        "dcp_vs_dcp1_after_reload": coh_after,
    }
    conditions = {
        "ranks_as_requested": engine_says(
            d.dcp_mode == "distributed" and sorted(per_rank) == list(range(want)),
            f"mode {d.dcp_mode}, ranks {sorted(per_rank)}",
        ),
        "every_rank_registered_the_layout": engine_says(
            all(r["spans"] == spans for r in per_rank.values()) and bool(per_rank),
            f"layout {spans}; per rank {[r['spans'] for r in per_rank.values()]}",
        ),
        "same_weights_as_reference": engine_says(
            ref_weights == d.engine.weights_digest,
            f"reference {ref_weights}, engine {d.engine.weights_digest}",
        ),
        # Tokens compared by the harness: DCP N against a DCP 1 engine it booted itself.
        "dcp_vs_dcp1": observed(coh_before["agrees"], coh_before.get("summary")),
        "dcp_vs_dcp1_after_reload": observed(coh_after["agrees"], coh_after.get("summary")),
    }
    if local:
        bad = {r: why for r, why in procs.items() if why != "ok"}
        conditions["every_rank_is_a_live_process_of_the_engine"] = observed(
            len(procs) == want and not bad, "; ".join(f"rank {r}: {w}" for r, w in bad.items()) or None
        )
    return fail_unless(conditions, evidence)


CHECK = Check("dcp", run, timeout_s=420.0)
