"""Predicate parts as `qualify run` writes them on a GPU target (layout, backend, checks with conditions and
their sources, faults), for the `receipts show` tests; passed to receipts.testing as overrides."""

from __future__ import annotations

from typing import Any

REQUESTED = [2304, 2304, 2304, 9216]
SHORT = [2304, 2304, 9216]


def cond(holds: bool, source: str, detail: str | None = None) -> dict[str, Any]:
    return {"holds": holds, "source": source, "detail": detail}


def check(name: str, conditions: dict[str, Any], evidence: dict[str, Any] | None = None, **kw: Any):
    status = kw.pop("status", "pass" if all(c["holds"] for c in conditions.values()) else "fail")
    return {
        "name": name,
        "status": status,
        "conditions": conditions,
        "evidence": evidence or {},
        "seconds": 1.5,
        **kw,
    }


def gpu_run(
    *, registered: list[int] = REQUESTED, oom: bool = False, verdict: str | None = None
) -> dict[str, Any]:
    """Overrides for a GPU run that registered `registered`; `oom`: the container was killed for memory."""
    groups = [
        {"index": i, "kind": "attention" if span == 9216 else "kda", "layers": [i], "span": span}
        for i, span in enumerate(registered)
    ]
    differs = registered != REQUESTED
    checks = [
        check(
            "boot",
            {"ready_within_timeout": cond(True, "observed", "ready after 3.1 s")},
        ),
        check(
            "backend",
            {
                "kernels_of_resolved_backend_ran": cond(True, "engine", "labels of triton: ['kda_decode']"),
                "bogus_backend_refused": cond(True, "observed", "probe exit code 2"),
            },
        ),
        check(
            "layout",
            {
                "chunk_is_lcm": cond(True, "derived", "chunk 9216, lcm 9216"),
                "spans_equal_request": cond(
                    not differs,
                    "engine",
                    f"registered {registered} != requested {REQUESTED}" if differs else None,
                ),
            },
            {"groups": [{**g, "handle_kind": "cuda-ipc"} for g in groups]},
        ),
        check(
            "capture",
            {"replay_equals_eager": cond(True, "observed", "identical")},
            {"capture": {"captured": True, "sizes": [8, 4, 2, 1]}},
        ),
        check(
            "monitor",
            {
                "capture_every_size_replayed_its_graph": cond(
                    True, "monitored", "8x1: graphs [5], 5 launches"
                ),
                "reload_same_graphs_replayed": cond(True, "monitored", "the graphs captured before"),
            },
        ),
        check(
            "generation",
            {"before_vs_after_reload": cond(True, "observed", "near tie at prompt 1 token 7")},
            {
                "comparisons": {
                    "replay_vs_eager": {"agrees": True, "identical": True, "summary": "identical"},
                    "before_vs_after_reload": {
                        "agrees": True,
                        "identical": False,
                        "summary": "near tie at prompt 1 token 7",
                    },
                    "speculative_vs_plain": {"not_applicable": "--spec none"},
                }
            },
        ),
        check(
            "faults",
            {
                "no_restarts": cond(True, "observed", "restart count 0"),
                "no_container_oom": cond(not oom, "observed"),
            },
        ),
    ]
    if oom:  # the container was killed while booting: boot failed with the exit code docker saw
        checks[0] = check(
            "boot",
            {},
            status="fail",
            reason="the engine container exited with code 137 before it was ready (0 restarts): Killed",
        )
    failed = differs or oom
    return {
        "layout": {
            "spans": registered,
            "chunk": 9216,
            "ratios": [9216 // s for s in registered],
            "groups": groups,
            "peer_verified": True,
        },
        "backend": {
            "requested": "auto",
            "resolved": "triton",
            "reason": "auto: cuda without speculative decoding",
            "kernel_names": ["kda_decode"],
        },
        "checks": checks,
        "faults": {
            "restart_count": 0,
            "xid_events": [],
            "xid_watch": "active",
            "oom": {"container": oom, "cuda_oom_count": 0},
            "engine_dead": False,
        },
        "target": "gpu",
        "verdict": verdict or ("rejected" if failed else "qualified"),
    }
