"""Connecting to the store's database: engines per dialect, the single-writer lock, and migrations
applied to head on first use (Alembic, configured in code)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine, make_url

from receipts.errors import StoreError
from receipts.models import APPEND_ONLY_TABLES, SCHEMA_REVISION

# pg_advisory_xact_lock key of the log's single writer ("qualify" in ASCII).
PG_WRITER_LOCK = 0x7175616C696679

_HINT = "check --db / QUALIFY_DB_URL"

# How long an append waits for the single-writer lock unless told otherwise (Store.lock_timeout_s).
DEFAULT_LOCK_TIMEOUT_S = 30.0


def application_name() -> str:
    """What our PostgreSQL sessions call themselves, so that a writer blocked by one of them can name it."""
    return f"qualify pid {os.getpid()}"


# The holder of the advisory lock: pg_locks splits a bigint key into classid (high) and objid (low).
_PG_HOLDER = sa.text(
    "SELECT a.pid, a.application_name, a.backend_start, a.usename FROM pg_locks l "
    "JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = :hi AND l.objid::bigint = :lo"
)

# The non-owner role (docs/DESIGN.md, "The store"), created (NOLOGIN, SELECT and INSERT only) by
# migration 0001 when the migrating user may create roles. The app's sessions SET ROLE to it, so that even
# with the append-only triggers dropped an UPDATE, DELETE or TRUNCATE through the app is refused by the
# privilege system.
WRITER_ROLE = "qualify_writer"


class MissingStore(StoreError):
    """No store exists at the URL yet, and the caller asked not to create one."""


def shown(url: URL) -> str:
    """The URL as it may be printed: never with its password."""
    return url.render_as_string(hide_password=True)


def _first_line(error: BaseException) -> str:
    cause = getattr(error, "orig", None) or error
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


def parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except exc.ArgumentError as error:
        raise StoreError(f"not a database URL: {url!r}; {_HINT}") from error
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(
            f"unsupported database {parsed.get_backend_name()!r} in {shown(parsed)}; use sqlite or postgresql"
        )
    return parsed


def sqlite_path(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory database."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        # Take transaction control from the driver so that we choose BEGIN IMMEDIATE for writes.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer; synchronous=NORMAL in WAL keeps the database consistent
        # after a crash (the last commits may be lost on power failure, never half-applied).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(DEFAULT_LOCK_TIMEOUT_S * 1000)}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # A write transaction takes the database write lock at BEGIN, before it reads the next index,
        # waiting at most its lock timeout for another writer to finish.
        options = conn.get_execution_options()
        if options.get("qualify_write", False):
            busy_ms = options.get("qualify_busy_ms")
            if busy_ms is not None:
                conn.exec_driver_sql(f"PRAGMA busy_timeout={int(busy_ms)}")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


def create_engine(url: URL, *, create: bool) -> Engine:
    """An engine for `url`; for SQLite the parent directory is created only when `create` is set."""
    path = sqlite_path(url)
    if path is not None:
        if not path.exists() and not create:
            raise MissingStore(f"no store at {path}: nothing has been recorded there yet; {_HINT}")
        if create:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise StoreError(
                    f"cannot create the store directory {path.parent}: {error.strerror}; {_HINT}"
                ) from error
    try:
        if url.get_backend_name() == "sqlite":
            engine = sa.create_engine(url, connect_args={"timeout": 30})
            _configure_sqlite(engine)
        else:
            connect_args: dict[str, Any] = {"connect_timeout": 10}
            if "application_name" not in url.query:
                connect_args["application_name"] = application_name()
            engine = sa.create_engine(url, connect_args=connect_args)
            _ping_when_idle(engine)
    except (exc.ArgumentError, exc.NoSuchModuleError, ImportError) as error:
        raise StoreError(f"cannot use DB URL {shown(url)}: {_first_line(error)}; {_HINT}") from error
    return engine


# A pooled connection idle longer than this is pinged before it is used again (a server restarted or a
# connection dropped meanwhile is replaced, not handed out); one in steady use is not (a host submitting
# or a sequencer integrating saves a round trip per transaction).
PING_AFTER_IDLE_S = 5.0


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's pre-ping, only for connections idle more than PING_AFTER_IDLE_S in the pool."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection, record) -> None:  # type: ignore[no-untyped-def]
        record.info["qualify_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection, record, _proxy) -> None:  # type: ignore[no-untyped-def]
        since = record.info.get("qualify_idle_since")
        if since is None or time.monotonic() - since <= PING_AFTER_IDLE_S:
            return  # just connected, or back in the pool a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            # The pool then discards this connection and checks out (or makes) another.
            raise exc.DisconnectionError(f"a pooled connection no longer answers: {error}") from error


def writer(engine: Engine) -> Engine:
    """The same engine (same pool) marked so that its transactions begin as writes."""
    return engine.execution_options(qualify_write=True)


class LockTimeout(StoreError):
    """Another writer held the log's single-writer lock for longer than the caller would wait."""


