"""The unsigned `created_at` columns checked during `log verify`: against each other (an append writes one
time to its entry and its checkpoint, in log order) and against the times the signed entries carry."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from receipts import dsse
from receipts.models import ApprovalRow, CheckpointRow, LogEntry, LogMeta

# A host clock slewed or stepped back by NTP may make consecutive appends go back this much, no more.
CLOCK_STEP = timedelta(seconds=5)

_E = LogEntry.__table__
_C = CheckpointRow.__table__
_TIMES = (
    sa.select(_E.c.idx, _E.c.kind, _E.c.created_at).where(_E.c.idx < sa.bindparam("size")).order_by(_E.c.idx)
)
_SEALS = sa.select(_C.c.size, _C.c.created_at).where(_C.c.size <= sa.bindparam("size")).order_by(_C.c.size)

Report = Callable[[int | None, str], None]


def _signed_time(kind: str, data: bytes) -> datetime | None:
    """The time a key entry or an approval was signed (key record `at`, approval `decided_at`)."""
    try:
        record = json.loads(data)
        if kind == "approval":
            record = json.loads(dsse.parse(data).payload)["predicate"]
            text = record["decided_at"]
        else:
            text = record["at"]
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except (ValueError, KeyError, TypeError):
        return None  # a malformed entry is reported by the signature checks


def check(conn: Connection, size: int, problem: Report) -> None:
    """Report every `created_at` that cannot be what the store wrote."""
    previous: datetime | None = None
    signed_kinds: dict[int, tuple[str, datetime]] = {}
    first: datetime | None = None
    # An append writes its entries and the checkpoint that seals them (the next one in size) with one
    # time: an entry whose time is not that checkpoint's had its time rewritten, or its own checkpoint
    # (a batch's) was deleted and a later one now comes first.
    seals = iter(conn.execute(_SEALS, {"size": size}).all())
    seal = next(seals, None)
    for idx, kind, at in conn.execute(_TIMES, {"size": size}):
        while seal is not None and seal[0] <= idx:
            seal = next(seals, None)
        if first is None:
            first = at
        if seal is not None and seal[1] != at:
            sealed_at = seal[1]
            problem(
                idx,
                f"the created_at of log entry {idx} ({at:%Y-%m-%dT%H:%M:%S.%fZ}) is not that of the "
                f"checkpoint of size {seal[0]}, the first after it ({sealed_at:%Y-%m-%dT%H:%M:%S.%fZ}): "
                f"the checkpoint of its append was deleted, or a time was rewritten",
            )
        if previous is not None and at < previous - CLOCK_STEP:
            problem(
                idx,
                f"the created_at of log entry {idx} goes back {previous - at} from the entry before it: "
                "append times were rewritten (or the host clock was stepped back)",
            )
        if kind in ("key-trust", "key-revoke", "approval"):
            signed_kinds[idx] = (kind, at)
        previous = at
    meta = conn.execute(sa.select(LogMeta.created_at)).scalar()
    if meta is not None and first is not None and meta > first:
        problem(0, "log_meta.created_at is later than the first entry's: it was rewritten")
    if signed_kinds:
        envelopes = conn.execute(
            sa.select(_E.c.idx, _E.c.envelope).where(_E.c.idx.in_(list(signed_kinds)))
        ).all()
        for idx, data in envelopes:
            kind, at = signed_kinds[idx]
            signed = _signed_time(kind, bytes(data))
            if signed is not None and at < signed - CLOCK_STEP:
                problem(
                    idx, f"the created_at of log entry {idx} is before the time its {kind} entry was signed"
                )
    approvals = ApprovalRow.__table__
    for idx, at in conn.execute(
        sa.select(approvals.c.log_idx, approvals.c.created_at).where(approvals.c.log_idx < size)
    ):
        entry_at = signed_kinds.get(idx, (None, None))[1]
        if entry_at is not None and not entry_at - CLOCK_STEP <= at <= entry_at:
            problem(
                idx, f"approvals.created_at of log entry {idx} is not the time it was appended: rewritten"
            )
