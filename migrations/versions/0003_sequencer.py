"""The sequencer: a queue of entries hosts submit, the refusals it records, and checkpoints per batch.

Revision ID: 0003_sequencer
Revises: 0002_insert_guards
Create Date: 2026-12-01

Hosts hold only their operator key: they INSERT an entry's bytes into `pending_entries` (no writer lock,
no log key). The one sequencer, which holds the log key, takes up to a batch of them at a time under the
writer lock, gives each the next log index, writes entries, Merkle subtrees and query rows one entry after
another (so every insert guard of 0002 still holds for each), signs ONE checkpoint for the batch, deletes
the pending rows it integrated or refused and records each refusal in `pending_refusals`, all in one
transaction. So the guards of 0002 change from "rows of the newest entry, before its checkpoint" to
"rows of the entries not sealed yet (the current batch), before the batch's checkpoint", which lets the
sequencer write each table's rows of a batch in one statement:
- an entry may follow an entry of its batch that no checkpoint seals yet (still at the next index);
- a Merkle subtree must be completed by an unsealed entry (its last leaf at or after the latest
  checkpoint's size, before the log's end); a leaf must be its entry's leaf hash; (PostgreSQL) an inner
  node the hash of its children;
- receipts, approvals, subjects and key rows must belong to an unsealed entry of their kind, saying what
  it says (as before);
- (PostgreSQL) the deferred constraint trigger still refuses to commit an entry that no checkpoint covers.
`pending_refusals` is append-only like the log. `pending_entries` is a queue: the sequencer deletes what
it has integrated (the log entry is the durable record), so the writer role may DELETE there only.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0003_sequencer"
down_revision = "0002_insert_guards"
branch_labels = None
depends_on = None

BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Time = sa.DateTime(timezone=True)
WRITER_ROLE = "qualify_writer"

_SEALED_BLOCK = """        IF n > 0 AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE size = n) THEN
            RAISE EXCEPTION 'log_entries: entry % is not sealed by a checkpoint yet; nothing may follow it',
                n - 1 USING ERRCODE = 'check_violation';
        END IF;
"""

_PG_SEALED = """
CREATE OR REPLACE FUNCTION qualify_entry_sealed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM checkpoints WHERE size > NEW.idx) THEN
        RAISE EXCEPTION 'log_entries: entry % has no checkpoint in its transaction; an entry is appended '
            'with the checkpoint of its batch', NEW.idx USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END
$$
"""


def _tables() -> None:
    op.create_table(
        "pending_entries",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("envelope", sa.LargeBinary, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("submitted_at", Time, nullable=False),
        sa.Column("submitter", sa.Text, nullable=False),
        sa.CheckConstraint("kind IN ('receipt', 'approval')", name="pending_entries_kind"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_pending_entries_digest", "pending_entries", ["digest"])
    op.create_table(
        "pending_refusals",
        sa.Column("pending_id", BigInt, primary_key=True, autoincrement=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("problem", sa.Text, nullable=False),
        sa.Column("refused_at", Time, nullable=False),
    )
    op.create_index("ix_pending_refusals_digest", "pending_refusals", ["digest"])


# (0002's text, what replaces it): the newest entry (n - 1) becomes any unsealed entry (s <= idx < n).
_PG_CHANGES = (
    (_SEALED_BLOCK, ""),
    ("CREATE FUNCTION qualify_insert_guard()", "CREATE OR REPLACE FUNCTION qualify_insert_guard()"),
    ("    n bigint;\n", "    n bigint;\n    s bigint;\n    e_idx bigint;\n"),
    (
        "    SELECT idx, kind, envelope, leaf_hash INTO entry FROM log_entries WHERE idx = n - 1;\n",
        "    SELECT coalesce(max(size), 0) INTO s FROM checkpoints;\n"
        "    e_idx := n - 1;\n"
        "    IF TG_TABLE_NAME = 'merkle_nodes' THEN\n"
        "        IF NEW.level < 0 OR NEW.level > 62 THEN\n"
        "            RAISE EXCEPTION 'merkle_nodes: level % is not a tree level', NEW.level\n"
        "                USING ERRCODE = 'check_violation';\n"
        "        END IF;\n"
        "        e_idx := ((NEW.node_index + 1) << NEW.level::int) - 1;\n"
        "    ELSIF TG_TABLE_NAME IN ('receipts', 'approvals') THEN\n"
        "        e_idx := NEW.log_idx;\n"
        "    ELSIF TG_TABLE_NAME = 'signer_keys' THEN\n"
        "        e_idx := NEW.trusted_at_idx;\n"
        "    ELSIF TG_TABLE_NAME = 'key_revocations' THEN\n"
        "        e_idx := NEW.revoked_at_idx;\n"
        "    END IF;\n"
        "    IF e_idx < s OR e_idx >= n THEN\n"
        "        RAISE EXCEPTION '%: a row of entry %, which is not one being appended (% to %)',\n"
        "            TG_TABLE_NAME, e_idx, s, n - 1 USING ERRCODE = 'check_violation';\n"
        "    END IF;\n"
        "    SELECT idx, kind, envelope, leaf_hash INTO entry FROM log_entries WHERE idx = e_idx;\n",
    ),
    (
        "IF NEW.level < 0 OR ((NEW.node_index + 1) << NEW.level::int) <> n THEN",
        "IF NEW.level < 0 THEN",
    ),
    (
        "IF NOT EXISTS (SELECT 1 FROM receipts WHERE id = NEW.receipt_id AND log_idx = n - 1) THEN",
        "IF NOT EXISTS (SELECT 1 FROM receipts WHERE id = NEW.receipt_id AND log_idx >= s) THEN",
    ),
    (
        "IF NEW.log_idx <> n - 1 OR entry.kind",
        "IF entry.kind IS DISTINCT FROM rtrim(TG_TABLE_NAME, 's') OR entry.kind",
    ),
    ("IF NEW.trusted_at_idx <> n - 1 OR entry.kind", "IF entry.kind IS NULL OR entry.kind"),
    ("IF NEW.revoked_at_idx <> n - 1 OR entry.kind", "IF entry.kind IS NULL OR entry.kind"),
)


def _pg_guard() -> str:
    text = importlib.import_module("migrations.versions.0002_insert_guards")._PG_GUARD
    for old, new in _PG_CHANGES:
        assert old in text, f"0002's insert guard lacks {old[:60]!r}: not the guard this migration changes"
        text = text.replace(old, new)
    return text


def _postgresql() -> None:
    op.execute(_pg_guard())
    op.execute(_PG_SEALED)
    op.execute(
        "CREATE TRIGGER pending_refusals_no_update_delete BEFORE UPDATE OR DELETE ON pending_refusals "
        "FOR EACH ROW EXECUTE FUNCTION qualify_append_only()"
    )
    op.execute(
        "CREATE TRIGGER pending_refusals_no_truncate BEFORE TRUNCATE ON pending_refusals "
        "FOR EACH STATEMENT EXECUTE FUNCTION qualify_append_only()"
    )
    op.execute("ALTER TABLE pending_refusals ENABLE ALWAYS TRIGGER pending_refusals_no_update_delete")
    op.execute("ALTER TABLE pending_refusals ENABLE ALWAYS TRIGGER pending_refusals_no_truncate")
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
                GRANT SELECT, INSERT, DELETE ON pending_entries TO {WRITER_ROLE};
                GRANT USAGE, SELECT ON SEQUENCE pending_entries_id_seq TO {WRITER_ROLE};
                GRANT SELECT, INSERT ON pending_refusals TO {WRITER_ROLE};
            END IF;
        END
        $$
        """
    )


