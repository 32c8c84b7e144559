"""Read paths serve a receipt only after checking its query row against its log entry: a `receipts` row
planted with plain SQL (pointing at another entry) is refused with one line, never shown as qualified and
never proven with another entry's proof."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from qualify.api import create_app
from receipts.errors import TamperError
from receipts.store import Store
from receipts.testing import synthetic_envelope

FORGED = "f" * 64


def _plant_row_at_index_0(raw) -> None:
    """What a `qualify_writer` member can do with one INSERT: a receipts row pointing at log index 0 (the
    key-trust entry), copied from a real row so that every column is well formed."""
    raw.execute(
        "INSERT INTO receipts "
        "(id, log_idx, verdict, target, host, started_at, finished_at, keyid, predicate) "
        "SELECT :id, 0, 'qualified', target, host, started_at, finished_at, keyid, predicate "
        "FROM receipts WHERE log_idx = 1",
        id=FORGED,
    )


@pytest.fixture
def planted(store: Store, operator, raw) -> Store:
    store.append_receipt(synthetic_envelope(operator, 1, verdict="rejected"))
    raw.drop_triggers()  # the insert guard of a later migration refuses this row; an owner can drop it
    _plant_row_at_index_0(raw)
    return store


def test_get_receipt_refuses_a_row_that_points_at_another_entry(planted: Store) -> None:
    with pytest.raises(TamperError, match=r"points at log index 0, which holds another key-trust entry"):
        planted.get_receipt("ffffffff")
    report = planted.verify_receipt("ffffffff")
    assert not report.ok and report.problem


def test_a_row_whose_fields_disagree_with_its_envelope_is_refused(store: Store, operator, raw) -> None:
    record = store.append_receipt(synthetic_envelope(operator, 1, verdict="rejected"))
    assert store.get_receipt(record.id).verdict == "rejected"
    raw.drop_triggers()
    raw.execute("UPDATE receipts SET verdict = 'qualified' WHERE id = :id", id=record.id)
    with pytest.raises(TamperError, match=r"disagrees with the row \(verdict\)"):
        store.get_receipt(record.id)


def test_the_api_answers_409_for_a_planted_row_on_every_receipt_route(planted: Store) -> None:
    client = TestClient(create_app(planted, token=None))
    for path in ("", "/proof", "/envelope"):
        response = client.get(f"/v1/receipts/{FORGED}{path}")
        assert response.status_code == 409, (path, response.text)
        assert "points at log index 0" in response.json()["detail"]
    listed = client.get("/v1/receipts")  # a listing shows no planted row as qualified either
    assert listed.status_code == 409 and "points at log index 0" in listed.json()["detail"]


def test_the_cli_refuses_a_planted_row_with_one_line(cli, db_url, planted: Store) -> None:
    # Exit 1, as the verifiers: the reader found a problem with the log, not with the input.
    for command in (("show", FORGED[:8]), ("prove", FORGED[:8]), ("show", FORGED[:8], "--envelope")):
        result = cli("receipts", *command, "--db", db_url)
        assert result.code == 1, (command, result.out)
        assert result.out == ""
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and "points at log index 0" in lines[0], result.err
    listed = cli("receipts", "list", "--db", db_url)
    assert listed.code == 1 and "points at log index 0" in listed.err
    verified = cli("receipts", "verify", FORGED[:8], "--db", db_url, "--json")
    assert verified.code == 1
    assert not json.loads(verified.out)[0]["ok"]


def test_show_envelope_writes_the_exact_stored_bytes(cli, db_url, store: Store, operator) -> None:
    record = store.append_receipt(synthetic_envelope(operator, 1))
    result = cli("receipts", "show", record.id, "--envelope", "--db", db_url)
    assert result.code == 0
    assert result.out.encode() == store.entry(record.log_idx).envelope  # no newline added


def test_an_imported_envelope_without_keyid_is_stored_with_the_signers_keyid(store: Store, operator) -> None:
    from securesystemslib.dsse import Envelope as SslibEnvelope

    envelope = synthetic_envelope(operator, 1)
    envelope["signatures"] = [{"sig": s["sig"]} for s in envelope["signatures"]]  # DSSE: keyid optional
    imported = store.append_receipts([envelope])[0]  # what `qualify receipts import` calls
    assert imported.keyid == operator.keyid
    stored = store.get_receipt(imported.id)
    assert [s["keyid"] for s in json.loads(stored.envelope)["signatures"]] == [operator.keyid]
    theirs = SslibEnvelope.from_dict(json.loads(stored.envelope))
    assert list(theirs.verify([operator.public_key().to_sslib()], threshold=1)) == [operator.keyid]
