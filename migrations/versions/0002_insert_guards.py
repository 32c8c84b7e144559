"""Insert guards: a row may only be what an append writes, so one INSERT by a `qualify_writer` member
cannot stop every later append; and `log_repairs`, the append-only record of owner repairs.

Revision ID: 0002_insert_guards
Revises: 0001_initial
Create Date: 2026-12-01

An append writes, in one transaction: the entry at the next index, the Merkle subtrees that entry
completes, its query rows, then the checkpoint of the new size. The guards (BEFORE INSERT, per dialect,
ENABLE ALWAYS on PostgreSQL) refuse anything else:
- log_entries: the index must be the next one, the entry before it must be sealed by its checkpoint, and
  (PostgreSQL) the leaf hash must be the RFC 9162 hash of the bytes; a deferred constraint trigger
  (PostgreSQL) refuses to commit an entry without the checkpoint that seals it.
- checkpoints: the size must be the log's size (no future or past checkpoint).
- merkle_nodes: only subtrees completed by the newest, unsealed entry; a leaf equals its entry's leaf
  hash, and (PostgreSQL) an inner node the hash of its two children.
- receipts, receipt_subjects, approvals, signer_keys, key_revocations: only rows of the newest, unsealed
  entry of the right kind; (PostgreSQL) ids are the sha256 of the entry's bytes, and key rows say what
  the key entry says.
- log_meta: only before the first entry.
SQLite cannot hash in SQL, so there the hash checks are left to the append (which recomputes them) and to
`log verify`; SQLite has no roles either, so whoever can write its file can drop any trigger.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_insert_guards"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

WRITER_ROLE = "qualify_writer"
GUARDED = (
    "log_meta",
    "log_entries",
    "merkle_nodes",
    "checkpoints",
    "signer_keys",
    "key_revocations",
    "receipts",
    "receipt_subjects",
    "approvals",
)

_PG_GUARD = r"""
CREATE FUNCTION qualify_insert_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    entry record;
    record jsonb;
    left_hash bytea;
    right_hash bytea;
