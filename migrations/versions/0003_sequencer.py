"""The sequencer: a queue of entries hosts submit, the refusals it records, and checkpoints per batch.

Revision ID: 0003_sequencer
Revises: 0002_insert_guards
Create Date: 2026-12-01

Hosts hold only their operator key: they INSERT an entry's bytes into `pending_entries` (no writer lock,
no log key). The one sequencer, which holds the log key, takes up to a batch of them at a time under the
writer lock, gives each the next log index, writes entries, Merkle subtrees and query rows one entry after
another (so every insert guard of 0002 still holds for each), signs ONE checkpoint for the batch, deletes
the pending rows it integrated or refused and records each refusal in `pending_refusals`, all in one
transaction. So the guards change in one respect only: an entry may follow an entry of the same batch
that no checkpoint seals yet.
- PostgreSQL: the insert guard no longer requires the entry before the new one to be sealed; the deferred
  constraint trigger still refuses to commit an entry that no checkpoint covers (size > its index).
- SQLite: the `log_entries_guard_sealed` trigger is dropped.
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


def _postgresql() -> None:
    guards = importlib.import_module("migrations.versions.0002_insert_guards")
    assert _SEALED_BLOCK in guards._PG_GUARD, "0002's insert guard is not the one this migration relaxes"
    op.execute(
        guards._PG_GUARD.replace(_SEALED_BLOCK, "").replace(
            "CREATE FUNCTION qualify_insert_guard()", "CREATE OR REPLACE FUNCTION qualify_insert_guard()"
        )
    )
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


def _sqlite() -> None:
    op.execute("DROP TRIGGER IF EXISTS log_entries_guard_sealed")
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
