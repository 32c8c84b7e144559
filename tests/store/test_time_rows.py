"""The unsigned `created_at` columns: a rewrite in any of the four tables that hold one is named by
`log verify`, and the approval time the tool shows is the signed one."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from receipts.errors import TamperError
from receipts.store import Store
from receipts.testing import append_synthetic
from receipts.verify import verify_log
from tests.store.approvals import approval_envelope


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


LATER = "2031-01-01 00:00:00"
EARLIER = "2001-01-01 00:00:00"

REWRITES = {
    "log_entries": ("UPDATE log_entries SET created_at = :t WHERE idx = 2", LATER, 2),
    "checkpoints": ("UPDATE checkpoints SET created_at = :t WHERE size = 2", EARLIER, 1),
    "log_meta": ("UPDATE log_meta SET created_at = :t", LATER, 0),
    "approvals": ("UPDATE approvals SET created_at = :t", EARLIER, 4),
    "entry and checkpoint together": (
        "UPDATE log_entries SET created_at = :t WHERE idx = 1; "
        "UPDATE checkpoints SET created_at = :t WHERE size = 2",
        EARLIER,
        1,
    ),
}


@pytest.mark.parametrize("table", sorted(REWRITES))
def test_log_verify_names_a_rewritten_created_at(store: Store, operator, raw, table: str) -> None:
    append_synthetic(store, operator, 3)  # indexes 1..3
    store.append_approval(approval_envelope(operator, decided_at=_now()))  # index 4
    assert verify_log(store).ok
    sql, value, idx = REWRITES[table]
    raw.drop_triggers()
    for statement in sql.split("; "):
        raw.execute(statement, t=value)
    with pytest.raises(TamperError) as caught:
        verify_log(store)
    report = caught.value.report
    assert any(p.idx == idx and "created_at" in p.message for p in report.problems), report.problems


def test_the_approval_time_shown_is_the_signed_decision_time(store: Store, operator, raw) -> None:
    append_synthetic(store, operator, 1)
    decided = _now()
    approval = store.append_approval(approval_envelope(operator, decided_at=decided))
    raw.drop_triggers()
    raw.execute("UPDATE approvals SET created_at = :t", t=EARLIER)
    shown = store.get_approval(approval.id).created_at
    assert shown.isoformat().replace("+00:00", "Z") == decided
    assert store.list_approvals()[0].created_at == shown
