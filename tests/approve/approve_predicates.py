"""Realistic qualification predicates for the approval tests, validated by the receipts schema."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from receipts.statement import QualificationPredicate, config_digest

CONFIG = {"preset": "tiny", "block_size": 2304, "dcp_size": 4}
IMAGE = "sha256:" + "ab" * 32


def predicate(
    *,
    host: str = "node-a",
    verdict: str = "qualified",
    finished: datetime | None = None,
    spans: list[int] | None = None,
    backend: str = "triton",
    restarts: int = 0,
    xids: list[tuple[int, bool]] | None = None,
    failed_check: str | None = None,
    cuda_oom: int = 0,
) -> dict[str, Any]:
    """A predicate as `qualify run` would write it; the keyword arguments change what policies look at."""
    finished = finished or datetime.now(UTC) - timedelta(minutes=5)
    spans = spans if spans is not None else [2304, 2304, 2304, 9216]
    checks = [
        {"name": name, "status": "pass", "evidence": {}, "seconds": seconds}
        for name, seconds in (("boot", 2.5), ("backend", 0.4), ("layout", 1.1), ("faults", 0.2))
    ]
    if failed_check:
        for check in checks:
            if check["name"] == failed_check:
                check.update(status="fail", reason=f"{failed_check} failed")
    data = {
        "request": {"layout": [2304, 2304, 2304, 9216], "kda_backend": "auto"},
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
            "xid_watch": "active",
            "oom": {"container": False, "cuda_oom_count": cuda_oom},
            "engine_dead": False,
        },
        "verdict": verdict,
        "target": "gpu",
        "host": {"hostname": host, "os": "linux", "kernel": "6.8"},
        "started_at": (finished - timedelta(seconds=30)).isoformat(),
        "finished_at": finished.isoformat(),
        "qualify_version": "0.1.0",
    }
    # Validate through the real schema so the tests judge what a real receipt would hold.
    return QualificationPredicate.model_validate(copy.deepcopy(data)).model_dump(mode="json")