# SQLite: the rules of 0002 that named the newest entry, for the unsealed ones (SEALED_SIZE <= idx < NEXT).
NEXT = "(SELECT coalesce(max(idx) + 1, 0) FROM log_entries)"
SEALED_SIZE = "(SELECT coalesce(max(size), 0) FROM checkpoints)"


def _unsealed(at: str) -> str:
    return f"{at} < {SEALED_SIZE} OR {at} >= {NEXT}"


_LAST_LEAF = "(((NEW.node_index + 1) << NEW.level) - 1)"
_SQLITE_RULES = (
    (
        "merkle_nodes",
        "span",
        f"NEW.level < 0 OR {_unsealed(_LAST_LEAF)} OR (NEW.level = 0 AND NEW.hash IS NOT "
        "(SELECT leaf_hash FROM log_entries WHERE idx = NEW.node_index))",
        "merkle_nodes: the subtree is not one completed by an entry being appended",
    ),
    (
        "receipt_subjects",
        "receipt",
        f"NOT EXISTS (SELECT 1 FROM receipts WHERE id = NEW.receipt_id AND log_idx >= {SEALED_SIZE})",
        "receipt_subjects: the receipt is not one being appended",
    ),
    *(
        (
            table,
            "entry",
            f"{_unsealed(f'NEW.{column}')} OR "
            f"(SELECT kind FROM log_entries WHERE idx = NEW.{column}) IS NOT '{kind}'",
            f"{table}: the row is not of an entry being appended",
        )
        for table, column, kind in (
            ("receipts", "log_idx", "receipt"),
            ("approvals", "log_idx", "approval"),
            ("signer_keys", "trusted_at_idx", "key-trust"),
            ("key_revocations", "revoked_at_idx", "key-revoke"),
        )
    ),
    (
        "signer_keys",
        "record",
        "EXISTS (SELECT 1 FROM log_entries AS e WHERE e.idx = NEW.trusted_at_idx AND ("
        "NEW.keyid IS NOT json_extract(CAST(e.envelope AS TEXT), '$.keyid') "
        "OR NEW.public_pem IS NOT json_extract(CAST(e.envelope AS TEXT), '$.publicKey') "
        "OR NEW.note IS NOT json_extract(CAST(e.envelope AS TEXT), '$.note')))",
        "signer_keys: the row is not what its key-trust entry says",
    ),
    (
        "key_revocations",
        "record",
        "EXISTS (SELECT 1 FROM log_entries AS e WHERE e.idx = NEW.revoked_at_idx AND ("
        "NEW.keyid IS NOT json_extract(CAST(e.envelope AS TEXT), '$.keyid') "
        "OR NEW.reason IS NOT json_extract(CAST(e.envelope AS TEXT), '$.reason')))",
        "key_revocations: the row is not what its key-revoke entry says",
    ),
)


def _sqlite() -> None:
    op.execute("DROP TRIGGER IF EXISTS log_entries_guard_sealed")
    for table, name, condition, message in _SQLITE_RULES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_guard_{name}")
        op.execute(
            f"CREATE TRIGGER {table}_guard_{name} BEFORE INSERT ON {table} WHEN {condition} "
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )
    for op_name in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER pending_refusals_no_{op_name.lower()} BEFORE {op_name} ON pending_refusals "
            f"BEGIN SELECT RAISE(ABORT, 'table pending_refusals is append-only: {op_name} is forbidden'); END"
        )


def upgrade() -> None:
    _tables()
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgresql()
    elif dialect == "sqlite":
        _sqlite()
    else:
        raise RuntimeError(f"no sequencer guards written for {dialect}; use SQLite or PostgreSQL")


def downgrade() -> None:
    raise RuntimeError("the log's batches depend on this revision; restore from a backup instead")
