"""Migrations: applied on first use, at head, matching the ORM models, with the append-only triggers."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from receipts.db import head_revision
from receipts.models import APPEND_ONLY_TABLES, SCHEMA_REVISION, Base
from receipts.store import Store


def test_the_code_expects_the_head_revision() -> None:
    assert head_revision() == SCHEMA_REVISION


def test_first_use_migrates_to_head_and_models_match_the_migration(db_url, raw) -> None:
    Store.open(db_url).close()
    assert raw.scalar("SELECT version_num FROM alembic_version") == SCHEMA_REVISION
    with raw.engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    # Hand-written DDL and the ORM must describe the same tables, columns and indexes.
    assert diffs == []


def test_opening_twice_does_not_migrate_again(db_url, raw) -> None:
    Store.open(db_url).close()
    raw.execute("CREATE TABLE marker (x INTEGER)")
    Store.open(db_url).close()
    assert raw.scalar("SELECT version_num FROM alembic_version") == SCHEMA_REVISION
    assert raw.scalar("SELECT count(*) FROM marker") == 0


def test_append_only_triggers_exist_at_head(db_url, raw) -> None:
    Store.open(db_url).close()
    names = raw.triggers()
    for table in APPEND_ONLY_TABLES:
        if raw.dialect == "sqlite":
            expected = {f"{table}_no_update", f"{table}_no_delete", f"{table}_no_replace"}
        else:
            expected = {f"{table}_no_update_delete", f"{table}_no_truncate"}
        assert expected <= names, f"{table} lacks {expected - names}"


def test_postgres_triggers_fire_even_in_replica_mode(pg_url, raw_pg) -> None:
    Store.open(pg_url).close()
    with raw_pg.engine.connect() as conn:
        modes = dict(
            conn.execute(
                sa.text(
                    "SELECT tgname, tgenabled FROM pg_trigger WHERE NOT tgisinternal AND tgname LIKE '%_no_%'"
                )
            ).all()
        )
    assert modes and set(modes.values()) == {"A"}  # ENABLE ALWAYS


def test_postgres_writer_role_may_only_select_and_insert(pg_url, raw_pg) -> None:
    Store.open(pg_url).close()
    for table in APPEND_ONLY_TABLES:
        for privilege, allowed in (
            ("SELECT", True),
            ("INSERT", True),
            ("UPDATE", False),
            ("DELETE", False),
            ("TRUNCATE", False),
        ):
            got = raw_pg.scalar(f"SELECT has_table_privilege('qualify_writer', '{table}', '{privilege}')")
            assert got is allowed, (table, privilege)
