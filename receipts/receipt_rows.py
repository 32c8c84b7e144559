"""Whether the `receipts` and `receipt_subjects` query rows say what the signed envelopes say: they are
derived data, which a plain INSERT (or a superuser's UPDATE) could change without touching the log."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from pydantic import AwareDatetime, TypeAdapter, ValidationError
from sqlalchemy.engine import Connection

from receipts import dsse
from receipts.models import ReceiptRow, ReceiptSubject

_RECEIPTS = ReceiptRow.__table__
_SUBJECTS = ReceiptSubject.__table__
_TIME: TypeAdapter[datetime] = TypeAdapter(AwareDatetime)
_FIELDS = ("verdict", "target", "host", "started_at", "finished_at", "predicate", "subjects")


def _time(value: Any) -> datetime:
    # The C parser first (this runs for every receipt of a verification); pydantic for what it accepts
    # beyond ISO 8601's basic forms, exactly as the store parsed the time when it appended the receipt.
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        parsed = _TIME.validate_python(value)
    return parsed.astimezone(UTC)


def signed_fields(envelope: dsse.Envelope) -> dict[str, Any]:
    """The query fields of a receipt as its signed statement gives them (as the store derives them)."""
    statement = json.loads(envelope.payload)
    predicate = statement["predicate"]
    subjects: dict[str, str] = {}
    for subject in statement["subject"]:
        for algorithm, value in subject["digest"].items():
            subjects.setdefault(f"{algorithm}:{value}", subject["name"])
    return {
        "verdict": predicate["verdict"],
        "target": predicate["target"],
        "host": predicate["host"]["hostname"],
        "started_at": _time(predicate["started_at"]),
        "finished_at": _time(predicate["finished_at"]),
        "predicate": predicate,
        "subjects": subjects,
    }


def check(
    conn: Connection, lo: int, hi: int, signed: dict[int, tuple[dsse.Envelope, list[str]]]
) -> list[tuple[int, str]]:
    """Problems (index, message) of the receipt rows for log indexes [lo, hi) whose envelopes are in
    `signed` (index -> (envelope, key ids whose signatures verify))."""
    in_range = sa.and_(_RECEIPTS.c.log_idx >= lo, _RECEIPTS.c.log_idx < hi)
    subjects: dict[str, dict[str, str]] = {}
    for rid, digest, name in conn.execute(
        sa.select(_SUBJECTS.c.receipt_id, _SUBJECTS.c.digest, _SUBJECTS.c.name)
        .join(_RECEIPTS, _RECEIPTS.c.id == _SUBJECTS.c.receipt_id)
        .where(in_range)
    ):
        subjects.setdefault(rid, {})[digest] = name
    problems: list[tuple[int, str]] = []
    for row in conn.execute(sa.select(_RECEIPTS).where(in_range)):
        if row.log_idx not in signed:
            continue  # not a receipt entry, or one whose signature is reported already
        envelope, keyids = signed[row.log_idx]
        try:
            expected = signed_fields(envelope)
        except (ValueError, KeyError, TypeError, AttributeError, ValidationError) as error:
            problems.append((row.log_idx, f"the receipt's signed statement does not parse: {error}"))
            continue
        stored = {**row._asdict(), "subjects": subjects.get(row.id, {})}
        wrong = [name for name in _FIELDS if stored[name] != expected[name]]
        if row.keyid not in keyids:
            wrong.append("keyid")
        if wrong:
            problems.append(
                (
                    row.log_idx,
                    f"the receipts query rows disagree with the signed envelope ({', '.join(wrong)}): "
                    "they were edited or planted",
                )
            )
    return problems
