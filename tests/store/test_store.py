"""The store on both dialects: gapless appends with a signed checkpoint each, proofs that verify,
queries, key trust and revocation in log order, and refusals that leave the log unchanged."""

from __future__ import annotations

import base64
import threading
from datetime import UTC, datetime

import pytest

from receipts import dsse, keys, merkle
from receipts.canonical import canonical_json
from receipts.checkpoint import NoteSigner, open_checkpoint
from receipts.errors import NotFound, StoreError, VerificationError
from receipts.store import Store
from receipts.testing import append_synthetic, synthetic_envelope, synthetic_statement
from receipts.verify import verify_log
from tests.store.approvals import POLICY, SUBJECT, approval_envelope, approval_statement


def _leaves(store: Store) -> list[bytes]:
    return [e.leaf_hash for e in store.iter_entries()]


def test_appends_get_gapless_indexes_and_a_signed_checkpoint_each(store, operator, log_signer) -> None:
    ids = append_synthetic(store, operator, 6)
    assert [store.get_receipt(i).log_idx for i in ids] == [1, 2, 3, 4, 5, 6]
    assert store.size() == 7
    leaves = _leaves(store)
    for size in range(1, 8):
        cp = open_checkpoint(store.checkpoint(size), [log_signer.verifier()], origin=log_signer.name)
        assert (cp.size, cp.root) == (size, merkle.root_hash(leaves[:size]))
    assert store.latest_checkpoint() == store.checkpoint(7)


def test_stored_bytes_are_the_canonical_envelope_and_the_id_is_their_digest(store, operator) -> None:
    envelope = synthetic_envelope(operator, 1)
    envelope["ignored"] = "not covered by any signature"
    record = store.append_receipt(envelope)
    entry = store.entry(record.log_idx)
    assert entry.envelope == dsse.envelope_bytes(envelope)
    assert entry.leaf_hash == merkle.leaf_hash(entry.envelope)
    assert record.id == __import__("hashlib").sha256(entry.envelope).hexdigest()
    assert store.get_receipt(record.id).envelope == entry.envelope


def test_proofs_from_stored_subtrees_equal_proofs_from_all_leaves(store, operator) -> None:
    append_synthetic(store, operator, 20, batch=7)
    leaves = _leaves(store)
    n = len(leaves)
    assert store.root() == merkle.root_hash(leaves)
    for size in (1, 2, 5, 8, 13, n):
        assert store.root(size) == merkle.root_hash(leaves[:size])
        for idx in {0, size // 2, size - 1}:
            proof = store.inclusion_proof(idx, size)
            assert proof == merkle.inclusion_proof(leaves[:size], idx)
            merkle.verify_inclusion(idx, size, leaves[idx], proof, store.root(size))
        proof = store.consistency_proof(size, n)
        assert proof == merkle.consistency_proof(leaves, size)
        merkle.verify_consistency(size, n, proof, store.root(size), store.root())


def test_out_of_range_proofs_are_not_found(store) -> None:
    with pytest.raises(NotFound):
        store.inclusion_proof(5)
    with pytest.raises(NotFound):
        store.root(99)
    with pytest.raises(NotFound):
        store.consistency_proof(3, 1)


def test_list_filters_by_verdict_time_and_subject(store, operator) -> None:
    digest = "ab" * 32
    store.append_receipt(synthetic_envelope(operator, 1, verdict="qualified", subject_digest=digest))
    store.append_receipt(synthetic_envelope(operator, 2, verdict="rejected", subject_digest=digest))
    late = datetime(2030, 1, 1, tzinfo=UTC)
    store.append_receipt(synthetic_envelope(operator, 3, verdict="aborted", started_at=late))
    assert [r.verdict for r in store.list_receipts()] == ["qualified", "rejected", "aborted"]
    assert [r.verdict for r in store.list_receipts(verdict="rejected")] == ["rejected"]
    assert [r.verdict for r in store.list_receipts(since=datetime(2029, 1, 1, tzinfo=UTC))] == ["aborted"]
    assert [r.verdict for r in store.list_receipts(subject=f"sha256:{digest}")] == ["qualified", "rejected"]
    assert [r.verdict for r in store.list_receipts(subject=digest, limit=1, offset=1)] == ["rejected"]
    record = store.list_receipts(verdict="aborted")[0]
    assert record.finished_at.tzinfo is not None and record.finished_at.year == 2030
    assert {s.name for s in record.subjects} == {"engine-image", "engine-config"}


def test_receipt_lookup_by_prefix_refuses_unknown_and_malformed_ids(store, operator) -> None:
    rid = store.append_receipt(synthetic_envelope(operator, 1)).id
    assert store.get_receipt(rid[:8]).id == rid
    assert store.get_receipt("sha256:" + rid.upper()).id == rid
    with pytest.raises(NotFound):
        store.get_receipt("0" * 64 if not rid.startswith("0") else "f" * 64)
    for bad in ("abc", "zzzz", "%%%%", rid + "00"):
        with pytest.raises(NotFound):
            store.get_receipt(bad)


def test_duplicate_receipt_is_refused_and_nothing_is_appended(store, operator) -> None:
    envelope = synthetic_envelope(operator, 1)
    store.append_receipt(envelope)
    before = store.counts()
    with pytest.raises(StoreError, match="already in the log at index 1"):
        store.append_receipt(envelope)
    assert store.counts() == before


def test_a_batch_with_one_bad_receipt_appends_none(store, operator) -> None:
    stranger = keys.generate()
    before = store.counts()
    batch = [
        synthetic_envelope(operator, 1),
        synthetic_envelope(stranger, 2),
        synthetic_envelope(operator, 3),
    ]
    with pytest.raises(VerificationError):
        store.append_receipts(batch)
    assert store.counts() == before
    # The writer's cached frontier must not survive a rolled-back append: the next append is still right.
    store.append_receipt(synthetic_envelope(operator, 4))
    verify_log(store)


def test_untrusted_and_forged_signatures_are_refused(store, operator) -> None:
    before = store.counts()
    with pytest.raises(VerificationError, match="not by a trusted key"):
        store.append_receipt(synthetic_envelope(keys.generate(), 1))
    forged = synthetic_envelope(operator, 2)
    payload = base64.b64decode(forged["payload"]).replace(b'"qualified"', b'"rejected!"')
    forged["payload"] = base64.b64encode(payload).decode()
    with pytest.raises(VerificationError):
        store.append_receipt(forged)
    # A forged signature naming the trusted key id is refused, not skipped.
    other = synthetic_envelope(keys.generate(), 3)
    other["signatures"][0]["keyid"] = operator.keyid
    with pytest.raises(VerificationError, match="does not verify"):
        store.append_receipt(other)
    assert store.counts() == before


def test_only_qualification_statements_are_receipts(store, operator) -> None:
    statement = synthetic_statement(1)
    with pytest.raises(VerificationError, match="payloadType"):
        store.append_receipt(dsse.sign("text/plain", canonical_json(statement), operator))
    statement["predicateType"] = "https://example.com/other/v1"
    with pytest.raises(VerificationError, match="not a qualification"):
        store.append_receipt(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement), operator))
    with pytest.raises(VerificationError):
        store.append_receipt({"payloadType": "x", "payload": "!!", "signatures": []})


