"""Rows planted with a plain INSERT must never be ratified by the next append: the writer trusts only key
entries proven under its own signed checkpoint, and refuses to extend a head that its latest signed
checkpoint does not cover. The insert guards (migration 0002) refuse these rows from the writer role; the
tests drop them first, as the owner can, to show that the append does not rely on them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from receipts import keys, merkle
from receipts.errors import TamperError, VerificationError
from receipts.keylog import trust_record
from receipts.store import Store
from receipts.subtrees import SqlSubtrees
from receipts.testing import append_synthetic, synthetic_envelope


def _plant_signer_key(raw, key: keys.VerifyingKey, at_idx: int) -> None:
    raw.execute(
        "INSERT INTO signer_keys (keyid, algorithm, public_pem, note, trusted_at_idx) "
        "VALUES (:keyid, :algorithm, :pem, 'planted', :at)",
        keyid=key.keyid,
        algorithm=key.algorithm,
        pem=key.public_pem().decode(),
        at=at_idx,
    )


def test_a_signer_key_row_planted_by_insert_does_not_let_its_key_append(
    store, db_url, raw, operator, log_signer
) -> None:
    append_synthetic(store, operator, 1)  # index 1: a receipt row the planted key row can point at
    attacker = keys.generate("ed25519")
    raw.drop_insert_guards()
    _plant_signer_key(raw, attacker.public_key(), 1)
    before = raw.counts()["log_entries"]
    # A fresh process, as `qualify receipts import` would be: nothing cached from before the plant.
    with Store.open(db_url, log_signer=log_signer) as fresh:
        with pytest.raises(VerificationError, match="not by a trusted key"):
            fresh.append_receipt(synthetic_envelope(attacker, 7))
        assert attacker.keyid not in fresh.trusted_keys()
    assert raw.counts()["log_entries"] == before


def _plant_key_trust_entry(db_url: str, key: keys.VerifyingKey) -> int:
    """Insert a key-trust log entry at the next index with the Merkle subtrees it completes, all
    consistent, but with no checkpoint (the planter does not hold the log key)."""
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            idx = conn.execute(sa.text("SELECT max(idx) + 1 FROM log_entries")).scalar_one()
            data = trust_record(key, "planted", datetime.now(UTC))
            leaf = merkle.leaf_hash(data)
            conn.execute(
                sa.text(
                    "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
                    "VALUES (:idx, 'key-trust', :data, :leaf, :now)"
                ),
                {"idx": idx, "data": data, "leaf": leaf, "now": datetime.now(UTC).replace(tzinfo=None)},
            )
            for level, index, digest in merkle.new_subtrees(idx, leaf, SqlSubtrees(conn)):
                conn.execute(
                    sa.text("INSERT INTO merkle_nodes (level, node_index, hash) VALUES (:l, :i, :h)"),
                    {"l": level, "i": index, "h": digest},
                )
    finally:
        engine.dispose()
    return idx


@pytest.mark.parametrize("same_process", [True, False])
def test_an_entry_planted_at_the_head_is_never_covered_by_a_signed_checkpoint(
    store, db_url, raw, operator, log_signer, same_process
) -> None:
    append_synthetic(store, operator, 2)
    attacker = keys.generate("ed25519")
    raw.drop_insert_guards()
    planted = _plant_key_trust_entry(db_url, attacker.public_key())
    checkpoints = raw.counts()["checkpoints"]
    writer = store if same_process else Store.open(db_url, log_signer=log_signer)
    try:
        for envelope in (synthetic_envelope(attacker, 1), synthetic_envelope(operator, 99)):
            with pytest.raises(TamperError, match=f"latest signed checkpoint is of size {planted}"):
                writer.append_receipt(envelope)
    finally:
        if not same_process:
            writer.close()
    assert raw.counts()["checkpoints"] == checkpoints
    assert raw.scalar("SELECT max(size) FROM checkpoints") == planted


def test_a_latest_checkpoint_not_signed_by_the_log_key_stops_appends(
    store, raw, operator, db_url, log_signer
) -> None:
    append_synthetic(store, operator, 2)
    raw.drop_triggers()
    note = raw.scalar("SELECT note FROM checkpoints WHERE size = 3")
    assert isinstance(note, str)
    raw.execute("UPDATE checkpoints SET note = :n WHERE size = 3", n=note.replace("\n\n— ", "\n\n— x", 1))
    with Store.open(db_url, log_signer=log_signer) as fresh, pytest.raises(TamperError, match="log key"):
        fresh.append_receipt(synthetic_envelope(operator, 5))
    assert raw.scalar("SELECT count(*) FROM log_entries") == 3


def test_a_key_trust_entry_edited_in_place_is_not_trusted_by_the_writer(
    store, raw, operator, db_url, log_signer
) -> None:
    append_synthetic(store, operator, 1)
    attacker = keys.generate("ed25519")
    raw.drop_triggers()
    data = trust_record(attacker.public_key(), "swapped", datetime.now(UTC))
    raw.execute(
        "UPDATE log_entries SET envelope = :d, leaf_hash = :h WHERE idx = 0",
        d=data,
        h=merkle.leaf_hash(data),
    )
    with Store.open(db_url, log_signer=log_signer) as fresh, pytest.raises(TamperError, match="key entry"):
        fresh.append_receipt(synthetic_envelope(attacker, 5))
