"""PostgreSQL's insert guards are statement-level since migration 0004: each guarded table's rows are
judged together, after the statement, in set queries. A writer who puts the bad row among good ones in
one multi-row INSERT (as the sequencer writes its batches) is refused as before, by the rule it breaks,
and nothing of the statement stays."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from receipts import merkle
from receipts.keylog import trust_record
from receipts.store import Store
from receipts.subtrees import SqlSubtrees
from receipts.testing import append_synthetic, synthetic_envelope

NOW = datetime(2026, 1, 1, tzinfo=UTC).replace(tzinfo=None)
ENTRY = "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) VALUES (:n, :k, :e, :h, :t)"
NODE = "INSERT INTO merkle_nodes (level, node_index, hash) VALUES (:l, :i, :h)"


@pytest.fixture
def pg(pg_url, log_signer, operator, raw_pg):  # type: ignore[no-untyped-def]
    with Store.open(pg_url, log_signer=log_signer) as store:
        store.trust_key(operator.public_key(), "test operator")
        append_synthetic(store, operator, 2)
        yield store, raw_pg


def _writer(raw, steps) -> None:  # type: ignore[no-untyped-def]
    """One transaction as the writer role: `steps` is a list of (sql, list of parameter dicts)."""
    with raw.engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL ROLE qualify_writer"))
        for sql, rows in steps:
            conn.execute(sa.text(sql), rows)


def _entry(n: int, data: bytes, kind: str = "receipt", leaf: bytes | None = None) -> dict[str, object]:
    return {"n": n, "k": kind, "e": data, "h": merkle.leaf_hash(data) if leaf is None else leaf, "t": NOW}


def _refused(raw, steps, match: str) -> None:  # type: ignore[no-untyped-def]
    before = raw.counts()
    with pytest.raises(sa.exc.DBAPIError, match=match):
        _writer(raw, steps)
    assert raw.counts() == before


def test_entries_with_a_gap_inside_one_statement_are_refused(pg) -> None:  # type: ignore[no-untyped-def]
    store, raw = pg
    n = store.size()
    rows = [_entry(n, b"a"), _entry(n + 2, b"b")]
    _refused(raw, [(ENTRY, rows)], "are not the next ones")
    _refused(raw, [(ENTRY, [_entry(n + 1, b"a"), _entry(n + 2, b"b")])], "are not the next ones")


def test_one_wrong_leaf_hash_among_good_entries_is_refused(pg) -> None:  # type: ignore[no-untyped-def]
    store, raw = pg
    n = store.size()
    rows = [_entry(n, b"a"), _entry(n + 1, b"b", leaf=bytes(32)), _entry(n + 2, b"c")]
    _refused(raw, [(ENTRY, rows)], f"the leaf hash of entry {n + 1} is not the hash of its bytes")


def test_good_entries_without_their_checkpoint_are_refused_at_commit(pg) -> None:  # type: ignore[no-untyped-def]
    store, raw = pg
    n = store.size()
    _refused(raw, [(ENTRY, [_entry(n, b"a"), _entry(n + 1, b"b")])], "has no checkpoint in its transaction")


def _nodes(raw, n: int, leaf: bytes) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    with raw.engine.connect() as conn:
        return [{"l": lv, "i": ix, "h": h} for lv, ix, h in merkle.new_subtrees(n, leaf, SqlSubtrees(conn))]


def test_merkle_rows_are_judged_as_a_set(pg) -> None:  # type: ignore[no-untyped-def]
    store, raw = pg
    n = store.size()
    assert n % 2 == 1, "entry n completes an inner node"
    data = b"planted"
    nodes = _nodes(raw, n, merkle.leaf_hash(data))
    assert [r["l"] for r in nodes][:2] == [0, 1]
    entry = (ENTRY, [_entry(n, data)])
    inner = [nodes[0], {**nodes[1], "h": bytes(32)}, *nodes[2:]]
    _refused(raw, [entry, (NODE, inner)], "is not the hash of its children")
    leaf = [{**nodes[0], "h": bytes(32)}, *nodes[1:]]
    _refused(raw, [entry, (NODE, leaf)], f"leaf {n} is not the leaf hash of its entry")
    _refused(
        raw, [entry, (NODE, [*nodes, {"l": 63, "i": 0, "h": bytes(32)}])], "level 63 is not a tree level"
    )
    sealed = {"l": 0, "i": -1, "h": bytes(32)}  # ends before the latest checkpoint's size
    _refused(raw, [entry, (NODE, [*nodes, sealed])], "which is not one being appended")


def test_query_rows_must_be_of_an_entry_being_appended_and_say_what_it_says(pg, operator) -> None:  # type: ignore[no-untyped-def]
    store, raw = pg
    n = store.size()
    data = b'{"not":"a receipt"}'
    entry = (ENTRY, [_entry(n, data)])
    receipt = (
        "INSERT INTO receipts (id, log_idx, verdict, target, host, started_at, finished_at, keyid, "
        "predicate) VALUES (:id, :i, 'qualified', 'cpu', 'h', :t, :t, 'k', '{}')"
    )
    right = hashlib.sha256(data).hexdigest()
    _refused(
        raw, [entry, (receipt, [{"id": "0" * 64, "i": n, "t": NOW}])], f"row {'0' * 64} is not entry {n}"
    )
    sealed = {"id": right, "i": 0, "t": NOW}  # the right id, but at an entry already sealed (a key's)
    _refused(raw, [entry, (receipt, [sealed])], "is not entry 0 being appended")
    approval = (
        "INSERT INTO approvals (id, log_idx, subject, decision, policy_digest, receipt_ids, reasons, keyid, "
        "created_at) VALUES (:id, :i, 's', 'approved', 'p', '[]', '[]', 'k', :t)"
    )
    _refused(raw, [entry, (approval, [{"id": right, "i": n, "t": NOW}])], "is not entry")  # kind receipt
    old = store.list_receipts(limit=1)[0].id  # a sealed receipt
    subject = "INSERT INTO receipt_subjects (receipt_id, digest, name) VALUES (:r, 'sha256:00', 'x')"
    _refused(raw, [(subject, [{"r": old}])], f"receipt {old} is not one being appended")


def test_a_signer_key_row_must_say_what_its_key_trust_entry_says(pg) -> None:  # type: ignore[no-untyped-def]
    from receipts import keys

    store, raw = pg
    n = store.size()
    key = keys.generate("ed25519").public_key()
    record = trust_record(key, "the note", NOW.replace(tzinfo=UTC))
    entry = (ENTRY, [_entry(n, record, kind="key-trust")])
    row = {
        "k": key.keyid,
        "a": key.algorithm,
        "p": key.public_pem().decode("ascii"),
        "note": "the note",
        "i": n,
    }
    insert = (
        "INSERT INTO signer_keys (keyid, algorithm, public_pem, note, trusted_at_idx) "
        "VALUES (:k, :a, :p, :note, :i)"
    )
    _refused(raw, [entry, (insert, [{**row, "note": "another note"}])], "is not what key-trust entry")
    _refused(raw, [entry, (insert, [{**row, "a": "rsa"}])], "is not what key-trust entry")
    # The honest rows still pass the key rule (the commit is then refused: no checkpoint seals the entry).
    _refused(raw, [entry, (insert, [row])], "has no checkpoint in its transaction")


def test_the_sequencers_batches_still_pass_and_the_log_verifies(pg, operator) -> None:  # type: ignore[no-untyped-def]
    from receipts import dsse, sequencer
    from receipts.verify import verify_log

    store, raw = pg
    before = store.size()
    items = [("receipt", dsse.envelope_bytes(synthetic_envelope(operator, 100 + i))) for i in range(40)]
    with Store.open(store.engine.url.render_as_string(hide_password=False)) as host:
        sequencer.submit_many(host, items)
    done = sequencer.integrate(store)
    assert (done.integrated, done.refused) == (40, 0)
    assert store.size() == before + 40 and verify_log(store).ok
    assert raw.scalar("SELECT count(*) FROM checkpoints WHERE size > :s", s=before) == 1
