"""Tamper suite, on SQLite and PostgreSQL: the triggers block UPDATE, DELETE, TRUNCATE and REPLACE; and
when a superuser drops them, every rewrite is caught by `qualify log verify --checkpoint FILE` against a
checkpoint exported before the rewrite."""

from __future__ import annotations

import base64
import json

import pytest
import sqlalchemy as sa

from qualify.commands._common import load_log_signer
from receipts import keys, merkle
from receipts.errors import TamperError
from receipts.keys import SigningKey
from receipts.models import APPEND_ONLY_TABLES
from receipts.store import Store
from receipts.testing import synthetic_envelope
from receipts.verify import verify_log
from tests.store.approvals import approval_envelope

# One statement per table that a tamperer would try; each must be refused.
UPDATES = {
    "log_meta": "UPDATE log_meta SET origin = 'evil'",
    "log_entries": "UPDATE log_entries SET kind = 'receipt' WHERE idx = 0",
    "merkle_nodes": "UPDATE merkle_nodes SET hash = hash",
    "checkpoints": "UPDATE checkpoints SET note = 'x'",
    "signer_keys": "UPDATE signer_keys SET note = 'x'",
    "key_revocations": "UPDATE key_revocations SET reason = 'x'",
    "receipts": "UPDATE receipts SET verdict = 'qualified'",
    "receipt_subjects": "UPDATE receipt_subjects SET name = 'x'",
    "approvals": "UPDATE approvals SET decision = 'approved'",
}


def _refused(raw, sql: str) -> None:
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        raw.execute(sql)


def populate(store: Store, operator: SigningKey) -> Store:
    """Key trust, three receipts, a revoked second key, an approval: a row in every table."""
    ids = [store.append_receipt(synthetic_envelope(operator, n)).id for n in range(3)]
    spare = keys.generate()
    store.trust_key(spare.public_key())
    store.revoke_key(spare.keyid, "test")
    store.append_approval(approval_envelope(operator, receipt_ids=ids, reasons=["three receipts"]))
    return store


@pytest.fixture
def populated(store, operator) -> Store:
    return populate(store, operator)


def _store_on(url: str, log_signer, operator) -> Store:
    store = Store.open(url, log_signer=log_signer)
    store.trust_key(operator.public_key())
    return populate(store, operator)


def test_update_and_delete_are_refused_on_every_table(populated, raw) -> None:
    before = raw.counts()
    assert all(before[t] > 0 for t in APPEND_ONLY_TABLES)
    for table in APPEND_ONLY_TABLES:
        _refused(raw, UPDATES[table])
        _refused(raw, f"DELETE FROM {table}")
    assert raw.counts() == before
    verify_log(populated)


def test_postgres_refuses_truncate_even_cascading_and_in_replica_mode(
    pg_url, raw_pg, log_signer, operator
) -> None:
    raw = raw_pg
    _store_on(pg_url, log_signer, operator).close()
    before = raw.counts()
    for table in APPEND_ONLY_TABLES:
        _refused(raw, f"TRUNCATE {table} CASCADE")
    _refused(raw, "SET session_replication_role = replica; DELETE FROM receipts")
    upsert = (
        "INSERT INTO log_meta (id, origin, vkey, created_at) VALUES (1, 'o', 'v', now()) "
        "ON CONFLICT (id) DO UPDATE SET origin = 'evil'"
    )
    # The insert guards judge rows a statement inserted (0004: after the statement); an upsert of the
    # existing row inserts none and is refused by the append-only trigger, with or without them.
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        raw.execute(upsert)
    raw.drop_insert_guards()
    _refused(raw, upsert)
    assert raw.counts() == before


def test_sqlite_refuses_insert_or_replace_and_it_is_the_guard_that_does(
    sqlite_url, raw_sqlite, log_signer, operator
) -> None:
    raw = raw_sqlite
    populated = _store_on(sqlite_url, log_signer, operator)
    raw.drop_insert_guards()  # they would refuse these rows first; the REPLACE guard is what is tested
    before = raw.counts()
    entry = populated.entry(1)
    replace = (
        "INSERT OR REPLACE INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
        "VALUES (1, 'receipt', :env, :leaf, '2025-01-01 00:00:00')"
    )
    params = {"env": b"{}", "leaf": merkle.leaf_hash(b"{}")}
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), raw.engine.begin() as conn:
        conn.execute(sa.text(replace), params)
    # A unique key other than the primary key would let REPLACE delete a row too.
    rid = populated.list_receipts()[0].id
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        raw.execute(
            "INSERT OR REPLACE INTO receipts (id, log_idx, verdict, target, host, started_at, finished_at, "
            "keyid, predicate) VALUES ('x', 1, 'qualified', 'cpu', 'h', '2025-01-01', '2025-01-01', 'k', '')"
        )
    assert raw.counts() == before and populated.entry(1) == entry and populated.get_receipt(rid)
    # Without the INSERT guard, REPLACE deletes silently although the DELETE trigger is still there.
    raw.execute("DROP TRIGGER log_entries_no_replace")
    with raw.engine.begin() as conn:
        conn.execute(sa.text(replace), params)
    assert populated.entry(1).envelope == b"{}"


# ------------------------------------------------------------------ with the triggers dropped


