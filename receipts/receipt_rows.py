"""Whether the `receipts` and `receipt_subjects` query rows say what the signed envelopes say: they are
derived data, which a plain INSERT (or a superuser's UPDATE) could change without touching the log.
Checked for the whole log at `log verify`, and for each receipt before it is served."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from pydantic import AwareDatetime, TypeAdapter, ValidationError
from sqlalchemy.engine import Connection

from receipts import dsse, merkle
from receipts.errors import TamperError, VerificationError
from receipts.models import ReceiptRow, ReceiptSubject
from receipts.records import ReceiptRecord

_RECEIPTS = ReceiptRow.__table__
_SUBJECTS = ReceiptSubject.__table__
_TIME: TypeAdapter[datetime] = TypeAdapter(AwareDatetime)
# The compared fields, in the order of the values below and of the columns read.
_FIELDS = ("verdict", "target", "host", "started_at", "finished_at", "predicate", "subjects")
# The predicate is read as its text and parsed here, as the JSON column's result processor would parse it
# (json.loads; a driver that parses JSON itself hands over the value): that processor costs three times the
# parse, for every receipt of a verification.
_COLUMNS = (
    _RECEIPTS.c.log_idx,
    _RECEIPTS.c.id,
    _RECEIPTS.c.keyid,
    *(_RECEIPTS.c[name] for name in _FIELDS[:-2]),
    sa.type_coerce(_RECEIPTS.c.predicate, sa.Text).label("predicate"),
)
_UNREADABLE = object()  # a stored predicate that is not JSON: equal to no signed one
PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, ValidationError)


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


def _signed_values(payload: bytes) -> tuple[Any, ...]:
    """The values of `_FIELDS` as the signed statement gives them (as the store derives them), from one
    structural parse: the payload's bytes are covered by the signature, so nothing more is needed."""
    statement = json.loads(payload)
    predicate = statement["predicate"]
    subjects: dict[str, str] = {}
    for subject in statement["subject"]:
        for algorithm, value in subject["digest"].items():
            subjects.setdefault(f"{algorithm}:{value}", subject["name"])
    return (
        predicate["verdict"],
        predicate["target"],
        predicate["host"]["hostname"],
        _time(predicate["started_at"]),
        _time(predicate["finished_at"]),
        predicate,
        subjects,
    )


def signed_fields(envelope: dsse.Envelope | bytes) -> dict[str, Any]:
    """The query fields of a receipt as its signed statement gives them (as the store derives them);
    `envelope` is a parsed envelope or its payload."""
    payload = envelope.payload if isinstance(envelope, dsse.Envelope) else envelope
    return dict(zip(_FIELDS, _signed_values(payload), strict=True))


def check(
    conn: Connection, lo: int, hi: int, signed: dict[int, tuple[bytes, list[str]]]
) -> list[tuple[int, str]]:
    """Problems (index, message) of the receipt rows for log indexes [lo, hi) whose envelopes are in
    `signed` (index -> (statement payload, key ids whose signatures verify))."""
    in_range = sa.and_(_RECEIPTS.c.log_idx >= lo, _RECEIPTS.c.log_idx < hi)
    subjects: dict[str, dict[str, str]] = {}
    for rid, digest, name in conn.execute(
        sa.select(_SUBJECTS.c.receipt_id, _SUBJECTS.c.digest, _SUBJECTS.c.name)
        .join(_RECEIPTS, _RECEIPTS.c.id == _SUBJECTS.c.receipt_id)
        .where(in_range)
    ):
        by_digest = subjects.get(rid)
        if by_digest is None:
            by_digest = subjects[rid] = {}
        by_digest[digest] = name
    problems: list[tuple[int, str]] = []
    no_subjects: dict[str, str] = {}
    for log_idx, rid, keyid, *columns, predicate in conn.execute(sa.select(*_COLUMNS).where(in_range)):
        entry = signed.get(log_idx)
        if entry is None:
            continue  # not a receipt entry, or one whose signature is reported already
        if isinstance(predicate, str):
            try:
                predicate = json.loads(predicate)
            except ValueError:
                predicate = _UNREADABLE
        payload, keyids = entry
        try:
            expected = _signed_values(payload)
        except PARSE_ERRORS as error:
            problems.append((log_idx, f"the receipt's signed statement does not parse: {error}"))
            continue
        stored = (*columns, predicate, subjects.get(rid, no_subjects))
        # One tuple comparison for the common case; names only when something differs.
        wrong = (
            []
            if stored == expected
            else [n for n, a, b in zip(_FIELDS, stored, expected, strict=True) if a != b]
        )
        if keyid not in keyids:
            wrong.append("keyid")
        if wrong:
            problems.append(
                (
                    log_idx,
                    f"the receipts query rows disagree with the signed envelope ({', '.join(wrong)}): "
                    "they were edited or planted",
                )
            )
    return problems


def check_served(record: ReceiptRecord, entry: Any) -> None:
    """Refuse to serve a `receipts` row that is not what its log entry says: the entry at its index must be
    a receipt whose bytes hash to the row's id and leaf hash, and the row's fields must be the signed ones
    (a row planted or edited with plain SQL would otherwise be shown, or proven with another entry)."""
    where = f"receipt {record.id[:16]}: its query row points at log index {record.log_idx}"
    data = record.envelope
    if entry is None or data is None:
        problem = "which holds no entry"
    elif entry.kind != "receipt" or hashlib.sha256(data).hexdigest() != record.id:
        problem = f"which holds another {entry.kind} entry"
    elif merkle.leaf_hash(data) != bytes(entry.leaf_hash):
        problem = "whose stored leaf hash is not the hash of its bytes"
    else:
        try:
            envelope = dsse.parse(data)
            signed = signed_fields(envelope)
        except (*PARSE_ERRORS, VerificationError) as error:
            problem = f"whose signed statement does not parse ({error})"
        else:
            shown = {
                "verdict": record.verdict,
                "target": record.target,
                "host": record.host,
                "started_at": record.started_at,
                "finished_at": record.finished_at,
                "predicate": record.predicate,
                "subjects": {s.digest: s.name for s in record.subjects},
            }
            wrong = [name for name, value in shown.items() if signed[name] != value]
            named = {s.keyid for s in envelope.signatures}
            if record.keyid not in named:
                wrong.append("keyid")
            if not wrong:
                return
            problem = f"whose signed envelope disagrees with the row ({', '.join(wrong)})"
    raise TamperError(
        f"{where}, {problem}: the row was planted or edited outside the store; nothing served; "
        "run: qualify log verify"
    )