def _pg_holder(engine: Engine) -> str:
    """Who holds the advisory writer lock, as far as pg_stat_activity lets this role see."""
    try:
        with engine.connect() as conn:
            row = conn.execute(
                _PG_HOLDER, {"hi": PG_WRITER_LOCK >> 32, "lo": PG_WRITER_LOCK & 0xFFFFFFFF}
            ).first()
    except exc.DBAPIError:
        row = None
    if row is None:
        return "another writer (it finished or is not visible to this role)"
    since = "" if row.backend_start is None else f", connected since {row.backend_start:%Y-%m-%dT%H:%M:%SZ}"
    who = f"application {row.application_name!r}" if row.application_name else "no application name"
    user = f", user {row.usename}" if row.usename else ""
    return (
        f"PostgreSQL backend pid {row.pid} ({who}{user}{since}); if it is stuck, an administrator can "
        f"end it with: SELECT pg_terminate_backend({row.pid})"
    )


def _timed_out(error: exc.DBAPIError) -> bool:
    orig = getattr(error, "orig", None)
    if getattr(orig, "sqlstate", None) == "55P03":  # lock_not_available: lock_timeout expired
        return True
    return "database is locked" in str(orig)


@contextlib.contextmanager
def write_transaction(engine: Engine, lock_timeout_s: float | None = None) -> Iterator[Connection]:
    """One write transaction holding the log's single-writer lock; commits on success, else rolls back.
    Waits at most `lock_timeout_s` (default DEFAULT_LOCK_TIMEOUT_S) for the lock, then raises
    LockTimeout naming the holder where the database can tell (PostgreSQL: pid, application, start).

    Pass `writer(engine)` (kept, since making it costs more than a small append)."""
    if not engine.get_execution_options().get("qualify_write"):
        engine = writer(engine)
    timeout = DEFAULT_LOCK_TIMEOUT_S if lock_timeout_s is None else max(0.0, lock_timeout_s)
    # At least 1 ms: 0 would mean "wait forever" to PostgreSQL and "never wait" to SQLite.
    ms = max(1, math.ceil(timeout * 1000))
    started = time.monotonic()
    locked = False
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                conn.execution_options(qualify_busy_ms=ms)
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    # lock_timeout bounds this wait (and any other lock wait of the transaction).
                    conn.execute(sa.text("SELECT set_config('lock_timeout', :ms, true)"), {"ms": f"{ms}ms"})
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_WRITER_LOCK})
                locked = True
                yield conn
    except exc.OperationalError as error:
        if locked or not _timed_out(error):
            raise
        holder = (
            _pg_holder(engine)
            if engine.dialect.name == "postgresql"
            else ("another process writing the same SQLite file (SQLite cannot say which)")
        )
        raise LockTimeout(
            f"the store's writer lock was not free after {time.monotonic() - started:.1f}s "
            f"(limit {timeout:g}s): it is held by {holder}; nothing appended"
        ) from error


def current_revision(conn: Connection) -> str | None:
    """The schema revision recorded in the database, None for an empty database."""
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()


def _alembic_config(conn: Connection | None = None):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    import migrations

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if conn is not None:
        config.attributes["connection"] = conn
    return config


def head_revision() -> str:
    """The head of migrations/versions (what `upgrade` brings the database to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def check_connection(engine: Engine) -> str | None:
    """Connect once and return the database's revision; StoreError (one line) when it cannot connect."""
    try:
        with engine.connect() as conn:
            return current_revision(conn)
    except exc.DBAPIError as error:
        raise StoreError(
            f"cannot connect to DB URL {shown(engine.url)}: {_first_line(error)}; {_HINT}"
        ) from error


def upgrade(engine: Engine) -> str:
    """Apply migrations to head under the writer lock (concurrent first uses migrate once)."""
    from alembic import command

    try:
        with write_transaction(engine) as conn:
            if current_revision(conn) != SCHEMA_REVISION:
                command.upgrade(_alembic_config(conn), "head")
            revision = current_revision(conn)
    except exc.DBAPIError as error:
        raise StoreError(f"cannot migrate the store at {shown(engine.url)}: {_first_line(error)}") from error
    assert revision is not None
    return revision


# ---------------------------------------------------------------------------------------- session role


