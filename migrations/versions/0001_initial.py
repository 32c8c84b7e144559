"""The append-only log, Merkle subtrees, checkpoints, query tables, and their append-only triggers.

Revision ID: 0001_initial
Revises:
Create Date: 2025-11-30

Trigger DDL is written by hand for each dialect:
- PostgreSQL: one plpgsql function raises on UPDATE/DELETE (row triggers) and TRUNCATE (statement
  triggers); the triggers are ENABLE ALWAYS so `session_replication_role = replica` does not skip them.
  A NOLOGIN role `qualify_writer` (SELECT, INSERT only) is created when the migrating user may create
  roles; after migrating, the store runs its sessions as that role where it can (receipts.db.writer_role),
  so that with the triggers dropped an UPDATE/DELETE/TRUNCATE through the app is still refused.
- SQLite: BEFORE UPDATE/DELETE triggers raise; a BEFORE INSERT guard refuses a row whose primary or
  unique key already exists, because INSERT OR REPLACE deletes the old row without firing DELETE
  triggers (unless the connection happens to set recursive_triggers).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Time = sa.DateTime(timezone=True)

# table -> its unique keys (each a tuple of columns): what the SQLite REPLACE guard checks.
UNIQUE_KEYS: dict[str, list[tuple[str, ...]]] = {
    "log_meta": [("id",)],
    "log_entries": [("idx",)],
    "merkle_nodes": [("level", "node_index")],
    "checkpoints": [("size",)],
    "signer_keys": [("keyid",), ("trusted_at_idx",)],
    "key_revocations": [("keyid",), ("revoked_at_idx",)],
    "receipts": [("id",), ("log_idx",)],
    "receipt_subjects": [("receipt_id", "digest")],
    "approvals": [("id",), ("log_idx",)],
}

WRITER_ROLE = "qualify_writer"


def _tables() -> None:
    op.create_table(
        "log_meta",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("origin", sa.Text, nullable=False),
        sa.Column("vkey", sa.Text, nullable=False),
        sa.Column("created_at", Time, nullable=False),
        sa.CheckConstraint("id = 1", name="log_meta_single_row"),
    )
    op.create_table(
        "log_entries",
        sa.Column("idx", BigInt, primary_key=True, autoincrement=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("envelope", sa.LargeBinary, nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("created_at", Time, nullable=False),
        sa.CheckConstraint(
            "kind IN ('receipt', 'approval', 'key-trust', 'key-revoke')", name="log_entries_kind"
        ),
        sa.CheckConstraint("idx >= 0", name="log_entries_idx_nonnegative"),
    )
    op.create_table(
        "merkle_nodes",
        sa.Column("level", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("node_index", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
    )
    op.create_table(
        "checkpoints",
        sa.Column("size", BigInt, primary_key=True, autoincrement=False),
        sa.Column("root", sa.LargeBinary(32), nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("created_at", Time, nullable=False),
    )
    op.create_table(
        "signer_keys",
        sa.Column("keyid", sa.String(64), primary_key=True),
        sa.Column("algorithm", sa.String(16), nullable=False),
        sa.Column("public_pem", sa.Text, nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("trusted_at_idx", BigInt, sa.ForeignKey("log_entries.idx"), nullable=False, unique=True),
    )
    op.create_table(
        "key_revocations",
        sa.Column("keyid", sa.String(64), sa.ForeignKey("signer_keys.keyid"), primary_key=True),
        sa.Column("revoked_at_idx", BigInt, sa.ForeignKey("log_entries.idx"), nullable=False, unique=True),
        sa.Column("reason", sa.Text, nullable=False),
    )
    op.create_table(
        "receipts",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("log_idx", BigInt, sa.ForeignKey("log_entries.idx"), nullable=False, unique=True),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("started_at", Time, nullable=False),
        sa.Column("finished_at", Time, nullable=False),
        sa.Column("keyid", sa.String(64), nullable=False),
        sa.Column("predicate", sa.JSON, nullable=False),
    )
    op.create_index("ix_receipts_verdict", "receipts", ["verdict"])
    op.create_index("ix_receipts_finished_at", "receipts", ["finished_at"])
    op.create_table(
        "receipt_subjects",
        sa.Column("receipt_id", sa.String(64), sa.ForeignKey("receipts.id"), primary_key=True),
        sa.Column("digest", sa.String(200), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
    )
    op.create_index("ix_receipt_subjects_digest", "receipt_subjects", ["digest"])
    op.create_table(
        "approvals",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("log_idx", BigInt, sa.ForeignKey("log_entries.idx"), nullable=False, unique=True),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("policy_digest", sa.String(200), nullable=False),
        sa.Column("receipt_ids", sa.JSON, nullable=False),
        sa.Column("reasons", sa.JSON, nullable=False),
        sa.Column("keyid", sa.String(64), nullable=False),
        sa.Column("created_at", Time, nullable=False),
    )
    op.create_index("ix_approvals_subject", "approvals", ["subject"])


def _postgresql_triggers() -> None:
    op.execute(
        """
        CREATE FUNCTION qualify_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'table % is append-only: % is forbidden', TG_TABLE_NAME, TG_OP
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'the log only grows; append a new entry instead';
        END
        $$
        """
    )
    for table in UNIQUE_KEYS:
        op.execute(
            f"CREATE TRIGGER {table}_no_update_delete BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION qualify_append_only()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION qualify_append_only()"
        )
        op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {table}_no_update_delete")
        op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {table}_no_truncate")
    tables = ", ".join([*UNIQUE_KEYS, "alembic_version"])
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{WRITER_ROLE}')
               AND (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user) THEN
                CREATE ROLE {WRITER_ROLE} NOLOGIN;
            END IF;
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
                GRANT SELECT, INSERT ON {tables} TO {WRITER_ROLE};
            END IF;
        END
        $$
        """
    )


def _sqlite_triggers() -> None:
    for table, keys in UNIQUE_KEYS.items():
        for op_name in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{op_name.lower()} BEFORE {op_name} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, 'table {table} is append-only: {op_name} is forbidden'); END"
            )
        exists = " OR ".join(
            f"EXISTS (SELECT 1 FROM {table} WHERE "
            + " AND ".join(f"{column} = NEW.{column}" for column in key)
            + ")"
            for key in keys
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table} WHEN {exists} "
            f"BEGIN SELECT RAISE(ABORT, 'table {table} is append-only: a row with this key already exists "
            "(INSERT OR REPLACE is forbidden)'); END"
        )


def upgrade() -> None:
    _tables()
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgresql_triggers()
    elif dialect == "sqlite":
        _sqlite_triggers()
    else:
        raise RuntimeError(f"no append-only triggers written for {dialect}; use SQLite or PostgreSQL")


def downgrade() -> None:
    # The log is evidence: there is no downgrade that drops it.
    raise RuntimeError("downgrading would drop the append-only log; restore from a backup instead")
