"""Realistic qualification predicates for the approval tests, validated by the receipts schema."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from receipts.statement import QualificationPredicate, config_digest

CONFIG = {"preset": "tiny", "block_size": 2304, "dcp_size": 4}
IMAGE = "sha256:" + "ab" * 32
# What a GPU `qualify run --spec mtp:3` records as observed: what examples/fleet.toml requires observed.
OBSERVED = {
    "boot": ["launched_process_serves_the_port", "weights_file_hashed"],
    "backend": ["bogus_backend_refused"],
    "layout": [
        "spans_equal_request",
        "peer_ok",
        "peer_verified_every_group",
        "intervention_others_unchanged",
    ],
    "capture": ["replay_equals_eager"],
    "reload": ["other_weights_replay_equals_eager", "replay_after_reload_equals_fresh_eager"],
    "generation": ["replay_vs_eager", "before_vs_after_reload", "speculative_vs_plain"],
    "faults": ["no_restarts", "no_fatal_xid", "xid_watched", "engine_answers"],
}
# What the harness's CUDA activity monitor records in the same run: what examples/fleet.toml requires
# monitored.
MONITORED = {
    "monitor": [
        "monitor_reported_from_the_engine",
        "capture_monitor_reported_every_window",
        "capture_every_size_replayed_its_graph",
        "capture_no_step_kernel_ran_eagerly",
        "capture_kda_kernels_only_in_graphs",
        "backend_resolved_kernels_in_every_step",
        "backend_no_kernels_of_other_backends",
        "reload_monitor_reported_every_window",
        "reload_same_graphs_replayed",
        "reload_no_graph_instantiated",
        "reload_no_parameter_sized_allocation",
    ]
}
SECONDS = {"boot": 2.5, "backend": 0.4, "layout": 1.1, "capture": 3.1, "reload": 4.2, "generation": 1.3}


def predicate(
    *,
    host: str = "node-a",
    verdict: str | None = None,
    finished: datetime | None = None,
    spans: list[int] | None = None,
    backend: str = "triton",
    restarts: int = 0,
    xids: list[tuple[int, bool]] | None = None,
    failed_check: str | None = None,
    cuda_oom: int = 0,
    target: str = "gpu",
    sources: dict[str, str] | None = None,
    sandbox: bool | None = True,
) -> dict[str, Any]:
    """A predicate as `qualify run` would write it; the keyword arguments change what policies look at.
    `sources` overrides the source of named "check.condition"s (every listed one is observed otherwise).
    The verdict defaults to what `qualify run` would judge from the faults: a restart, a fatal Xid or a CUDA
    OOM rejects the run (a qualified receipt with such a faults block does not validate)."""
    if verdict is None:
        fatal = any(f for _, f in (xids or []))
        verdict = "rejected" if restarts or fatal or cuda_oom or failed_check else "qualified"
    finished = finished or datetime.now(UTC) - timedelta(minutes=5)
    spans = spans if spans is not None else [2304, 2304, 2304, 9216]
    sources = sources or {}
    checks = [
        {
            "name": name,
            "status": "pass",
            "conditions": {
                c: {"holds": True, "source": sources.get(f"{name}.{c}", "observed"), "detail": None}
                for c in conditions
            },
            "evidence": {},
            "seconds": SECONDS.get(name, 0.2),
        }
        for name, conditions in OBSERVED.items()
    ]
    checks.insert(
        5,
        {
            "name": "monitor",
            "status": "pass",
            "conditions": {
                c: {"holds": True, "source": sources.get(f"monitor.{c}", "monitored"), "detail": None}
                for c in MONITORED["monitor"]
            },
            "evidence": {},
            "seconds": 2.1,  # not integral: canonical JSON would store 2.0 as an int
        },
    )
    if target == "cpu":  # as a CPU run records it: capture skipped, no Xid watch to demand
        for check in checks:
            if check["name"] == "capture":
                check.update(status="skip", conditions={}, reason="CUDA graphs need a CUDA device")
            if check["name"] == "monitor":
                check.update(status="skip", conditions={}, reason="not applicable: a CPU target")
            check["conditions"].pop("xid_watched", None)
    if failed_check:
        for check in checks:
            if check["name"] == failed_check:
                check.update(status="fail", reason=f"{failed_check} failed")
    data = {
        "request": {"layout": [2304, 2304, 2304, 9216], "kda_backend": "auto", "sandbox": sandbox},
        "engine": {
            "name": "glm-tiny",
            "image_digest": IMAGE,
            "config_digest": config_digest(CONFIG),
            "config": CONFIG,
        },
        "backend": {
            "requested": "auto",
            "resolved": backend,
            "reason": "cuda without spec",
            "kernel_names": [],
        },
        "layout": {"spans": spans, "chunk": 9216, "ratios": [4, 4, 4, 1], "peer_verified": True},
        "checks": checks,
        "faults": {
            "restart_count": restarts,
            "xid_events": [{"code": c, "fatal": f, "source": "kmsg"} for c, f in (xids or [])],
            "xid_watch": "active" if target == "gpu" else "not_applicable",
            "oom": {"container": False, "cuda_oom_count": cuda_oom},
            "engine_dead": False,
        },
        "verdict": verdict,
        "target": target,
        "host": {"hostname": host, "os": "linux", "kernel": "6.8"},
        "started_at": (finished - timedelta(seconds=30)).isoformat(),
        "finished_at": finished.isoformat(),
        "qualify_version": "0.1.0",
    }
    # Validate through the real schema so the tests judge what a real receipt would hold.
    return QualificationPredicate.model_validate(copy.deepcopy(data)).model_dump(mode="json")
