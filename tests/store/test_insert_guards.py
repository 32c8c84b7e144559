"""One INSERT by a `qualify_writer` member cannot stop the log: the insert guards (migration 0002) refuse
a junk head entry, a future checkpoint, a future Merkle node and a query row of another entry. What the
guards cannot judge (a checkpoint's signature) stops appends with a line naming the rows, and the owner's
`qualify log repair` removes them, saving them as evidence and recording the repair."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from receipts import merkle
from receipts.errors import TamperError
from receipts.models import SCHEMA_REVISION
from receipts.repair import repair
from receipts.store import Store
from receipts.subtrees import SqlSubtrees
from receipts.testing import append_synthetic, synthetic_envelope
from receipts.verify import verify_log

NOW = datetime(2026, 1, 1, tzinfo=UTC).replace(tzinfo=None)


def _as_writer(raw, sql: str, **params: object) -> None:
    """One transaction as a member of the writer role would run it (SQLite has no roles: as the user)."""
    with raw.engine.begin() as conn:
        if raw.dialect == "postgresql":
            conn.execute(sa.text("SET LOCAL ROLE qualify_writer"))
        conn.execute(sa.text(sql), params)


def _junk_entry(raw, n: int, leaf: bytes | None = None) -> None:
    junk = b'{"junk":true}'
    _as_writer(
        raw,
        "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
        "VALUES (:n, 'receipt', :e, :h, :t)",
        n=n,
        e=junk,
        h=merkle.leaf_hash(junk) if leaf is None else leaf,
        t=NOW,
    )


PLANTS = {
    "a checkpoint beyond the log": lambda raw, n: _as_writer(
        raw,
        "INSERT INTO checkpoints (size, root, note, created_at) VALUES (:s, :r, 'x', :t)",
        s=n + 5,
        r=bytes(32),
        t=NOW,
    ),
    "a Merkle node beyond the log": lambda raw, n: _as_writer(
        raw, "INSERT INTO merkle_nodes (level, node_index, hash) VALUES (0, :i, :h)", i=n, h=bytes(32)
    ),
    "a receipts row of another entry": lambda raw, n: _as_writer(
        raw,
        "INSERT INTO receipts "
        "(id, log_idx, verdict, target, host, started_at, finished_at, keyid, predicate) "
        "VALUES (:id, 0, 'qualified', 'cpu', 'h', :t, :t, 'k', '{}')",
        id="f" * 64,
        t=NOW,
    ),
    "an entry at a gap": lambda raw, n: _junk_entry(raw, n + 3),
    "a signer key row": lambda raw, n: _as_writer(
        raw,
        "INSERT INTO signer_keys (keyid, algorithm, public_pem, note, trusted_at_idx) "
        "VALUES ('ab', 'ed25519', 'pem', 'note', :i)",
        i=n - 1,
    ),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_the_writer_role_cannot_insert_rows_that_would_stop_appends(
    store: Store, operator, raw, plant: str
) -> None:
    append_synthetic(store, operator, 2)
    before = raw.counts()
    with pytest.raises(sa.exc.DBAPIError):
        PLANTS[plant](raw, 3)
    assert raw.counts() == before
    store.append_receipt(synthetic_envelope(operator, 9))  # appends go on
    assert verify_log(store).ok


def test_on_postgresql_a_lone_junk_head_entry_is_refused_at_commit(
    pg_url, log_signer, operator, raw_pg
) -> None:
    with Store.open(pg_url, log_signer=log_signer) as store:
        store.trust_key(operator.public_key())
        with pytest.raises(sa.exc.DBAPIError, match="not the hash of its bytes"):
            _junk_entry(raw_pg, 1, leaf=bytes(32))
        with pytest.raises(sa.exc.DBAPIError, match="has no checkpoint in its transaction"):
            _junk_entry(raw_pg, 1)  # a correct leaf hash, but nothing seals it
        store.append_receipt(synthetic_envelope(operator, 1))
        assert store.size() == 2


def _forged_append(raw, n: int) -> None:
    """What the guards cannot stop: a whole append by the writer role, with a checkpoint whose signature is
    junk (the log key is not the writer's)."""
    data = b'{"planted":true}'
    leaf = merkle.leaf_hash(data)
    with raw.engine.begin() as conn:
        if raw.dialect == "postgresql":
            conn.execute(sa.text("SET LOCAL ROLE qualify_writer"))
        conn.execute(
            sa.text(
                "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
                "VALUES (:n, 'receipt', :e, :h, :t)"
            ),
            {"n": n, "e": data, "h": leaf, "t": NOW},
        )
        reader = SqlSubtrees(conn)
        for level, index, digest in merkle.new_subtrees(n, leaf, reader):
            conn.execute(
                sa.text("INSERT INTO merkle_nodes (level, node_index, hash) VALUES (:l, :i, :h)"),
                {"l": level, "i": index, "h": digest},
            )
        conn.execute(
            sa.text("INSERT INTO checkpoints (size, root, note, created_at) VALUES (:s, :r, 'junk', :t)"),
            {"s": n + 1, "r": bytes(32), "t": NOW},
        )


def test_a_forged_append_stops_appends_by_name_until_the_owner_repairs(
    store: Store, operator, raw, log_signer, tmp_path
) -> None:
    append_synthetic(store, operator, 2)
    good = store.latest_checkpoint()
    _forged_append(raw, 3)
    with pytest.raises(TamperError) as caught:
        store.append_receipt(synthetic_envelope(operator, 9))
    message = str(caught.value)
    assert "the latest checkpoint (size 4) does not verify with the log key" in message
    assert "qualify log repair" in message and "\n" not in message

    evidence = tmp_path / "removed.jsonl"
    report = repair(
        store.engine.url.render_as_string(hide_password=False),
        log_signer,
        evidence,
        "x",
        notes_dir=tmp_path / "notes",
    )
    assert report is not None and (report.kept_size, report.removed_entries) == (3, 1)
    assert evidence.stat().st_mode & 0o777 == 0o600
    saved = [json.loads(line) for line in evidence.read_text().splitlines()]
    assert {r["table"] for r in saved} >= {"log_entries", "checkpoints", "merkle_nodes"}
    assert report.evidence_sha256 == "sha256:" + hashlib.sha256(evidence.read_bytes()).hexdigest()
    assert raw.scalar("SELECT count(*) FROM log_repairs") == 1
    assert raw.scalar("SELECT kept_size FROM log_repairs") == 3
    assert store.latest_checkpoint() == good  # signed history is untouched

    store.append_receipt(synthetic_envelope(operator, 9))
    assert store.size() == 4 and verify_log(store).ok
    # The repair itself is append-only: its record cannot be removed, and a second run finds nothing.
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        raw.execute("DELETE FROM log_repairs")
    assert (
        repair(
            store.engine.url.render_as_string(hide_password=False),
            log_signer,
            tmp_path / "again.jsonl",
            "x",
            notes_dir=tmp_path / "notes",
        )
        is None
    )


def test_log_repair_through_the_cli_after_a_junk_head_entry_on_sqlite(
    cli, home, sqlite_url, raw_sqlite, tmp_path
) -> None:
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    _junk_entry(raw_sqlite, 1)  # SQLite cannot hash in SQL: this one passes its guards
    refused = cli("keys", "generate", "--db", sqlite_url, "--out", tmp_path / "second.key")
    assert refused.code == 2
    assert "log entry 1 is not covered by a signed checkpoint" in refused.err
    assert "qualify log repair" in refused.err
    evidence = tmp_path / "evidence.jsonl"
    result = cli(
        "log", "repair", "--db", sqlite_url, "--evidence", evidence, "--reason", "junk at head", "--json"
    )
    assert result.code == 0, result.err
    assert json.loads(result.out)["removed_entries"] == 1
    assert cli("keys", "generate", "--db", sqlite_url, "--out", tmp_path / "third.key").code == 0
    verified = cli("log", "verify", "--db", sqlite_url)
    assert (
        verified.code == 0 and "1 owner repair(s) recorded" in verified.out and "junk at head" in verified.out
    )
    again = cli("log", "repair", "--db", sqlite_url, "--evidence", tmp_path / "e2", "--reason", "x")
    assert again.code == 0 and "nothing to repair" in again.out


def test_a_login_member_of_the_writer_role_cannot_repair(
    pg_url, raw_pg, log_signer, operator, tmp_path
) -> None:
    import itertools
    import os

    from receipts.db import WRITER_ROLE
    from receipts.errors import StoreError

    with Store.open(pg_url, log_signer=log_signer) as owner:
        owner.trust_key(operator.public_key())
        append_synthetic(owner, operator, 1)
    _forged_append(raw_pg, 2)
    host = f"repairer{os.getpid()}_{next(itertools.count())}_{tmp_path.name[-6:].replace('-', '_')}"
    with raw_pg.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {host} LOGIN IN ROLE {WRITER_ROLE}"))
    url = sa.engine.make_url(pg_url).set(username=host).render_as_string(hide_password=False)
    before = raw_pg.counts()
    evidence = tmp_path / "e.jsonl"
    with pytest.raises(StoreError, match="only the owner of the store's tables can"):
        repair(url, log_signer, evidence, "not mine to do", notes_dir=tmp_path / "notes")
    assert raw_pg.counts() == before and not evidence.exists()
    assert raw_pg.scalar("SELECT count(*) FROM log_repairs") == 0


def test_a_store_with_entries_at_revision_0001_upgrades_and_goes_on(db_url, log_signer, operator) -> None:
    from alembic import command

    from receipts.db import _alembic_config, create_engine, parse_url, write_transaction

    engine = create_engine(parse_url(db_url), create=True)
    with write_transaction(engine) as conn:
        command.upgrade(_alembic_config(conn), "0001_initial")
    old = Store(engine)  # the store as it was: no insert guards yet
    old.set_log_signer(log_signer)
    old.trust_key(operator.public_key())
    append_synthetic(old, operator, 3)
    old.close()
    with Store.open(db_url, log_signer=log_signer) as store:
        assert store.revision() == SCHEMA_REVISION
        store.append_receipt(synthetic_envelope(operator, 9))
        assert store.size() == 5 and verify_log(store).ok
