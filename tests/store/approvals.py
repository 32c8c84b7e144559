"""Signed approval statements for store tests, shaped as qualify.approve writes them (the store derives
the `approvals` row from them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from receipts import dsse
from receipts.approval_rows import APPROVAL_PREDICATE_TYPE
from receipts.canonical import canonical_json
from receipts.keys import SigningKey
from receipts.statement import STATEMENT_TYPE

SUBJECT = "sha256:" + "ab" * 32
POLICY = "sha256:" + "cd" * 32


def approval_statement(
    subject: str = SUBJECT,
    *,
    decision: str = "approved",
    policy_digest: str = POLICY,
    receipt_ids: Sequence[str] = (),
    reasons: Sequence[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    algorithm, _, value = subject.partition(":")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": subject, "digest": {algorithm: value}}],
        "predicateType": APPROVAL_PREDICATE_TYPE,
        "predicate": {
            "subject": subject,
            "decision": decision,
            "policy_digest": policy_digest,
            "receipt_ids": list(receipt_ids),
            "reasons": list(reasons),
            **extra,
        },
    }


def approval_envelope(key: SigningKey, subject: str = SUBJECT, **fields: Any) -> dict[str, Any]:
    return dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(approval_statement(subject, **fields)), key)
