"""A receipt envelope read for the store: its canonical bytes, id, statement and query fields, checked for
shape only. Whether its signer is trusted is decided at append time, against the log's key history."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from receipts import dsse
from receipts.dsse import PAYLOAD_TYPE_INTOTO
from receipts.errors import VerificationError
from receipts.records import ReceiptRecord, Subject
from receipts.statement import QualificationPredicate, parse_statement_data


@dataclass(frozen=True)
class ParsedReceipt:
    data: bytes  # canonical envelope bytes: what the log stores and hashes
    envelope: dsse.Envelope
    id: str  # sha256 hex of `data`
    qualification: QualificationPredicate
    predicate: dict[str, Any]  # as signed, not as re-serialised
    subjects: tuple[Subject, ...]

    def row(self, idx: int, keyid: str) -> dict[str, Any]:
        """The `receipts` query row for this receipt at log index `idx`, signed by `keyid`."""
        q = self.qualification
        return {
            "id": self.id,
            "log_idx": idx,
            "verdict": q.verdict,
            "target": q.target,
            "host": q.host.hostname,
            "started_at": q.started_at,
            "finished_at": q.finished_at,
            "keyid": keyid,
            "predicate": self.predicate,
        }

    def record(self, idx: int, keyid: str) -> ReceiptRecord:
        return ReceiptRecord(**self.row(idx, keyid), subjects=self.subjects, envelope=self.data)


def parse_receipt(envelope: dsse.EnvelopeInput) -> ParsedReceipt:
    """Parse a DSSE envelope holding a qualification statement; VerificationError (one line) when it is
    not one. Signatures are NOT checked here."""
    data, parsed = dsse.normal_form(envelope)  # parse(data) is `parsed`: one parse, not two
    if parsed.payload_type != PAYLOAD_TYPE_INTOTO:
        raise VerificationError(
            f"not a receipt: payloadType is {parsed.payload_type!r}, expected {PAYLOAD_TYPE_INTOTO}"
        )
    statement, signed = parse_statement_data(parsed.payload)
    qualification = statement.qualification
    subjects: dict[str, str] = {}
    for subject in statement.subject:
        for algorithm, value in subject.digest.items():
            subjects.setdefault(f"{algorithm}:{value}", subject.name)
    return ParsedReceipt(
        data=data,
        envelope=parsed,
        id=hashlib.sha256(data).hexdigest(),
        qualification=qualification,
        predicate=signed["predicate"],  # the parsed payload's own value, as signed
        subjects=tuple(
            sorted((Subject(name=n, digest=d) for d, n in subjects.items()), key=lambda s: s.digest)
        ),
    )
