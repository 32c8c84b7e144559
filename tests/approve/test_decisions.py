"""Rollout decisions over a real store: every policy feature approves and denies, and only receipts that
verify (signature, inclusion under the signed checkpoint, signed subject) count."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.approve import APPROVAL_PREDICATE_TYPE, decide, record
from qualify.errors import UsageError
from qualify.policy import parse_policy_text
from receipts import dsse, keys
from receipts.checkpoint import Checkpoint, NoteSigner, sign_checkpoint

from .conftest import OTHER_SUBJECT, SUBJECT, Log, statement


def policy(body: str = "", **settings: object):
    settings.setdefault("verdict", "qualified")  # a policy must state a requirement
    head = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    return parse_policy_text(head + body, "toml", "test.toml")


LAYOUT = "[conditions]\nlayout = 'receipt.layout.spans == [2304, 2304, 2304, 9216]'\n"
RESTARTS = "[conditions]\nno-restarts = 'receipt.faults.restart_count == 0'\n"
XID = "[conditions]\nno-fatal-xid = 'receipt.faults.xid_events.all(x, !x.fatal)'\n"
BACKEND = '[conditions]\nbackend = \'receipt.backend.resolved in ["triton", "b12x"]\'\n'


def test_a_verified_qualified_receipt_is_approved_and_relied_on(log: Log) -> None:
    rid = log.add()
    decision = decide(log.store, policy(), SUBJECT)
    assert decision.decision == "approved" and decision.exit_code == 0
    assert decision.receipt_ids == [rid] and decision.hosts == ["node-a"]
    assert decision.tree_size == log.store.size()
    assert decision.reasons == []


def test_no_receipts_is_a_denial_that_says_so(log: Log) -> None:
    log.add(subject=OTHER_SUBJECT)
    decision = decide(log.store, policy(), SUBJECT)
    assert decision.decision == "denied" and decision.exit_code == 1
    assert decision.reasons == [f"no receipts about subject {SUBJECT} in the log"]


def test_required_verdict_denies_a_rejected_receipt(log: Log) -> None:
    rid = log.add(verdict="rejected", failed_check="layout")
    decision = decide(log.store, policy(verdict="qualified"), SUBJECT)
    assert decision.decision == "denied"
    assert any(
        r.startswith(f"receipt {rid[:12]} (log #") and "verdict is rejected" in r for r in decision.reasons
    )
    # A policy may ask for the rejected verdict (e.g. to confirm a known-bad build was caught).
    assert decide(log.store, policy(verdict="rejected"), SUBJECT).decision == "approved"


@pytest.mark.parametrize(
    ("conditions", "good", "bad", "condition"),
    [
        (LAYOUT, {}, {"spans": [2304, 2304, 9216]}, "layout"),
        (RESTARTS, {"restarts": 0}, {"restarts": 2}, "no-restarts"),
        (XID, {"xids": [(13, False), (43, False)]}, {"xids": [(13, False), (79, True)]}, "no-fatal-xid"),
        (BACKEND, {"backend": "b12x"}, {"backend": "torch"}, "backend"),
    ],
)
def test_cel_conditions_approve_the_good_receipt_and_name_the_one_that_fails(
    make_log: Callable[[], Log], conditions: str, good: dict, bad: dict, condition: str
) -> None:
    ok = make_log()
    ok.add(**good)
    assert decide(ok.store, policy(conditions), SUBJECT).decision == "approved"

    failing = make_log()
    rid = failing.add(host="node-z", **bad)
    decision = decide(failing.store, policy(conditions), SUBJECT)
    assert decision.decision == "denied"
    failure = [r for r in decision.reasons if rid[:12] in r and "condition" in r]
    assert len(failure) == 1
    assert f"(log #1, node-z): condition {condition!r} is false" in failure[0]
    assert decision.evaluations[0].counted is False


def test_every_failed_condition_of_every_receipt_is_reported(log: Log) -> None:
    first = log.add(host="a", restarts=1, backend="torch")
    second = log.add(host="b", xids=[(79, True)])
    loaded = policy(
        "[conditions]\nno-restarts = 'receipt.faults.restart_count == 0'\n"
        "backend = 'receipt.backend.resolved == \"triton\"'\n"
        "no-fatal-xid = 'receipt.faults.xid_events.all(x, !x.fatal)'\n"
    )
    decision = decide(log.store, loaded, SUBJECT)
    failures = {  # both receipts are also rejected by their faults: the conditions name why on their own
        (e.receipt_id, f.split(" is ")[0])
        for e in decision.evaluations
        for f in e.failures
        if "condition" in f
    }
    assert failures == {
        (first, "condition 'no-restarts'"),
        (first, "condition 'backend'"),
        (second, "condition 'no-fatal-xid'"),
    }
    assert decision.reasons[0].startswith("0 qualifying receipt(s) from 0 distinct host(s)")


def test_expired_receipts_do_not_count(log: Log) -> None:
    old = log.add(finished=datetime.now(UTC) - timedelta(days=10))
    decision = decide(log.store, policy(max_age="7d"), SUBJECT)
    assert decision.decision == "denied"
    assert any(old[:12] in r and "expired" in r and "max_age 7d" in r for r in decision.reasons)
    assert decide(log.store, policy(max_age="14d"), SUBJECT).decision == "approved"
    # The clock is the decision's: the same receipt was fresh when it was 8 days younger.
    earlier = datetime.now(UTC) - timedelta(days=8)
    assert decide(log.store, policy(max_age="7d"), SUBJECT, now=earlier).decision == "approved"


def test_distinct_hosts_are_counted_not_receipts(log: Log) -> None:
    log.add(host="node-a")
    log.add(host="node-a")
    log.add(host="node-b", verdict="rejected", failed_check="boot")
    decision = decide(log.store, policy(min_hosts=2), SUBJECT)
    assert decision.decision == "denied"
    assert decision.reasons[0] == (
        "2 qualifying receipt(s) from 1 distinct host(s) (node-a); the policy needs 2"
    )
    log.add(host="node-b")
    decision = decide(log.store, policy(min_hosts=2), SUBJECT)
    assert decision.decision == "approved"
    assert decision.hosts == ["node-a", "node-b"] and len(decision.receipt_ids) == 3


def test_trusted_keyids_limit_which_signers_count(log: Log) -> None:
    other = keys.generate("p256")
    log.store.trust_key(other.public_key(), "second operator")
    theirs = log.add(key=other)
    decision = decide(log.store, policy(trusted_keyids=[log.key.keyid]), SUBJECT)
    assert decision.decision == "denied"
    assert any(theirs[:12] in r and "which the policy does not trust" in r for r in decision.reasons)
    assert decide(log.store, policy(trusted_keyids=[other.keyid]), SUBJECT).decision == "approved"


def test_warn_mode_reports_every_reason_but_does_not_block(log: Log) -> None:
    log.add(restarts=3)
    decision = decide(log.store, policy(RESTARTS, mode="warn"), SUBJECT)
    assert decision.decision == "warn" and decision.exit_code == 0
    assert any("no-restarts" in r for r in decision.reasons)
    recorded = record(log.store, decision, policy(RESTARTS, mode="warn"), log.key)
    assert log.store.get_approval(recorded.approval_id).decision == "warn"


def test_a_tampered_receipt_counts_for_nothing(log: Log) -> None:
    log.add(host="node-a")
    tampered = log.add(host="node-b")
    assert decide(log.store, policy(min_hosts=2), SUBJECT).decision == "approved"
    entry = log.store.entry(1 + 1)  # idx 0 trusts the key, 1 and 2 are the receipts
    edited = entry.envelope.replace(b'"payload":"', b'"payload":"X', 1)
    log.raw("UPDATE log_entries SET envelope = ? WHERE idx = ?", edited, entry.idx)
    decision = decide(log.store, policy(min_hosts=2), SUBJECT)
    assert decision.decision == "denied"
    assert tampered not in decision.receipt_ids
    assert any(
        tampered[:12] in r and "does not verify, so it counts for nothing" in r for r in decision.ignored
    )


def test_a_resigned_receipt_with_recomputed_hashes_fails_inclusion(log: Log) -> None:
    # The attacker rewrites a rejected receipt as qualified, signs it with a trusted key, and fixes the
    # row's id and leaf hash; the signed checkpoint still commits to the original bytes.
    from receipts import merkle
    from receipts.canonical import canonical_json

    from .approve_predicates import predicate

    rid = log.add(verdict="rejected", failed_check="layout")
    forged = dsse.envelope_bytes(
        dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement(SUBJECT, predicate())), log.key)
    )
    log.raw(
        "UPDATE log_entries SET envelope = ?, leaf_hash = ? WHERE idx = 1", forged, merkle.leaf_hash(forged)
    )
    import hashlib

    new_id = hashlib.sha256(forged).hexdigest()
    log.raw("UPDATE receipt_subjects SET receipt_id = ? WHERE receipt_id = ?", new_id, rid)
    log.raw("UPDATE receipts SET id = ?, verdict = 'qualified' WHERE id = ?", new_id, rid)
    decision = decide(log.store, policy(), SUBJECT)
    assert decision.decision == "denied"
    assert "does not verify" in decision.evaluations[0].failures[0]
    assert (
        "inclusion" in decision.evaluations[0].failures[0] or "proof" in decision.evaluations[0].failures[0]
    )


def test_an_edited_query_row_is_judged_by_its_signed_bytes(log: Log) -> None:
    rid = log.add(restarts=4)
    row = json.dumps({"faults": {"restart_count": 0}})
    log.raw("UPDATE receipts SET predicate = ?, host = 'forged' WHERE id = ?", row, rid)
    decision = decide(log.store, policy(RESTARTS), SUBJECT)
    assert decision.decision == "denied"
    assert decision.evaluations[0].host == "node-a"
    assert any("no-restarts" in f for f in decision.evaluations[0].failures)


def test_a_receipt_moved_to_another_subject_in_the_query_table_does_not_count(log: Log) -> None:
    rid = log.add(subject=OTHER_SUBJECT)
    log.raw(
        "UPDATE receipt_subjects SET digest = ? WHERE receipt_id = ? AND digest = ?",
        SUBJECT,
        rid,
        OTHER_SUBJECT,
    )
    decision = decide(log.store, policy(), SUBJECT)
    assert decision.decision == "denied"
    assert "signed subjects do not include" in decision.evaluations[0].failures[0]


def test_a_forged_checkpoint_makes_no_receipt_count(log: Log) -> None:
    log.add()
    size = log.store.size()
    forger = NoteSigner("qualify.test/log", Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint("qualify.test/log", size, log.store.root()), forger)
    log.raw("UPDATE checkpoints SET note = ? WHERE size = ?", note, size)
    decision = decide(log.store, policy(), SUBJECT)
    assert decision.decision == "denied"
    assert "does not verify" in decision.evaluations[0].failures[0]


def test_recorded_approval_is_a_signed_statement_in_the_log(log: Log) -> None:
    rid = log.add()
    loaded = policy(LAYOUT, name="fleet")
    decision = record(log.store, decide(log.store, loaded, SUBJECT), loaded, log.key)
    assert decision.log_index == log.store.size() - 1
    stored = log.store.get_approval(decision.approval_id)
    assert (stored.subject, stored.decision, stored.receipt_ids) == (SUBJECT, "approved", [rid])
    assert stored.policy_digest == loaded.digest
    entry = log.store.entry(decision.log_index)
    assert entry.kind == "approval"
    payload = dsse.verify(entry.envelope, [log.key.public_key()])
    statement = json.loads(payload)
    assert statement["predicateType"] == APPROVAL_PREDICATE_TYPE
    assert statement["subject"][0]["digest"] == {"sha256": SUBJECT.removeprefix("sha256:")}
    assert statement["predicate"]["policy"]["conditions"]["layout"].startswith("receipt.layout.spans")
    assert statement["predicate"]["receipt_ids"] == [rid]


def test_a_denial_is_recorded_with_every_reason(log: Log) -> None:
    log.add(restarts=1)
    loaded = policy(RESTARTS)
    decision = record(log.store, decide(log.store, loaded, SUBJECT), loaded, log.key)
    stored = log.store.get_approval(decision.approval_id)
    assert stored.decision == "denied" and stored.receipt_ids == []
    assert stored.reasons == decision.reasons and len(stored.reasons) == 3  # hosts, verdict, condition


def test_a_subject_that_is_not_a_digest_is_bad_input(log: Log) -> None:
    with pytest.raises(UsageError, match="not a digest"):
        decide(log.store, policy(), "latest")


@pytest.mark.postgres
def test_decide_and_record_on_postgresql(pg_url: str, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from qualify.api import create_app
    from receipts.store import Store

    store = Store.open(pg_url, log_signer=NoteSigner("qualify.test/pg", Ed25519PrivateKey.generate()))
    try:
        key = keys.generate()
        store.trust_key(key.public_key(), "operator")
        log = Log(
            store=store, url=pg_url, path=tmp_path / "unused", key=key, key_path=tmp_path / "unused.key"
        )
        log.add(host="pg-a")
        log.add(host="pg-b", restarts=1)
        loaded = policy(RESTARTS, min_hosts=2)
        denied = record(store, decide(store, loaded, SUBJECT), loaded, key)
        assert denied.decision == "denied" and any("pg-b" in r for r in denied.reasons)
        log.add(host="pg-c")
        approved = record(store, decide(store, loaded, SUBJECT), loaded, key)
        assert approved.decision == "approved" and approved.hosts == ["pg-a", "pg-c"]
        listed = TestClient(create_app(store)).get("/v1/approvals", params={"subject": SUBJECT}).json()
        assert [a["decision"] for a in listed["items"]] == ["approved", "denied"]  # newest first
    finally:
        store.close()


def test_a_signed_approval_planted_as_a_receipt_does_not_count(log: Log) -> None:
    # A signed, included statement about the subject, but an approval: rows planted with plain INSERTs
    # list it among the subject's receipts. It must count for nothing, saying why.
    loaded = policy()
    approval = record(log.store, decide(log.store, loaded, SUBJECT), loaded, log.key)
    log.raw(
        "INSERT INTO receipts "
        "(id, log_idx, verdict, target, host, started_at, finished_at, keyid, predicate) "
        "VALUES (?, ?, 'qualified', 'cpu', 'h', "
        "'2025-01-01 00:00:00.000000', '2025-01-01 00:01:00.000000', ?, '{}')",
        approval.approval_id,
        approval.log_index,
        log.key.keyid,
    )
    log.raw(
        "INSERT INTO receipt_subjects (receipt_id, digest, name) VALUES (?, ?, 'engine-image')",
        approval.approval_id,
        SUBJECT,
    )
    decision = decide(log.store, loaded, SUBJECT)
    assert decision.decision == "denied" and decision.receipt_ids == []
    [evaluation] = decision.evaluations
    assert evaluation.failures == [
        "does not verify, so it counts for nothing: it is not a qualification receipt "
        f"(predicateType {APPROVAL_PREDICATE_TYPE!r})"
    ]