def test_receipts_signed_before_revocation_stay_valid_and_after_are_refused(
    store, operator, log_signer
) -> None:
    before = store.append_receipt(synthetic_envelope(operator, 1))
    revoked = store.revoke_key(operator.keyid[:10], "laptop lost")
    assert (revoked.revoked_at, revoked.reason, revoked.status) == (2, "laptop lost", "revoked")
    with pytest.raises(VerificationError, match="revoked at log index 2"):
        store.append_receipt(synthetic_envelope(operator, 2))
    report = store.verify_receipt(before.id, verifiers=[log_signer.verifier()])
    assert report.ok, report.problem
    assert operator.keyid not in store.trusted_keys()
    assert operator.keyid in store.trusted_keys(at_idx=1)
    with pytest.raises(StoreError, match="revoked"):
        store.trust_key(operator.public_key())
    with pytest.raises(StoreError, match="already revoked"):
        store.revoke_key(operator.keyid)
    verify_log(store, verifiers=[log_signer.verifier()])


def test_a_key_signs_only_after_its_trust_entry(store, operator) -> None:
    newcomer = keys.generate("p256")
    envelope = synthetic_envelope(newcomer, 1)
    with pytest.raises(VerificationError):
        store.append_receipt(envelope)
    info = store.trust_key(newcomer.public_key(), "second operator")
    assert info.trusted_at == 1 and info.algorithm == "p256"
    assert store.append_receipt(envelope).keyid == newcomer.keyid
    with pytest.raises(StoreError, match="already trusted"):
        store.trust_key(newcomer.public_key())
    with pytest.raises(NotFound):
        store.revoke_key("ffffffffffff" if not newcomer.keyid.startswith("f") else "000000000000")


def test_key_history_is_replayed_from_the_log(store, operator) -> None:
    second = keys.generate()
    store.trust_key(second.public_key())
    store.revoke_key(second.keyid, "rotated")
    history = store.key_history()
    assert history.keys[operator.keyid].trusted_at == 0
    assert (history.keys[second.keyid].trusted_at, history.keys[second.keyid].revoked_at) == (1, 2)
    assert [k.keyid for k in store.signer_keys()] == [operator.keyid, second.keyid]


def test_verify_receipt_reports_each_check(store, operator, log_signer) -> None:
    rid = store.append_receipt(synthetic_envelope(operator, 1)).id
    append_synthetic(store, operator, 3, start=10)
    report = store.verify_receipt(rid, verifiers=[log_signer.verifier()])
    assert report.ok and report.checkpoint_size == 5
    assert set(report.checks) == {
        "id_matches_bytes",
        "leaf_hash",
        "query_row",
        "signature",
        "checkpoint_signature",
        "inclusion",
    }
    stranger = NoteSigner(log_signer.name, keys.generate().crypto)
    bad = store.verify_receipt(rid, verifiers=[stranger.verifier()])
    assert not bad.ok and "signature" in bad.problem