BEGIN
    SELECT coalesce(max(idx) + 1, 0) INTO n FROM log_entries;
    IF TG_TABLE_NAME = 'log_meta' THEN
        IF n > 0 THEN
            RAISE EXCEPTION 'log_meta: the log already has % entries; its identity is fixed', n
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_TABLE_NAME = 'log_entries' THEN
        IF NEW.idx <> n THEN
            RAISE EXCEPTION 'log_entries: index % is not the next index %: the log is gapless', NEW.idx, n
                USING ERRCODE = 'check_violation';
        END IF;
        IF n > 0 AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE size = n) THEN
            RAISE EXCEPTION 'log_entries: entry % is not sealed by a checkpoint yet; nothing may follow it',
                n - 1 USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.leaf_hash <> sha256('\x00'::bytea || NEW.envelope) THEN
            RAISE EXCEPTION 'log_entries: the leaf hash of entry % is not the hash of its bytes', NEW.idx
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_TABLE_NAME = 'checkpoints' THEN
        IF NEW.size <> n OR n = 0 THEN
            RAISE EXCEPTION 'checkpoints: size % is not the log size %', NEW.size, n
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    -- Every other row belongs to the newest entry, before its checkpoint seals it.
    IF n = 0 OR EXISTS (SELECT 1 FROM checkpoints WHERE size = n) THEN
        RAISE EXCEPTION '%: rows are written only with a new entry, before its checkpoint', TG_TABLE_NAME
            USING ERRCODE = 'check_violation';
    END IF;
    SELECT idx, kind, envelope, leaf_hash INTO entry FROM log_entries WHERE idx = n - 1;
    IF TG_TABLE_NAME = 'merkle_nodes' THEN
        IF NEW.level < 0 OR ((NEW.node_index + 1) << NEW.level::int) <> n THEN
            RAISE EXCEPTION 'merkle_nodes: subtree (level %, index %) is not completed by entry %',
                NEW.level, NEW.node_index, n - 1 USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.level = 0 THEN
            IF NEW.hash <> entry.leaf_hash THEN
                RAISE EXCEPTION 'merkle_nodes: leaf % is not the leaf hash of its entry', NEW.node_index
                    USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END IF;
        SELECT hash INTO left_hash FROM merkle_nodes
            WHERE level = NEW.level - 1 AND node_index = 2 * NEW.node_index;
        SELECT hash INTO right_hash FROM merkle_nodes
            WHERE level = NEW.level - 1 AND node_index = 2 * NEW.node_index + 1;
        IF left_hash IS NULL OR right_hash IS NULL
           OR NEW.hash <> sha256('\x01'::bytea || left_hash || right_hash) THEN
            RAISE EXCEPTION 'merkle_nodes: subtree (level %, index %) is not the hash of its children',
                NEW.level, NEW.node_index USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_TABLE_NAME = 'receipt_subjects' THEN
        IF NOT EXISTS (SELECT 1 FROM receipts WHERE id = NEW.receipt_id AND log_idx = n - 1) THEN
            RAISE EXCEPTION 'receipt_subjects: receipt % is not the newest entry', NEW.receipt_id
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_TABLE_NAME IN ('receipts', 'approvals') THEN
        IF NEW.log_idx <> n - 1 OR entry.kind <> rtrim(TG_TABLE_NAME, 's')
           OR NEW.id <> encode(sha256(entry.envelope), 'hex') THEN
            RAISE EXCEPTION '%: row % is not the newest entry (index %)', TG_TABLE_NAME, NEW.id, n - 1
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    record := convert_from(entry.envelope, 'UTF8')::jsonb;
    IF TG_TABLE_NAME = 'signer_keys' THEN
        IF NEW.trusted_at_idx <> n - 1 OR entry.kind <> 'key-trust' OR record->>'keyid' <> NEW.keyid
           OR record->>'publicKey' <> NEW.public_pem OR record->>'note' <> NEW.note
           OR record->>'algorithm' <> NEW.algorithm THEN
            RAISE EXCEPTION 'signer_keys: row for key % is not what key-trust entry % says', NEW.keyid, n - 1
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_TABLE_NAME = 'key_revocations' THEN
        IF NEW.revoked_at_idx <> n - 1 OR entry.kind <> 'key-revoke' OR record->>'keyid' <> NEW.keyid
           OR record->>'reason' <> NEW.reason THEN
            RAISE EXCEPTION 'key_revocations: row for key % is not what key-revoke entry % says',
                NEW.keyid, n - 1 USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    RETURN NEW;
END
$$
"""

_PG_SEALED = """
CREATE FUNCTION qualify_entry_sealed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM checkpoints WHERE size = NEW.idx + 1) THEN
        RAISE EXCEPTION 'log_entries: entry % has no checkpoint in its transaction; an entry is appended '
            'with the checkpoint that seals it', NEW.idx USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END
