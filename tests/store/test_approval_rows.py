"""`qualify log verify` checks the `approvals` query rows against the signed approval envelopes: a
subject, decision, policy digest, receipt list, reasons or signer edited in the table (triggers dropped,
as a superuser could) is reported at the approval's log index, on both dialects."""

from __future__ import annotations

import json

import pytest

from qualify.commands._common import load_log_signer
from receipts.keys import SigningKey
from receipts.store import Store
from receipts.testing import synthetic_envelope
from tests.store.approvals import approval_envelope


@pytest.fixture
def approved(cli, home, db_url, raw):
    """Through the CLI: a key and two receipts; then an approval relying on both (log index 3)."""
    key_file = home / "operator.key"
    assert cli("keys", "generate", "--out", key_file, "--db", db_url).code == 0
    key = SigningKey.load(key_file)
    envelopes = home / "in.jsonl"
    envelopes.write_text("".join(json.dumps(synthetic_envelope(key, n)) + "\n" for n in range(2)))
    assert cli("receipts", "import", envelopes, "--db", db_url).code == 0
    with Store.open(db_url, log_signer=load_log_signer(create=False)) as store:
        ids = [r.id for r in store.list_receipts()]
        approval = store.append_approval(
            approval_envelope(key, decision="denied", receipt_ids=ids, reasons=["one host short"])
        )
    assert approval.log_idx == 3
    assert cli("log", "verify", "--db", db_url).code == 0
    raw.drop_triggers()
    return {"url": db_url, "id": approval.id, "ids": ids}


@pytest.mark.parametrize(
    ("column", "value", "field"),
    [
        ("subject", "sha256:" + "ef" * 32, "subject"),
        ("decision", "approved", "decision"),
        ("policy_digest", "sha256:" + "00" * 32, "policy_digest"),
        ("receipt_ids", "[]", "receipt_ids"),
        ("reasons", "[]", "reasons"),
        ("keyid", "0" * 64, "keyid"),
    ],
)
def test_an_edited_approval_row_is_caught_by_log_verify(cli, approved, raw, column, value, field) -> None:
    raw.execute(f"UPDATE approvals SET {column} = :v WHERE id = :i", v=value, i=approved["id"])
    result = cli("log", "verify", "--db", approved["url"])
    assert result.code == 1, result.out + result.err
    first = result.err.splitlines()[0]
    assert "at index 3: the approvals query row disagrees with the signed envelope" in first, first
    assert f"({field})" in first


def test_reordered_receipt_ids_in_an_approval_row_are_caught(cli, approved, raw) -> None:
    reordered = json.dumps(list(reversed(approved["ids"])))
    raw.execute("UPDATE approvals SET receipt_ids = :v WHERE id = :i", v=reordered, i=approved["id"])
    result = cli("log", "verify", "--db", approved["url"], "--json")
    assert result.code == 1
    problems = json.loads(result.out)["problems"]
    assert problems == [
        "index 3: the approvals query row disagrees with the signed envelope (receipt_ids): "
        "it was edited or planted"
    ]