def test_approvals_are_log_entries_about_receipts_in_the_log(store, operator) -> None:
    rid = store.append_receipt(synthetic_envelope(operator, 1)).id
    envelope = approval_envelope(operator, receipt_ids=[rid], reasons=["all good"])
    approval = store.append_approval(envelope)
    assert approval.log_idx == 2 and approval.receipt_ids == [rid]
    assert (approval.subject, approval.decision, approval.policy_digest) == (SUBJECT, "approved", POLICY)
    assert approval.reasons == ["all good"] and approval.keyid == operator.keyid
    assert [a.id for a in store.list_approvals(subject=SUBJECT)] == [approval.id]
    other = approval_envelope(operator, decision="denied", receipt_ids=["0" * 64])
    with pytest.raises(NotFound):
        store.append_approval(other)
    verify_log(store)


def test_approval_fields_that_disagree_with_the_envelope_are_refused_and_nothing_is_written(
    store, operator
) -> None:
    rid = store.append_receipt(synthetic_envelope(operator, 1)).id
    envelope = approval_envelope(operator, decision="denied", receipt_ids=[rid], reasons=["too old"])
    signed = {
        "subject": SUBJECT,
        "decision": "denied",
        "policy_digest": POLICY,
        "receipt_ids": [rid],
        "reasons": ["too old"],
    }
    wrong = {
        "subject": "sha256:" + "ef" * 32,
        "decision": "approved",
        "policy_digest": "sha256:" + "00" * 32,
        "receipt_ids": [],
        "reasons": [],
    }
    size = store.size()
    for name, value in wrong.items():
        with pytest.raises(StoreError, match=f"approval {name} .* disagrees with the signed envelope"):
            store.append_approval(envelope, **{**signed, name: value})
        assert store.size() == size and store.list_approvals() == []
    approval = store.append_approval(envelope, **signed)  # every field agrees: appended
    assert approval.decision == "denied" and store.size() == size + 1


@pytest.mark.parametrize(
    "statement",
    [
        {"predicateType": "https://qualify.dev/qualification/v1"},
        {"predicate": {"decision": "approved"}},
        {"subject": [{"name": "x", "digest": {"sha256": "ef" * 32}}]},
        {"predicate": {**approval_statement()["predicate"], "receipt_ids": "x"}},
    ],
    ids=["receipt-type", "no-fields", "subject-not-signed", "ids-not-a-list"],
)
def test_an_envelope_that_is_not_an_approval_statement_is_refused(store, operator, statement) -> None:
    payload = canonical_json({**approval_statement(), **statement})
    with pytest.raises(VerificationError, match="not an approval statement"):
        store.append_approval(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, payload, operator))
    with pytest.raises(VerificationError, match="payloadType"):
        store.append_approval(dsse.sign("application/json", canonical_json(approval_statement()), operator))
    assert store.size() == 1


def test_approvals_are_paged_in_log_order_by_the_database(store, operator) -> None:
    rid = store.append_receipt(synthetic_envelope(operator, 1)).id
    made = []
    for n in range(5):
        subject = "sha256:" + ("ab" if n % 2 else "cd") * 32
        envelope = approval_envelope(operator, subject, receipt_ids=[rid], reasons=[f"n={n}"])
        made.append(store.append_approval(envelope))
    ids = [a.id for a in made]
    assert [a.id for a in store.list_approvals()] == ids
    assert [a.id for a in store.list_approvals(limit=2, offset=1)] == ids[1:3]
    assert [a.id for a in store.list_approvals(offset=4)] == ids[4:]
    assert store.list_approvals(limit=3, offset=5) == []
    even = "sha256:" + "cd" * 32
    assert [a.id for a in store.list_approvals(subject=even, limit=1, offset=1)] == [ids[2]]


def test_a_store_refuses_a_different_log_key(db_url, log_signer, operator) -> None:
    Store.open(db_url, log_signer=log_signer).trust_key(operator.public_key())
    impostor = NoteSigner(log_signer.name, keys.generate().crypto)
    with pytest.raises(StoreError, match="not this store's log key"):
        Store.open(db_url, log_signer=impostor)


def test_appending_needs_the_log_key(db_url, operator) -> None:
    with pytest.raises(StoreError, match="log_signer"):
        Store.open(db_url).trust_key(operator.public_key())


def test_concurrent_writers_keep_the_log_gapless(store, db_url, operator, log_signer) -> None:
    errors: list[BaseException] = []

    def writer(first: int) -> None:
        try:
            with Store.open(db_url, log_signer=log_signer) as mine:
                append_synthetic(mine, operator, 15, start=first)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(k * 100,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [e.idx for e in store.iter_entries()] == list(range(46))
    # The first store's cached frontier is stale now; its next append must notice and still be right.
    store.append_receipt(synthetic_envelope(operator, 999))
    report = verify_log(store, verifiers=[log_signer.verifier()])
    assert report.size == 47 and report.checkpoints == 47
