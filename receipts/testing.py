"""Test and benchmark helpers only: receipts with a SYNTHETIC predicate (no engine ran). Real receipts
come from `qualify run`; nothing here may be used to make a receipt about a real build."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

from receipts import dsse
from receipts.canonical import canonical_json
from receipts.dsse import PAYLOAD_TYPE_INTOTO
from receipts.keys import SigningKey
from receipts.statement import (
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    config_digest,
)

SYNTHETIC_ENGINE = "synthetic-engine"


def synthetic_predicate(
    n: int = 0,
    *,
    verdict: str = "qualified",
    hostname: str = "synthetic-host",
    target: str = "cpu",
    started_at: datetime | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A schema-valid qualification predicate describing no real run; `n` makes each one distinct.
    `overrides` replaces top-level fields (e.g. checks with conditions, layout, backend, faults)."""
    started = started_at or datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=n)
    config = {"preset": "tiny", "synthetic": True, "n": n}
    status = "pass" if verdict == "qualified" else "fail"
    predicate = {
        "request": {"layout": [2304, 2304, 2304, 9216], "kda_backend": "auto", "spec": "none"},
        "engine": {
            "name": SYNTHETIC_ENGINE,
            "code_digest": "sha256:" + hashlib.sha256(b"synthetic code").hexdigest(),
            "config_digest": config_digest(config),
            "config": config,
        },
        "checks": [{"name": "boot", "status": status, "evidence": {"synthetic": True}, "seconds": 0.0}],
        "faults": {"xid_watch": "not_applicable", "xid_watch_reason": "synthetic receipt"},
        "verdict": verdict,
        "target": target,
        "host": {"hostname": hostname, "os": "synthetic", "kernel": "synthetic"},
        "started_at": started.isoformat(),
        "finished_at": (started + timedelta(seconds=30)).isoformat(),
        "qualify_version": "synthetic",
    }
    return {**predicate, **(overrides or {})}


def synthetic_statement(n: int = 0, *, subject_digest: str | None = None, **kwargs: Any) -> dict[str, Any]:
    predicate = synthetic_predicate(n, **kwargs)
    digest = subject_digest or hashlib.sha256(f"synthetic image {n}".encode()).hexdigest()
    return {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": "engine-image", "digest": {"sha256": digest}},
            {"name": "engine-config", "digest": {"sha256": predicate["engine"]["config_digest"][7:]}},
        ],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def synthetic_envelope(key: SigningKey, n: int = 0, **kwargs: Any) -> dict[str, Any]:
    """A DSSE envelope signed by `key` around `synthetic_statement(n, ...)`."""
    return dsse.sign(PAYLOAD_TYPE_INTOTO, canonical_json(synthetic_statement(n, **kwargs)), key)


def append_synthetic(
    store: Any, key: SigningKey, n: int, *, start: int = 0, batch: int = 1, **kwargs: Any
) -> list[str]:
    """Append `n` synthetic receipts signed by `key` (`batch` per transaction); returns their ids."""
    ids: list[str] = []
    for first in range(start, start + n, batch):
        envelopes = [
            synthetic_envelope(key, i, **kwargs) for i in range(first, min(first + batch, start + n))
        ]
        if batch == 1:
            ids.append(store.append_receipt(envelopes[0]).id)
        else:
            ids.extend(r.id for r in store.append_receipts(envelopes))
    return ids
