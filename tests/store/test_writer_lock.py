"""The single-writer lock is bounded: an append that cannot get it within its lock timeout gives up with
one line naming the holder (PostgreSQL: its backend pid and application name), and nothing is written."""

from __future__ import annotations

import sqlite3
import time

import psycopg
import pytest

from receipts.db import PG_WRITER_LOCK, LockTimeout
from receipts.store import Store
from receipts.testing import synthetic_envelope


def test_a_frozen_postgresql_writer_is_named_and_the_append_gives_up_in_time(
    pg_url: str, log_signer, operator
) -> None:
    store = Store.open(pg_url, log_signer=log_signer, lock_timeout_s=1.0)
    store.trust_key(operator.public_key())
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, application_name="frozen-writer") as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (PG_WRITER_LOCK,))
        pid = holder.info.backend_pid
        started = time.monotonic()
        with pytest.raises(LockTimeout) as caught:
            store.append_receipt(synthetic_envelope(operator, 1))
        waited = time.monotonic() - started
        holder.rollback()
    message = caught.value.diagnostics()
    assert 0.9 <= waited < 5, waited
    assert f"pid {pid}" in message and "'frozen-writer'" in message and "nothing appended" in message
    assert "\n" not in message, message
    assert store.size() == 1
    store.append_receipt(synthetic_envelope(operator, 1))  # the lock is free again: appends go on
    assert store.size() == 2
    store.close()


def test_a_store_level_timeout_bounds_a_sqlite_append_too(sqlite_url: str, log_signer, operator) -> None:
    store = Store.open(sqlite_url, log_signer=log_signer)
    store.trust_key(operator.public_key())
    store.lock_timeout_s = 0.5
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(LockTimeout, match="another process writing the same SQLite file"):
        store.append_receipt(synthetic_envelope(operator, 1))
    assert time.monotonic() - started < 5
    holder.execute("ROLLBACK")
    holder.close()
    assert store.size() == 1
    store.close()


def test_a_blocking_qualify_session_names_itself_by_pid(pg_url: str, log_signer, operator) -> None:
    import os

    from receipts.db import write_transaction

    store = Store.open(pg_url, log_signer=log_signer, lock_timeout_s=0.5)
    store.trust_key(operator.public_key())
    other = Store.open(pg_url)
    try:
        # Another qualify process would hold the lock the same way.
        with (
            write_transaction(other.engine),
            pytest.raises(LockTimeout, match=rf"application 'qualify pid {os.getpid()}'"),
        ):
            store.append_receipt(synthetic_envelope(operator, 1))
    finally:
        other.close()
        store.close()
