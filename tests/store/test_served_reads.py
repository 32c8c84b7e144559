"""Every read path serves an entry only when its signature verifies with a key the log trusted and a
checkpoint that verifies with the trusted log key covers it (receipts.trusted). A whole forged append (a
receipt signed by another key naming the operator's keyid, correct Merkle nodes and query rows, and a
checkpoint signed by another note key) is never served, a forged key-trust entry trusts nothing, and rows
beyond the last good checkpoint do not stop reads or approvals: they go on from that checkpoint and say so.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from qualify.api import create_app
from qualify.approve import gather
from receipts import keys
from receipts.errors import TamperError
from receipts.store import Store
from receipts.testing import append_synthetic
from tests.store.forgery import forged_key_trust, forged_receipt
from tests.store.test_insert_guards import _forged_append


def _attack(store: Store, raw, operator) -> tuple[list[str], str, str]:
    """Two good receipts, then a forged receipt naming the operator's keyid; returns (good ids, forged id,
    the last good checkpoint)."""
    good = append_synthetic(store, operator, 2)
    checkpoint = store.latest_checkpoint()
    attacker = keys.generate()
    forged = forged_receipt(raw, store.origin, attacker, operator.keyid)
    assert store.latest_checkpoint() != checkpoint  # the forged checkpoint is the latest row
    return good, forged, checkpoint


def test_a_forged_append_is_not_served_and_reads_go_on_from_the_last_good_checkpoint(
    store: Store, raw, operator
) -> None:
    good, forged, checkpoint = _attack(store, raw, operator)
    with pytest.raises(TamperError, match="beyond the last checkpoint that verifies with the log key"):
        store.get_receipt(forged)
    records, total = store.find_receipts()
    assert sorted(r.id for r in records) == sorted(good) and total == 2
    assert sorted(r.id for r in store.list_receipts(checked=True)) == sorted(good)
    assert store.get_receipt(good[0]).id == good[0]
    head = store.good_head()
    assert (head.size, head.entries) == (3, 4) and store.good_checkpoint() == checkpoint
    assert "1 log entry beyond the last checkpoint" in (head.notice() or "")
    # receipts verify: the good ones verify under the last good checkpoint (saying so), the forged one not.
    ok = store.verify_receipt(good[0])
    assert ok.ok and ok.checkpoint_size == 3 and ok.notice
    assert not store.verify_receipt(forged).ok


def test_a_forged_receipt_inside_a_signed_tree_is_refused_by_its_signature(
    store: Store, raw, operator, log_signer
) -> None:
    """The same forged append, but its checkpoint signed with the log key itself (the attacker has it, or
    the owner slipped): the signature of the receipt is what refuses it."""
    append_synthetic(store, operator, 1)
    from receipts.checkpoint import NoteSigner  # noqa: F401
    from tests.store import forgery

    attacker = keys.generate()
    envelope = forgery.synthetic_envelope(attacker, 5)
    envelope["signatures"] = [{**s, "keyid": operator.keyid} for s in envelope["signatures"]]
    data = forgery.dsse.envelope_bytes(envelope)
    forgery.forged_append(
        raw, "receipt", data, forgery.receipt_rows(data, operator.keyid), store.origin, log_signer
    )
    rid = forgery.parse_receipt(data).id
    with pytest.raises(TamperError, match="does not verify with a key the log trusted"):
        store.get_receipt(rid)
    with pytest.raises(TamperError, match="does not verify with a key the log trusted"):
        store.find_receipts()


def test_a_forged_key_trust_entry_never_makes_a_key_trusted(store: Store, raw, operator) -> None:
    append_synthetic(store, operator, 1)
    attacker = keys.generate()
    forged_key_trust(raw, store.origin, attacker)
    forged = forged_receipt(raw, store.origin, attacker, attacker.keyid)
    assert [k.keyid for k in store.signer_keys()] == [operator.keyid]
    assert attacker.keyid not in store.trusted_keys()
    with pytest.raises(TamperError):
        store.get_receipt(forged)
    assert not store.verify_receipt(forged).ok


def test_the_api_serves_only_what_a_good_checkpoint_covers(store: Store, raw, operator) -> None:
    good, forged, checkpoint = _attack(store, raw, operator)
    client = TestClient(create_app(store))
    for path in (f"/v1/receipts/{forged}", f"/v1/receipts/{forged}/envelope", f"/v1/receipts/{forged}/proof"):
        response = client.get(path)
        assert response.status_code == 409, (path, response.text)
    latest = client.get("/v1/log/checkpoint")
    assert latest.status_code == 200 and latest.json()["note"] == checkpoint
    assert latest.headers["Qualify-Checkpoint-Size"] == "3" and "beyond" in latest.headers["Qualify-Notice"]
    listed = client.get("/v1/receipts").json()["items"]
    assert sorted(r["id"] for r in listed) == sorted(good)
    proof = client.get(f"/v1/receipts/{good[1]}/proof")
    assert proof.status_code == 200 and proof.json()["tree_size"] == 3
    assert proof.json()["checkpoint"] == checkpoint
    assert client.get(f"/v1/receipts/{good[1]}/proof?size=4").status_code == 400
    shown = client.get(f"/v1/receipts/{good[0]}")
    assert shown.status_code == 200 and shown.headers["Qualify-Checkpoint-Size"] == "3"


def test_two_junk_rows_do_not_halt_reads_verification_or_approvals(store: Store, raw, operator) -> None:
    """One writer-role transaction of an empty entry plus a checkpoint row with note `junk` (it passes
    the insert guards) stops appends, as documented, but not reads: every receipt still verifies under
    the last good checkpoint, and an approval judges them."""
    subject = "sha256:" + "ab" * 32
    ids = append_synthetic(store, operator, 2, subject_digest=subject[7:])
    _forged_append(raw, 3)
    for rid in ids:
        report = store.verify_receipt(rid)
        assert report.ok and report.checkpoint_size == 3 and report.notice, report.problem
    candidates, tree_size = gather(store, subject)
    assert tree_size == 3 and [c.problem for c in candidates] == [None, None]
    assert {r.id for r in store.find_receipts()[0]} == set(ids)


def test_no_checkpoint_that_verifies_with_the_trusted_key_serves_nothing(store: Store, raw, operator) -> None:
    """A reader that trusts another log key (the local key of another log) is served nothing, with both
    keys named, instead of whatever the database's own rows vouch for."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from receipts.checkpoint import NoteSigner

    rid = append_synthetic(store, operator, 1)[0]
    other = NoteSigner(store.origin, Ed25519PrivateKey.generate())
    store.set_trusted_log_key(other.verifier(), "a test key")
    with pytest.raises(TamperError, match="no stored checkpoint verifies with the log key") as caught:
        store.get_receipt(rid)
    assert other.vkey() in str(caught.value)


