"""What the store hands back: plain dataclasses for log entries, receipts, approvals, keys and reports,
each with a JSON form for `--json` output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


def _iso(value: datetime | None) -> str | None:
    return None if value is None else rfc3339(value)


def rfc3339(value: datetime) -> str:
    """A UTC time as RFC 3339 with `Z` (the one spelling of times in output)."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Entry:
    """One log entry: its index, kind, exact bytes and leaf hash."""

    idx: int
    kind: str
    envelope: bytes
    leaf_hash: bytes
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "log_index": self.idx,
            "kind": self.kind,
            "leaf_hash": self.leaf_hash.hex(),
            "created_at": _iso(self.created_at),
            "entry": json.loads(self.envelope),
        }


@dataclass(frozen=True)
class Subject:
    name: str
    digest: str  # "<algorithm>:<hex>"


@dataclass(frozen=True)
class ReceiptRecord:
    """A receipt as stored: id (sha256 hex of the envelope bytes), log index and its query fields."""

    id: str
    log_idx: int
    verdict: str
    target: str
    host: str
    started_at: datetime
    finished_at: datetime
    keyid: str
    subjects: tuple[Subject, ...]
    predicate: dict[str, Any]
    envelope: bytes | None = None  # filled by get_receipt, not by list_receipts

    def to_json(self, *, predicate: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "log_index": self.log_idx,
            "verdict": self.verdict,
            "target": self.target,
            "host": self.host,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "keyid": self.keyid,
            "subjects": [{"name": s.name, "digest": s.digest} for s in self.subjects],
        }
        if predicate:
            out["predicate"] = self.predicate
        return out


@dataclass(frozen=True)
class ApprovalRecord:
    id: str
    log_idx: int
    subject: str
    decision: str
    policy_digest: str
    receipt_ids: list[str]
    reasons: list[str]
    keyid: str
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "log_index": self.log_idx,
            "subject": self.subject,
            "decision": self.decision,
            "policy_digest": self.policy_digest,
            "receipt_ids": self.receipt_ids,
            "reasons": self.reasons,
            "keyid": self.keyid,
            "created_at": _iso(self.created_at),
        }


@dataclass(frozen=True)
class KeyInfo:
    """A signer key's place in the log: trusted at one index, maybe revoked at a later one."""

    keyid: str
    algorithm: str
    public_pem: str
    note: str
    trusted_at: int
    revoked_at: int | None = None
    reason: str = ""

    @property
    def status(self) -> str:
        return "revoked" if self.revoked_at is not None else "trusted"

    def to_json(self) -> dict[str, Any]:
        return {
            "keyid": self.keyid,
            "algorithm": self.algorithm,
            "status": self.status,
            "trusted_at": self.trusted_at,
            "revoked_at": self.revoked_at,
            "note": self.note,
            "reason": self.reason,
            "public_pem": self.public_pem,
        }


@dataclass(frozen=True)
class Appended:
    """The result of an append: the entry's index and the signed checkpoint that now covers it."""

    idx: int
    kind: str
    checkpoint: str


@dataclass
class ReceiptReport:
    """The outcome of verifying one receipt: each check by name, and the first problem if any."""

    id: str
    log_idx: int | None
    checks: dict[str, bool] = field(default_factory=dict)
    problem: str | None = None
    keyid: str | None = None
    checkpoint_size: int | None = None
    # Set when the store holds rows beyond the checkpoint the receipt was checked under (they are ignored).
    notice: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ok": self.ok,
            "log_index": self.log_idx,
            "keyid": self.keyid,
            "checkpoint_size": self.checkpoint_size,
            "checks": self.checks,
            "problem": self.problem,
            "notice": self.notice,
        }
