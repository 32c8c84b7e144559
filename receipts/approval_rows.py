"""Approval entries: the `approvals` query fields derived from the signed approval statement (at append),
whether stored `approvals` rows still say what the signed envelopes say (at log verify), and approvals
served from their signed statements (at read)."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from receipts import dsse
from receipts.errors import TamperError, VerificationError
from receipts.models import ApprovalRow
from receipts.records import ApprovalRecord
from receipts.statement import STATEMENT_TYPE

# The predicate type of a signed rollout decision (qualify.approve writes it).
APPROVAL_PREDICATE_TYPE = "https://qualify.dev/approval/v1"

_APPROVALS = ApprovalRow.__table__
# The fields derived from the signed predicate, in the order of the values below and of the columns read.
FIELDS = ("subject", "decision", "policy_digest", "receipt_ids", "reasons")
# Column widths (models.ApprovalRow): a longer value would be refused by PostgreSQL with a driver error.
_WIDTHS = {"subject": 200, "decision": 16, "policy_digest": 200}
_COLUMNS = (_APPROVALS.c.log_idx, _APPROVALS.c.keyid, *(_APPROVALS.c[name] for name in FIELDS))


def _refuse(why: str) -> VerificationError:
    return VerificationError(f"not an approval statement: {why}")


def _signed_values(payload: bytes) -> tuple[Any, ...]:
    """The values of FIELDS as the signed statement gives them; VerificationError (one line) when the
    payload is not an in-toto statement of an approval whose predicate names one of its subjects."""
    try:
        statement = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as error:
        raise _refuse(f"the payload is not JSON ({error})") from error
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise _refuse(f"_type is not {STATEMENT_TYPE}")
    if statement.get("predicateType") != APPROVAL_PREDICATE_TYPE:
        raise _refuse(f"predicateType is {statement.get('predicateType')!r}, not {APPROVAL_PREDICATE_TYPE}")
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict):
        raise _refuse("it has no predicate object")
    values = tuple(predicate.get(name) for name in FIELDS)
    for name, value in zip(FIELDS, values, strict=True):
        if name in _WIDTHS:
            if not isinstance(value, str) or not value or len(value) > _WIDTHS[name]:
                raise _refuse(f"predicate.{name} must be a string of 1 to {_WIDTHS[name]} characters")
        elif not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _refuse(f"predicate.{name} must be a list of strings")
    digests = {
        f"{algorithm}:{value}"
        for subject in statement.get("subject") or []
        if isinstance(subject, dict) and isinstance(subject.get("digest"), dict)
        for algorithm, value in subject["digest"].items()
    }
    if values[0] not in digests:
        raise _refuse(f"predicate.subject {values[0]!r} is not one of the statement's signed subjects")
    return values


def signed_fields(envelope: dsse.Envelope) -> dict[str, Any]:
    """The `approvals` query fields as the signed approval statement gives them (what the store writes)."""
    if envelope.payload_type != dsse.PAYLOAD_TYPE_INTOTO:
        raise _refuse(f"payloadType is {envelope.payload_type!r}, expected {dsse.PAYLOAD_TYPE_INTOTO}")
    return dict(zip(FIELDS, _signed_values(envelope.payload), strict=True))


def check(
    conn: Connection, lo: int, hi: int, signed: dict[int, tuple[bytes, list[str]]]
) -> list[tuple[int, str]]:
    """Problems (index, message) of the approval rows for log indexes [lo, hi) whose envelopes are in
    `signed` (index -> (statement payload, key ids whose signatures verify))."""
    problems: list[tuple[int, str]] = []
    rows = conn.execute(sa.select(*_COLUMNS).where(_APPROVALS.c.log_idx >= lo, _APPROVALS.c.log_idx < hi))
    for log_idx, keyid, *stored in rows:
        entry = signed.get(log_idx)
        if entry is None:
            continue  # not an approval entry (reported by the id check), or its signature is reported
        payload, keyids = entry
        try:
            expected = _signed_values(payload)
        except VerificationError as error:
            problems.append((log_idx, f"the approval's signed statement does not parse: {error}"))
            continue
        wrong = [name for name, a, b in zip(FIELDS, stored, expected, strict=True) if a != b]
        if keyid not in keyids:
            wrong.append("keyid")
        if wrong:
            problems.append(
                (
                    log_idx,
                    f"the approvals query row disagrees with the signed envelope ({', '.join(wrong)}): "
                    "it was edited or planted",
                )
            )
    return problems


def served(row: Any) -> ApprovalRecord:
    """An approval as its signed statement says (subject, decision, policy, receipts, reasons, and the time
    it was decided), after checking that the row's log entry is that approval; TamperError if not."""
    where = f"approval {row.id[:16]}: its query row points at log index {row.log_idx}"
    data = None if row.envelope is None else bytes(row.envelope)
    if data is None or row.kind != "approval" or hashlib.sha256(data).hexdigest() != row.id:
        raise TamperError(
            f"{where}, which holds {'no entry' if data is None else f'another {row.kind} entry'}: the row "
            "was planted or edited outside the store; nothing served; run: qualify log verify"
        )
    envelope = dsse.parse(data)
    signed = signed_fields(envelope)
    if row.keyid not in {s.keyid for s in envelope.signatures}:
        raise TamperError(
            f"{where}, whose signatures do not name key {row.keyid[:16]}; run: qualify log verify"
        )
    decided = json.loads(envelope.payload)["predicate"].get("decided_at")
    try:
        created_at = datetime.fromisoformat(decided.replace("Z", "+00:00")).astimezone(UTC)
    except (AttributeError, TypeError, ValueError):
        created_at = row.created_at  # an approval signed without a time: the append time (checked by verify)
    return ApprovalRecord(
        row.id,
        row.log_idx,
        signed["subject"],
        signed["decision"],
        signed["policy_digest"],
        signed["receipt_ids"],
        signed["reasons"],
        row.keyid,
        created_at,
    )
