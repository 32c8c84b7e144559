"""`log verify` checks that the query tables say what the signed envelopes say: a verdict, subject, host or
predicate edited in the `receipts` tables (or a subject row planted with a plain INSERT) is reported at
its index, and an entry of a kind the log never writes cannot slip past every check."""

from __future__ import annotations

import hashlib
import json

import pytest

from receipts.errors import TamperError
from receipts.testing import append_synthetic, synthetic_envelope
from receipts.verify import verify_log


@pytest.fixture
def three(store, operator) -> list[str]:
    """Receipts at log indexes 1 (qualified), 2 (rejected) and 3 (qualified)."""
    ids = [store.append_receipt(synthetic_envelope(operator, 0)).id]
    ids.append(store.append_receipt(synthetic_envelope(operator, 1, verdict="rejected")).id)
    ids.extend(append_synthetic(store, operator, 1, start=2))
    verify_log(store)  # clean before any edit
    return ids


def _problem(store) -> str:
    with pytest.raises(TamperError) as caught:
        verify_log(store)
    return str(caught.value)


@pytest.mark.parametrize(
    ("column", "value", "field"),
    [("verdict", "qualified", "verdict"), ("host", "trusted-host", "host"), ("target", "gpu", "target")],
)
def test_an_edited_receipt_column_is_reported_at_its_index(store, three, raw, column, value, field) -> None:
    raw.drop_triggers()
    raw.execute(f"UPDATE receipts SET {column} = :v WHERE id = :i", v=value, i=three[1])
    message = _problem(store)
    assert message.startswith("log verification failed at index 2: the receipts query rows disagree")
    assert f"({field})" in message


def test_an_edited_stored_predicate_is_reported(store, three, raw) -> None:
    predicate = store.get_receipt(three[1]).predicate
    predicate["faults"]["restart_count"] = 0
    predicate["checks"][0]["status"] = "pass"
    raw.drop_triggers()
    raw.execute("UPDATE receipts SET predicate = :p WHERE id = :i", p=json.dumps(predicate), i=three[1])
    assert "index 2: the receipts query rows disagree with the signed envelope (predicate)" in _problem(store)


def test_a_subject_row_planted_by_insert_is_reported(store, three, raw) -> None:
    # Only the insert guards are dropped (as the owner can): the writer role may not insert this row.
    raw.drop_insert_guards()
    other = "sha256:" + hashlib.sha256(b"another build").hexdigest()
    raw.execute(
        "INSERT INTO receipt_subjects (receipt_id, digest, name) VALUES (:i, :d, 'engine-image')",
        i=three[0],
        d=other,
    )
    assert [r.id for r in store.list_receipts(subject=other)] == [three[0]]  # what a reader would see
    assert "index 1: the receipts query rows disagree with the signed envelope (subjects)" in _problem(store)


def test_a_receipt_row_naming_another_signer_is_reported(store, three, raw) -> None:
    raw.drop_triggers()
    raw.execute("UPDATE receipts SET keyid = :k WHERE id = :i", k="0" * 64, i=three[2])
    assert "index 3: the receipts query rows disagree with the signed envelope (keyid)" in _problem(store)


def test_an_entry_of_an_unknown_kind_is_reported(store, three, raw) -> None:
    if raw.dialect != "postgresql":
        pytest.skip("SQLite cannot drop a CHECK constraint in place")
    raw.drop_triggers()
    raw.execute("ALTER TABLE log_entries DROP CONSTRAINT log_entries_kind")
    raw.execute("UPDATE log_entries SET kind = 'note' WHERE idx = 2")
    with pytest.raises(TamperError) as caught:
        verify_log(store)
    problems = [str(p) for p in caught.value.report.problems]
    assert "index 2: the entry's kind 'note' is not a kind this log writes" in problems