@dataclass(frozen=True)
class SessionRole:
    """The role the store's sessions run as: `WRITER_ROLE` where it can, else the connecting role, with
    the reason (`reason` is None exactly when `writer` is set)."""

    role: str | None  # None on SQLite, which has no roles
    writer: bool
    reason: str | None

    def __str__(self) -> str:
        if self.writer:
            return f"{self.role} (SELECT and INSERT only)"
        return f"{self.role or 'no role'}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "writer": self.writer, "reason": self.reason}


SQLITE_ROLE = SessionRole(None, False, "SQLite has no roles; the append-only triggers are the guard")


_ABSENT = sa.text("SELECT t FROM unnest(CAST(:tables AS text[])) AS t WHERE to_regclass(t) IS NULL")
_UNGRANTED = sa.text(
    "SELECT t FROM unnest(CAST(:tables AS text[])) AS t "
    "WHERE NOT (has_table_privilege(:role, t, 'SELECT') AND has_table_privilege(:role, t, 'INSERT'))"
)


def _can_set_role(conn: Connection, role: str) -> bool:
    """Whether this session may SET ROLE `role` (tried in a transaction that is rolled back)."""
    try:
        with conn.begin() as txn:
            conn.exec_driver_sql(f"SET LOCAL ROLE {role}")
            txn.rollback()
    except exc.DBAPIError:
        return False
    return True


def _try(conn: Connection, sql: str) -> str | None:
    """Run `sql` in its own transaction; the server's one-line error when it is refused."""
    try:
        with conn.begin():
            conn.exec_driver_sql(sql)
    except exc.DBAPIError as error:
        return _first_line(error)
    return None


def writer_role(engine: Engine, *, grant: bool) -> SessionRole:
    """Whether this engine's sessions can run as WRITER_ROLE. With `grant`, first grant what is missing
    where the connecting user may (as the owner: SELECT/INSERT on the tables; as a superuser, the owner of
    the role or a CREATEROLE user: membership of the role); without it nothing is changed."""
    if engine.dialect.name != "postgresql":
        return SQLITE_ROLE
    try:
        return _writer_role(engine, grant)
    except exc.DBAPIError as error:
        raise StoreError(
            f"cannot choose the session role at {shown(engine.url)}: {_first_line(error)}; {_HINT}"
        ) from error


def _writer_role(engine: Engine, grant: bool) -> SessionRole:
    with engine.connect() as conn:
        user = conn.exec_driver_sql("SELECT current_user").scalar_one()
        conn.rollback()

        def fallback(reason: str) -> SessionRole:
            return SessionRole(user, False, f"sessions run as {user}, not {WRITER_ROLE}: {reason}")

        exists = conn.execute(
            sa.text("SELECT count(*) FROM pg_roles WHERE rolname = :role"), {"role": WRITER_ROLE}
        ).scalar_one()
        conn.rollback()
        if not exists:
            return fallback(
                f"the role does not exist (the user who migrated the store may not create roles); "
                f"a superuser can run: CREATE ROLE {WRITER_ROLE} NOLOGIN; then reopen the store as the owner"
            )
        tables = {"tables": [*APPEND_ONLY_TABLES, "alembic_version"], "role": WRITER_ROLE}
        absent = conn.execute(_ABSENT, tables).scalars().all()
        missing = [] if absent else conn.execute(_UNGRANTED, tables).scalars().all()
        conn.rollback()
        if absent:
            return fallback(f"the store's tables do not exist yet ({absent[0]}); run: qualify db upgrade")
        if missing:
            why = (
                "not granted"
                if not grant
                else _try(conn, f"GRANT SELECT, INSERT ON {', '.join(missing)} TO {WRITER_ROLE}")
            )
            if why is not None:
                return fallback(f"it may not SELECT/INSERT on {', '.join(missing)} ({why})")
        if not _can_set_role(conn, WRITER_ROLE):
            quoted = conn.dialect.identifier_preparer.quote(user)
            why = "not a member" if not grant else _try(conn, f"GRANT {WRITER_ROLE} TO {quoted}")
            if why is not None or not _can_set_role(conn, WRITER_ROLE):
                return fallback(
                    f"{user} may not SET ROLE {WRITER_ROLE} ({why or 'membership without SET'}); "
                    f"a superuser can run: GRANT {WRITER_ROLE} TO {quoted}"
                )
    return SessionRole(WRITER_ROLE, True, None)


def use_role(engine: Engine, role: str) -> None:
    """Every new connection of `engine` runs as `role` (SET ROLE, committed so that the pool's rollback on
    check-in keeps it). Connections already pooled are dropped, so none runs as the connecting role."""

    @event.listens_for(engine, "connect")
    def _set_role(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET ROLE {role}")
        finally:
            cursor.close()
        if not dbapi_connection.autocommit:
            dbapi_connection.commit()

    engine.dispose()