$$
"""

# SQLite: (table, name, condition under which the row is refused, message). NEXT is the log's size.
NEXT = "(SELECT coalesce(max(idx) + 1, 0) FROM log_entries)"
SEALED = f"EXISTS (SELECT 1 FROM checkpoints WHERE size = {NEXT})"
NEWEST = f"(SELECT {{col}} FROM log_entries WHERE idx = {NEXT} - 1)"
_SQLITE_RULES = (
    ("log_meta", "first", f"{NEXT} > 0", "log_meta: the log already has entries; its identity is fixed"),
    ("log_entries", "next", f"NEW.idx <> {NEXT}", "log_entries: the index is not the next index"),
    (
        "log_entries",
        "sealed",
        f"{NEXT} > 0 AND NOT {SEALED}",
        "log_entries: the newest entry is not sealed by a checkpoint yet; nothing may follow it",
    ),
    ("checkpoints", "size", f"NEW.size <> {NEXT} OR {NEXT} = 0", "checkpoints: the size is not the log size"),
    *(
        (
            table,
            "newest",
            f"{NEXT} = 0 OR {SEALED}",
            f"{table}: rows are written only with a new entry, before its checkpoint",
        )
        for table in (
            "merkle_nodes",
            "receipts",
            "receipt_subjects",
            "approvals",
            "signer_keys",
            "key_revocations",
        )
    ),
    (
        "merkle_nodes",
        "span",
        f"NEW.level < 0 OR ((NEW.node_index + 1) << NEW.level) <> {NEXT} "
        f"OR (NEW.level = 0 AND NEW.hash <> {NEWEST.format(col='leaf_hash')})",
        "merkle_nodes: the subtree is not one completed by the newest entry",
    ),
    (
        "receipt_subjects",
        "receipt",
        f"NOT EXISTS (SELECT 1 FROM receipts WHERE id = NEW.receipt_id AND log_idx = {NEXT} - 1)",
        "receipt_subjects: the receipt is not the newest entry",
    ),
    *(
        (
            table,
            "entry",
            f"NEW.{column} <> {NEXT} - 1 OR {NEWEST.format(col='kind')} <> '{kind}'",
            f"{table}: the row is not of the newest entry",
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
        "NEW.keyid IS NOT json_extract(CAST(e.envelope AS TEXT), '$.keyid') "
        "OR NEW.public_pem IS NOT json_extract(CAST(e.envelope AS TEXT), '$.publicKey') "
        "OR NEW.note IS NOT json_extract(CAST(e.envelope AS TEXT), '$.note')",
        "signer_keys: the row is not what its key-trust entry says",
    ),
    (
        "key_revocations",
        "record",
        "NEW.keyid IS NOT json_extract(CAST(e.envelope AS TEXT), '$.keyid') "
        "OR NEW.reason IS NOT json_extract(CAST(e.envelope AS TEXT), '$.reason')",
        "key_revocations: the row is not what its key-revoke entry says",
    ),
)


def _repairs_table() -> None:
    op.create_table(
        "log_repairs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("repaired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kept_size", sa.BigInteger, nullable=False),
        sa.Column("removed_entries", sa.BigInteger, nullable=False),
        sa.Column("removed_rows", sa.BigInteger, nullable=False),
        sa.Column("evidence_sha256", sa.String(71), nullable=False),
        sa.Column("by_role", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
    )


def _postgresql() -> None:
    op.execute(_PG_GUARD)
    op.execute(_PG_SEALED)
    for table in GUARDED:
        op.execute(
            f"CREATE TRIGGER {table}_insert_guard BEFORE INSERT ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION qualify_insert_guard()"
        )
        op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {table}_insert_guard")
    op.execute(
        "CREATE CONSTRAINT TRIGGER log_entries_sealed AFTER INSERT ON log_entries "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION qualify_entry_sealed()"
    )
    op.execute("ALTER TABLE log_entries ENABLE ALWAYS TRIGGER log_entries_sealed")
    # log_repairs: append-only like the rest, and written by the owner only (the writer role may read it).
    op.execute(
        "CREATE TRIGGER log_repairs_no_update_delete BEFORE UPDATE OR DELETE ON log_repairs "
        "FOR EACH ROW EXECUTE FUNCTION qualify_append_only()"
    )
    op.execute(
        "CREATE TRIGGER log_repairs_no_truncate BEFORE TRUNCATE ON log_repairs "
        "FOR EACH STATEMENT EXECUTE FUNCTION qualify_append_only()"
    )
    op.execute("ALTER TABLE log_repairs ENABLE ALWAYS TRIGGER log_repairs_no_update_delete")
    op.execute("ALTER TABLE log_repairs ENABLE ALWAYS TRIGGER log_repairs_no_truncate")
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
                GRANT SELECT ON log_repairs TO {WRITER_ROLE};
            END IF;
        END
        $$
        """
    )


def _sqlite() -> None:
    for table, name, condition, message in _SQLITE_RULES:
        if name == "record":
            condition = f"EXISTS (SELECT 1 FROM log_entries AS e WHERE e.idx = {NEXT} - 1 AND ({condition}))"
        op.execute(
            f"CREATE TRIGGER {table}_guard_{name} BEFORE INSERT ON {table} WHEN {condition} "
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )
    for op_name in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER log_repairs_no_{op_name.lower()} BEFORE {op_name} ON log_repairs "
            f"BEGIN SELECT RAISE(ABORT, 'table log_repairs is append-only: {op_name} is forbidden'); END"
        )


def upgrade() -> None:
    _repairs_table()
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgresql()
    elif dialect == "sqlite":
        _sqlite()
    else:
        raise RuntimeError(f"no insert guards written for {dialect}; use SQLite or PostgreSQL")


def downgrade() -> None:
    raise RuntimeError("the insert guards protect the log; restore from a backup instead of downgrading")
