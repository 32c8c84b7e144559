"""Whole-log verification: the tree rebuilt from stored bytes, slices checked in worker processes, and
each kind of damage reported at the first bad index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from receipts import keys, logscan, merkle
from receipts.checkpoint import Checkpoint, NoteSigner, sign_checkpoint
from receipts.errors import TamperError
from receipts.testing import append_synthetic
from receipts.verify import Rebuilt, verify_log


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=70))
def test_rebuilt_tree_matches_the_rfc_9162_definition(n: int) -> None:
    leaves = [merkle.leaf_hash(bytes([i % 256, i // 256])) for i in range(n)]
    tree = Rebuilt()
    for leaf in leaves:
        tree.append(leaf)
    for size in range(1, n + 1):
        assert tree.root(size) == merkle.root_hash(leaves[:size])
    assert merkle.consistency_proof_from(tree, n // 2, n) == merkle.consistency_proof(leaves, n // 2)


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 8 entries, so a small log spans many slices and upper subtree levels."""
    monkeypatch.setattr(logscan, "SLICE_LEVEL", 3)
    monkeypatch.setattr(logscan, "SLICE", 8)


def test_worker_processes_and_inline_checks_agree(store, operator, log_signer, small_slices) -> None:
    append_synthetic(store, operator, 40, batch=10)
    inline = verify_log(store, verifiers=[log_signer.verifier()], workers=0)
    parallel = verify_log(store, verifiers=[log_signer.verifier()], log_signer=log_signer, workers=2)
    for report in (inline, parallel):
        assert report.ok and report.size == 41 and report.checkpoints == 41
        assert report.subtrees == sum(41 >> level for level in range((41).bit_length()))
        assert report.kinds == {"key-trust": 1, "receipt": 40}
    assert inline.root == parallel.root == store.root()


def test_damage_in_a_later_slice_names_its_index(store, operator, raw, small_slices) -> None:
    append_synthetic(store, operator, 30, batch=10)
    raw.drop_triggers()
    raw.execute("UPDATE merkle_nodes SET hash = :h WHERE level = 1 AND node_index = 11", h=b"\0" * 32)
    with pytest.raises(TamperError, match="at index 22: stored Merkle subtree"):
        verify_log(store, workers=2)


def test_a_deleted_checkpoint_is_reported(store, operator, raw) -> None:
    append_synthetic(store, operator, 5)
    raw.drop_triggers()
    raw.execute("DELETE FROM checkpoints WHERE size = 3")
    # Checkpoints come one per append (a batch, for the sequencer): entry 2 now seems sealed by the
    # checkpoint of size 4, whose time is not its append's.
    with pytest.raises(TamperError, match="index 2: .* not that of the checkpoint of size 4"):
        verify_log(store)


def test_a_deleted_last_checkpoint_is_reported(store, operator, raw) -> None:
    append_synthetic(store, operator, 5)
    raw.drop_triggers()
    raw.execute("DELETE FROM checkpoints WHERE size = 6")  # the trusted key, then 5 receipts
    with pytest.raises(TamperError, match="index 5: the checkpoint of size 6, where the log ends"):
        verify_log(store)


def test_a_checkpoint_signed_by_another_key_is_reported(store, operator, raw, log_signer) -> None:
    append_synthetic(store, operator, 3)
    raw.drop_triggers()
    other = NoteSigner(log_signer.name, keys.generate().crypto)
    note = sign_checkpoint(Checkpoint(log_signer.name, 2, store.root(2)), other)
    raw.execute("UPDATE checkpoints SET note = :n WHERE size = 2", n=note)
    with pytest.raises(TamperError, match="index 1: the checkpoint note of size 2 does not verify"):
        verify_log(store, verifiers=[log_signer.verifier()])


def test_a_replaced_log_key_in_the_store_is_reported(store, operator, raw, log_signer) -> None:
    append_synthetic(store, operator, 2)
    raw.drop_triggers()
    raw.execute("UPDATE log_meta SET vkey = :v", v=NoteSigner(log_signer.name, keys.generate().crypto).vkey())
    with pytest.raises(TamperError, match="is not the trusted log key"):
        verify_log(store, verifiers=[log_signer.verifier()])


def test_an_external_checkpoint_larger_than_the_log_means_entries_were_removed(
    store, operator, log_signer
) -> None:
    append_synthetic(store, operator, 3)
    ahead = sign_checkpoint(Checkpoint(log_signer.name, 9, b"\1" * 32), log_signer)
    with pytest.raises(TamperError, match="covers 9 entries but the log holds 4"):
        verify_log(store, checkpoint_text=ahead, verifiers=[log_signer.verifier()])


def test_removing_the_newest_entries_is_caught_by_the_stored_checkpoints_alone(store, operator, raw) -> None:
    ids = append_synthetic(store, operator, 4)  # log entries 0..4, checkpoints of size 1..5
    raw.drop_triggers()
    for rid in ids[2:]:  # the two newest receipts, with their query rows, as a tamperer would
        raw.execute("DELETE FROM receipt_subjects WHERE receipt_id = :i", i=rid)
        raw.execute("DELETE FROM receipts WHERE id = :i", i=rid)
    raw.execute("DELETE FROM log_entries WHERE idx >= 3")
    with pytest.raises(
        TamperError, match="at index 3: stored checkpoint for size 5 but the log holds 3 entries"
    ) as caught:
        verify_log(store)
    assert caught.value.report.size == 3


def test_a_receipt_hidden_from_the_query_tables_is_reported(store, operator, raw) -> None:
    ids = append_synthetic(store, operator, 3)
    raw.drop_triggers()
    raw.execute("DELETE FROM receipt_subjects WHERE receipt_id = :i", i=ids[1])
    raw.execute("DELETE FROM receipts WHERE id = :i", i=ids[1])
    with pytest.raises(TamperError, match="index 2: the receipts table disagrees"):
        verify_log(store)


def test_rows_planted_beyond_the_end_are_reported_without_walking_the_gap(store, operator, raw) -> None:
    append_synthetic(store, operator, 3)
    raw.drop_triggers()
    raw.execute(
        "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
        "VALUES (1000000000, 'receipt', :e, :h, CURRENT_TIMESTAMP)",
        e=b"{}",
        h=merkle.leaf_hash(b"{}"),
    )
    raw.execute(
        "INSERT INTO checkpoints (size, root, note, created_at) VALUES (99, :r, 'x', CURRENT_TIMESTAMP)",
        r=b"\0" * 32,
    )
    raw.execute("INSERT INTO merkle_nodes (level, node_index, hash) VALUES (5, 7, :h)", h=b"\0" * 32)
    with pytest.raises(TamperError) as caught:
        verify_log(store)
    problems = [str(p) for p in caught.value.report.problems]
    assert caught.value.report.first_problem().idx == 4
    assert any("log indexes are not gapless" in p for p in problems), problems
    assert any("checkpoint(s) lie beyond the end" in p for p in problems)
    assert any("subtree(s) lie beyond the end" in p for p in problems)