@pytest.fixture
def cli_log(cli, home, db_url, raw):
    """A log made through the CLI, its checkpoint exported to a file, then the triggers dropped."""
    operator_key = home / "operator.key"
    assert cli("keys", "generate", "--out", operator_key, "--db", db_url).code == 0
    key = SigningKey.load(operator_key)
    envelopes = home / "in.jsonl"
    envelopes.write_text("".join(json.dumps(synthetic_envelope(key, n)) + "\n" for n in range(6)))
    assert cli("receipts", "import", envelopes, "--db", db_url).code == 0
    checkpoint = home / "checkpoint.txt"
    assert cli("log", "checkpoint", "--out", checkpoint, "--db", db_url).code == 0
    assert cli("log", "verify", "--checkpoint", checkpoint, "--db", db_url).code == 0
    raw.drop_triggers()
    return {"key": key, "checkpoint": checkpoint, "url": db_url}


def _caught(cli, cli_log, index: int | None) -> str:
    result = cli("log", "verify", "--checkpoint", cli_log["checkpoint"], "--db", cli_log["url"])
    assert result.code == 1, result.out + result.err
    first = result.err.splitlines()[0]
    assert first.startswith("error: log verification failed")
    if index is not None:
        assert f"at index {index}:" in first, first
    return first


def _edited(envelope: bytes) -> bytes:
    doc = json.loads(envelope)
    statement = json.loads(base64.b64decode(doc["payload"]))
    statement["predicate"]["host"]["hostname"] = "somewhere-else"
    doc["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    return json.dumps(doc).encode()


def test_an_edited_envelope_is_caught(cli, cli_log, raw) -> None:
    raw.execute("UPDATE log_entries SET envelope = :e WHERE idx = 3", e=_edited(_envelope(raw, 3)))
    assert "leaf hash" in _caught(cli, cli_log, 3)


def test_an_edited_envelope_with_a_recomputed_leaf_hash_is_caught(cli, cli_log, raw) -> None:
    data = _edited(_envelope(raw, 3))
    raw.execute(
        "UPDATE log_entries SET envelope = :e, leaf_hash = :h WHERE idx = 3", e=data, h=merkle.leaf_hash(data)
    )
    _caught(cli, cli_log, 3)


def test_a_deleted_row_is_caught(cli, cli_log, raw) -> None:
    rid = raw.scalar("SELECT id FROM receipts WHERE log_idx = 2")
    raw.execute("DELETE FROM receipt_subjects WHERE receipt_id = :r", r=rid)
    raw.execute("DELETE FROM receipts WHERE log_idx = 2")
    raw.execute("DELETE FROM log_entries WHERE idx = 2")
    assert "missing" in _caught(cli, cli_log, 2)


def test_reordered_rows_are_caught(cli, cli_log, raw) -> None:
    two, five = _row(raw, 2), _row(raw, 5)
    for idx, (data, leaf) in ((2, five), (5, two)):
        raw.execute(
            "UPDATE log_entries SET envelope = :e, leaf_hash = :h WHERE idx = :i", e=data, h=leaf, i=idx
        )
    _caught(cli, cli_log, 2)


def test_truncate_and_reinsert_with_the_log_key_is_caught_only_by_the_external_checkpoint(
    cli, cli_log, raw, home
) -> None:
    """The strongest rewrite: whoever holds the log key rebuilds a self-consistent log without one receipt.
    Every stored hash and signature checks out; only the checkpoint kept elsewhere proves the rewrite."""
    envelopes = [json.loads(_envelope(raw, i)) for i in range(1, 7)]
    origin = raw.scalar("SELECT origin FROM log_meta")  # the rebuilt log keeps the log's own origin
    tables = ", ".join(APPEND_ONLY_TABLES)
    if raw.dialect == "postgresql":
        raw.execute(f"TRUNCATE {tables}")
    else:
        for table in reversed(APPEND_ONLY_TABLES):
            raw.execute(f"DELETE FROM {table}")
    with Store.open(cli_log["url"], log_signer=load_log_signer(create=False), origin=origin) as rebuilt:
        rebuilt.trust_key(cli_log["key"].public_key())
        rebuilt.append_receipts(envelopes[:3] + envelopes[4:])
    assert cli("log", "verify", "--db", cli_log["url"]).code == 0  # self-consistent without the checkpoint
    message = _caught(cli, cli_log, None)
    assert "external checkpoint" in message


def test_junk_in_an_entry_is_caught_by_the_library_without_any_checkpoint(cli_log, raw) -> None:
    raw.execute("UPDATE log_entries SET envelope = :e WHERE idx = 4", e=b"{}")
    with Store.open(cli_log["url"]) as store, pytest.raises(TamperError, match="at index 4") as caught:
        verify_log(store)
    report = caught.value.report
    assert not report.ok and report.first_problem().idx == 4


def _row(raw, idx: int) -> tuple[bytes, bytes]:
    with raw.engine.connect() as conn:
        data, leaf = conn.execute(
            sa.text("SELECT envelope, leaf_hash FROM log_entries WHERE idx = :i"), {"i": idx}
        ).one()
    return bytes(data), bytes(leaf)


def _envelope(raw, idx: int) -> bytes:
    return _row(raw, idx)[0]
