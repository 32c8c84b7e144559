"""The app's PostgreSQL sessions run as the non-owner role qualify_writer (DESIGN §6): with the append-only
triggers dropped, UPDATE/DELETE/TRUNCATE through the store are still refused, and everything the store
does (appends, reads, log verify in worker processes) works as that role; where the connecting user may
not take the role, the store falls back to it and says why."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from receipts import logscan
from receipts.db import WRITER_ROLE, writer_role
from receipts.models import APPEND_ONLY_TABLES, SCHEMA_REVISION
from receipts.store import Store
from receipts.testing import synthetic_envelope
from receipts.verify import verify_log
from tests.store.test_store_tamper import populate

_users = itertools.count()


def _whoami(engine: sa.Engine) -> tuple[str, str]:
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text("SELECT current_user, session_user")).one())  # type: ignore[return-value]


@pytest.fixture
def pg_store(pg_url, log_signer, operator) -> Iterator[Store]:
    store = Store.open(pg_url, log_signer=log_signer)
    store.trust_key(operator.public_key(), "test operator")
    yield store
    store.close()


def test_postgres_sessions_run_as_the_writer_role(pg_store, log_signer, operator) -> None:
    assert pg_store.db_role.writer and pg_store.db_role.role == WRITER_ROLE
    assert pg_store.db_role.reason is None
    # Reads, and the append path's write transactions (same pool), both run as the role.
    assert _whoami(pg_store.engine) == (WRITER_ROLE, "postgres")
    populate(pg_store, operator)  # every table, the advisory lock, key trust and revocation
    assert _whoami(pg_store.engine) == (WRITER_ROLE, "postgres")
    assert pg_store.revision() == SCHEMA_REVISION  # alembic_version is readable as the role
    assert pg_store.checkpoint() == pg_store.latest_checkpoint()
    assert pg_store.inclusion_proof(1)
    assert verify_log(pg_store, verifiers=[log_signer.verifier()], workers=0).ok


def test_log_verify_workers_read_as_the_writer_role(pg_store, pg_url, log_signer, operator) -> None:
    engine = logscan._engine(pg_url, WRITER_ROLE)
    assert _whoami(engine) == (WRITER_ROLE, "postgres")
    for n in range(3):
        pg_store.append_receipt(synthetic_envelope(operator, n))
    report = verify_log(pg_store, verifiers=[log_signer.verifier()], workers=2)
    assert report.ok and report.size == 4


@pytest.mark.parametrize(
    "statement",
    ["UPDATE {t} SET {c} = {c}", "DELETE FROM {t}", "TRUNCATE {t} CASCADE"],
    ids=["update", "delete", "truncate"],
)
def test_with_triggers_dropped_the_store_engine_still_cannot_rewrite(
    pg_store, raw_pg, log_signer, operator, statement
) -> None:
    populate(pg_store, operator)
    raw_pg.drop_triggers()  # as the superuser, on its own connection
    assert not {t for t in raw_pg.triggers() if "_no_" in t}
    before = raw_pg.counts()
    with raw_pg.engine.connect() as conn:
        first_column = {
            t: conn.execute(
                sa.text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = :t ORDER BY ordinal_position LIMIT 1"
                ),
                {"t": t},
            ).scalar_one()
            for t in APPEND_ONLY_TABLES
        }
    for table in APPEND_ONLY_TABLES:
        sql = statement.format(t=table, c=first_column[table])
        with (
            pytest.raises(sa.exc.ProgrammingError, match="permission denied"),
            pg_store.engine.begin() as conn,
        ):
            conn.execute(sa.text(sql))
    assert raw_pg.counts() == before
    # The store still appends and verifies as the role.
    pg_store.append_receipt(synthetic_envelope(operator, 99))
    assert verify_log(pg_store, verifiers=[log_signer.verifier()], workers=0).ok


def _login_role(postgres_server: str, *, createrole: bool) -> str:
    """A new LOGIN role (no superuser) that owns a new database; returns the database URL as that role."""
    name = f"app{os.getpid()}_{next(_users)}"
    dsn = postgres_server.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN {'CREATEROLE' if createrole else ''}")
        conn.execute(f"CREATE DATABASE {name} OWNER {name}")
    host = postgres_server.split("@", 1)[1]
    return f"postgresql+psycopg://{name}@{host}/{name}"


def _member(raw, user: str) -> bool:
    return bool(
        raw.scalar(
            "SELECT count(*) FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.roleid "
            "JOIN pg_roles u ON u.oid = m.member WHERE r.rolname = :role AND u.rolname = :user",
            role=WRITER_ROLE,
            user=user,
        )
    )


def test_an_owner_who_may_not_take_the_role_falls_back_and_says_why(
    postgres_server, pg_url, raw_pg, log_signer, operator
) -> None:
    Store.open(pg_url).close()  # as the superuser: makes sure the cluster has the role
    url = _login_role(postgres_server, createrole=False)
    user = sa.engine.make_url(url).username
    store = Store.open(url, log_signer=log_signer)
    try:
        assert not store.db_role.writer and store.db_role.role == user
        assert f"may not SET ROLE {WRITER_ROLE}" in (store.db_role.reason or "")
        assert f"GRANT {WRITER_ROLE} TO {user}" in str(store.db_role)
        assert _whoami(store.engine) == (user, user)
        store.trust_key(operator.public_key())
        store.append_receipt(synthetic_envelope(operator, 1))
        assert verify_log(store, verifiers=[log_signer.verifier()], workers=0).ok
    finally:
        store.close()
    assert not _member(raw_pg, user)


def test_a_createrole_owner_is_granted_the_role_and_uses_it(
    postgres_server, pg_url, raw_pg, log_signer, operator
) -> None:
    if int(raw_pg.scalar("SHOW server_version_num")) >= 160000:
        pytest.skip("from PostgreSQL 16 CREATEROLE grants only roles it administers")
    Store.open(pg_url).close()
    url = _login_role(postgres_server, createrole=True)
    user = sa.engine.make_url(url).username
    assert not _member(raw_pg, user)
    # Nothing is granted by a probe.
    probe = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        assert not writer_role(probe, grant=False).writer
    finally:
        probe.dispose()
    assert not _member(raw_pg, user)
    store = Store.open(url, log_signer=log_signer)
    try:
        assert store.db_role.writer and _member(raw_pg, user)
        assert _whoami(store.engine) == (WRITER_ROLE, user)
        store.trust_key(operator.public_key())
        store.append_receipt(synthetic_envelope(operator, 1))
        assert verify_log(store, verifiers=[log_signer.verifier()], workers=0).ok
    finally:
        store.close()


def test_sqlite_has_no_roles_and_says_so(sqlite_url) -> None:
    with Store.open(sqlite_url) as store:
        assert store.db_role.role is None and not store.db_role.writer
        assert "SQLite has no roles" in str(store.db_role)


def test_a_login_member_of_the_writer_role_appends_but_can_neither_rewrite_nor_drop_triggers(
    pg_url, raw_pg, log_signer, operator
) -> None:
    # The README's full separation: hosts log in as a role that is only a member of qualify_writer.
    with Store.open(pg_url, log_signer=log_signer) as owner:  # as the owner: migrates, creates the role
        owner.trust_key(operator.public_key())
    host = f"host{os.getpid()}_{next(_users)}"
    with raw_pg.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {host} LOGIN IN ROLE {WRITER_ROLE}"))
    url = sa.engine.make_url(pg_url).set(username=host).render_as_string(hide_password=False)
    store = Store.open(url, log_signer=log_signer)
    try:
        assert store.db_role.writer and _whoami(store.engine) == (WRITER_ROLE, host)
        store.append_receipt(synthetic_envelope(operator, 1))
        assert verify_log(store, verifiers=[log_signer.verifier()], workers=0).ok
    finally:
        store.close()
    # A raw connection as the host login (no SET ROLE, no store code) may not drop the append-only
    # triggers, and with them dropped by the owner it still may not rewrite.
    raw_host = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with raw_pg.engine.connect() as conn:
            sql = "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal LIMIT 1"
            name, table = conn.execute(sa.text(sql)).one()
        with pytest.raises(sa.exc.ProgrammingError, match="must be owner"), raw_host.begin() as conn:
            conn.execute(sa.text(f"DROP TRIGGER {name} ON {table}"))
        raw_pg.drop_triggers()
        before = raw_pg.counts()
        for sql in ("DELETE FROM receipts", "TRUNCATE receipts CASCADE", "UPDATE log_entries SET idx = idx"):
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), raw_host.begin() as conn:
                conn.execute(sa.text(sql))
        assert raw_pg.counts() == before
    finally:
        raw_host.dispose()