def test_cli_reads_use_the_local_log_key_and_say_when_rows_lie_beyond(
    cli, home, sqlite_url, raw_sqlite, tmp_path
) -> None:
    """`receipts list/show`, `keys list` and `log checkpoint` through the CLI, against the local log key."""
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    store = Store.open(sqlite_url)
    try:
        operator = keys.SigningKey.load(home / "keys" / "operator.key")
        from qualify.commands._common import load_log_signer

        store.set_log_signer(load_log_signer(create=False))
        good = append_synthetic(store, operator, 1)[0]
        checkpoint = store.latest_checkpoint()
        attacker = keys.generate()
        forged_key_trust(raw_sqlite, store.origin, attacker)
        forged = forged_receipt(raw_sqlite, store.origin, attacker, operator.keyid)
    finally:
        store.close()
    listed = cli("receipts", "list", "--db", sqlite_url, "--json")
    assert listed.code == 0 and [r["id"] for r in json.loads(listed.out)["items"]] == [good]
    assert "beyond the last checkpoint" in listed.err
    shown = cli("receipts", "show", forged, "--db", sqlite_url)
    assert shown.code == 1 and "beyond the last checkpoint" in shown.err  # tampering found: exit 1
    key_list = cli("keys", "list", "--db", sqlite_url, "--json")
    assert [k["keyid"] for k in json.loads(key_list.out)] == [operator.keyid]
    out = cli("log", "checkpoint", "--db", sqlite_url)
    assert out.code == 0 and out.out == checkpoint
    verified = cli("receipts", "verify", forged, "--db", sqlite_url)
    assert verified.code == 1


def test_what_was_vouched_for_stays_vouched_only_while_the_log_extends_it(
    store: Store, raw, operator
) -> None:
    """Reads remember what they vouched for while each new good checkpoint provably extends the last; a
    listing after appends reuses it, and a forged append on top changes nothing of it."""
    first = append_synthetic(store, operator, 3)
    assert len(store.find_receipts()[0]) == 3
    vouched = store._vouched
    assert vouched is not None and set(vouched[2]) == {1, 2, 3}
    later = append_synthetic(store, operator, 2, start=10)
    assert {r.id for r in store.find_receipts()[0]} == set(first + later)
    assert store._vouched is not None and set(store._vouched[2]) == {1, 2, 3, 4, 5}
    forged_receipt(raw, store.origin, keys.generate(), operator.keyid)
    assert {r.id for r in store.find_receipts()[0]} == set(first + later)
    assert store.good_head().size == 6
