"""dcp (only with --dcp N): the engine runs N ranks, each registering the layout, each a live process among
the launched engine's descendants in /proc, each observed doing work (its CPU time, and on a GPU its own
device in NVML's process list) while the engine generates; its greedy output equals a DCP 1 reference
engine's (same build, same weights) before and after an in-place reload, under the coherence rule."""

from __future__ import annotations

import contextlib
import os
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
from qualify.run import launch as launch_doc

REFERENCE_BOOT_S = 300.0


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process on this host, read from /proc by the harness; None if gone."""
    fields = proc_stat(pid)
    try:
        return (fields[0], int(fields[1])) if fields else None
    except (IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """The live descendants of `root` on this host, from the kernel's process table (/proc), nearest first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_state(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out


def ns_pid(pid: int) -> int | None:
    """The pid process `pid` has in its own (innermost) pid namespace: what its getpid() says."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pid


def rank_hosts(ranks: dict[int, dict[str, Any]], engine_pid: int) -> dict[int, int | None]:
    """Per rank, the host pid of the process that reported that pid: the launched engine or one of its
    descendants whose own pid (NSpid, so a sandboxed engine's pids map too) is the one the rank reported;
    None when no such process exists."""
    family = [engine_pid, *descendants(engine_pid)]
    by_ns: dict[int, int] = {}
    for pid in family:
        inner = ns_pid(pid)
        if inner is not None:
            by_ns.setdefault(inner, pid)
    return {rank: by_ns.get(r["pid"]) for rank, r in ranks.items()}


def rank_processes(ranks: dict[int, dict[str, Any]], engine_pid: int | None) -> dict[int, str]:
    """Per rank, what the harness sees: every rank a distinct live process of the launched engine's family
    in /proc, rank 0 the launched process or one of its descendants, every other rank a descendant. 'ok' or
    what is wrong."""
    out: dict[int, str] = {}
    hosts = rank_hosts(ranks, engine_pid) if engine_pid is not None else {}
    seen: dict[int, int] = {}
    for rank, r in sorted(ranks.items()):
        host = hosts.get(rank)
        st = proc_state(host) if host is not None else None
        if host is None:
            out[rank] = f"pid {r['pid']} is not the launched engine ({engine_pid}) or one of its descendants"
        elif st is None or st[0] == "Z":
            out[rank] = f"pid {r['pid']} is not running"
        elif rank > 0 and host == engine_pid:
            out[rank] = f"pid {r['pid']} is the launched process itself, not a rank of its own"
        elif host in seen:
            out[rank] = f"pid {r['pid']} is rank {seen[host]}'s process too"
        else:
            out[rank] = "ok"
        if host is not None:
            seen.setdefault(host, rank)
    return out


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process, in clock ticks, from /proc/PID/stat (fields 14 and 15)."""
    fields = proc_stat(pid)
    try:
        return int(fields[11]) + int(fields[12]) if fields else None
    except (IndexError, ValueError):
        return None


def _own_gpus(gpu: dict[int, dict[int, int | None]] | None, hosts: dict[int, int | None], want: int) -> Any:
    """Observed: every rank's process is in NVML's compute-process list on one GPU no other rank is on,
    holding device memory there (where the driver reports it)."""
    if gpu is None:
        return observed(False, "NVML is not running: no GPU process list to look at")
    on = {r: gpu.get(h, {}) if h is not None else {} for r, h in hosts.items()}
    bad = []
    for r in range(want):
        used = on.get(r) or {}
        if len(used) != 1:
            bad.append(f"rank {r} on GPUs {sorted(used)}")
        elif any(v is not None and v <= 0 for v in used.values()):
            bad.append(f"rank {r} holds no memory on GPU {next(iter(used))}")
    devices = [next(iter(v)) for v in on.values() if len(v) == 1]
    if len(set(devices)) != len(devices):
        bad.append(f"ranks share a GPU: {on}")
    return observed(not bad, "; ".join(bad) if bad else f"NVML compute processes per rank (GPU: bytes): {on}")


def reference_options(ctx: Context) -> EngineOptions:
    """The DCP 1 reference engine: the same full launch document as the engine under test, with one shard
    in one process (its attention groups laid out for dcp_size 1), the same weights file and its own
    scratch dir."""
    r = ctx.request
    doc, manifest = ctx.facts.get("launch_document"), ctx.facts.get("manifest")
    launch = None
    if doc is not None and manifest is not None:
        # A sandboxed sibling has a scratch dir of its own at the same path inside its sandbox.
        own = getattr(ctx.launcher, "sandbox", None) is not None
        launch = launch_doc.build(
            r, manifest, ctx.target, weights_path=doc.weights.path,
            scratch_dir=doc.scratch_dir if own else doc.scratch_dir + "-dcp1",
            weights_create=doc.weights.create, dcp=(1, 1),
        ).model_dump_json()  # fmt: skip
    return EngineOptions(
        preset=r.preset,
        kda_backend=r.kda_backend,
        num_spec=r.num_spec,
        extra_args=("--dcp-size", "1", "--dcp-ranks", "1"),
        launch=launch,
    )


def _reference_tokens(ctx: Context) -> tuple[Any, str | None, dict[str, Any]]:
    """Boot a DCP 1 engine of the same build, generate the check's prompts eagerly, stop it."""
    ref = ctx.launcher.sibling(reference_options(ctx), "dcp1-reference")
    client: EngineClient | None = None
    try:
        url = ref.start(min(REFERENCE_BOOT_S, ctx.remaining()))
        client = EngineClient(url, timeout_s=max(1.0, ctx.remaining()), netns=ref.netns)
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
    hosts = rank_hosts(per_rank, engine_pid) if local and engine_pid is not None else {}
    ticks0 = {r: cpu_ticks(h) if h is not None else None for r, h in hosts.items()}
    before = ctx.generate()
    ticks1 = {r: cpu_ticks(h) if h is not None else None for r, h in hosts.items()}
    gpu = ctx.gpu_memory() if ctx.target == "gpu" else None
    coh_before = coherence(ref, before, reask=ctx.reask())  # teacher forcing before the reload
    reloaded = ctx.client.reload(ReloadRequest(), timeout_s=ctx.remaining())
    after = ctx.generate()
    coh_after = coherence(ref, after, reask=ctx.reask())
    evidence = {
        "requested_ranks": want,
        "dcp_mode": d.dcp_mode,
        "ranks": per_rank,
        "rank_processes": procs or "not observable from the harness (pids are the container's)",
        "rank_host_pids": hosts or None,
        "rank_cpu_ticks_during_generation": {
            r: (None if ticks0[r] is None or ticks1[r] is None else ticks1[r] - ticks0[r]) for r in hosts
        }
        or None,
        "clock_ticks_per_second": os.sysconf("SC_CLK_TCK"),
        "gpu_processes": gpu,
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
        # Each rank's own CPU time, as the kernel counts it, grew while the engine generated: a rank that
        # only sleeps (an idle child standing in for a rank) does not.
        spent = evidence["rank_cpu_ticks_during_generation"] or {}
        idle = [r for r in range(want) if not isinstance(spent.get(r), int) or spent[r] < 1]
        conditions["every_rank_worked_during_generation"] = observed(
            len(spent) == want and not idle,
            f"ranks {idle} spent no CPU time while the engine generated (ticks {spent})"
            if idle
            else f"CPU ticks per rank during generation: {spent}",
        )
        if ctx.target == "gpu":
            conditions["every_rank_on_its_own_gpu"] = _own_gpus(gpu, hosts, want)
    return fail_unless(conditions, evidence)


CHECK = Check("dcp", run, timeout_s=420.0)
