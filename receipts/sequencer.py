"""Roles of a fleet log: hosts submit, one sequencer integrates and signs, anyone verifies.

A host holds only its operator key and the log's verifier key. It submits an entry's bytes (a signed
receipt or approval) as one INSERT into `pending_entries`: no writer lock, no log key. The sequencer,
the one process that holds the log key, integrates the queue in batches (at most `batch` entries per
transaction): it gives each entry the next log index, checks its signature against the key history at that
index, writes the entry, its Merkle subtrees and query rows, signs ONE checkpoint for the batch, and in the
same transaction deletes the queue rows it integrated or refused, recording each refusal and its reason
in `pending_refusals`. A host then waits, bounded, until its entry has a log index (or a refusal), and
checks the inclusion proof under the signed checkpoint with the verifier key it holds.

Nothing is lost or left with a gap under kill -9: a submission is committed or not; a batch is committed
whole (entries, subtrees, checkpoint, queue deletions) or not at all, and the next batch starts from the
log's verified head. Key trust is not submitted through the queue: trusting an operator key is an
administrator's act, appended where the log key is (`qualify keys trust`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from receipts.checkpoint import NoteVerifier
from receipts.errors import ReceiptsError, StoreError, TamperError
from receipts.models import ApprovalRow, PendingEntry, PendingRefusal, ReceiptRow
from receipts.receipt import parse_receipt
from receipts.records import ReceiptRecord, ReceiptReport

# Tessera's defaults: a batch is at most this many entries, or what arrived within BATCH_WAIT_S.
BATCH_SIZE = 256
BATCH_WAIT_S = 0.25
# How long a host waits for its entry to be sequenced unless told otherwise.
DEFAULT_WAIT_S = 30.0
# Largest entry a host may submit (a receipt is a few tens of KiB).
MAX_ENTRY_BYTES = 4 << 20

_PENDING = PendingEntry.__table__
_REFUSALS = PendingRefusal.__table__
_TAKE = sa.select(_PENDING.c.id, _PENDING.c.kind, _PENDING.c.envelope, _PENDING.c.digest).order_by(
    _PENDING.c.id
)
_ANY_PENDING = sa.select(_PENDING.c.id).limit(1)


class NotSequenced(StoreError):
    """The entry was not sequenced within the wait (it stays queued)."""


class Refused(StoreError):
    """The sequencer refused the entry (its reason is the message)."""


@dataclass(frozen=True)
class Submitted:
    pending_id: int
    kind: str
    digest: str  # sha256 hex of the bytes: the receipt or approval id once sequenced


@dataclass(frozen=True)
class Batch:
    integrated: int
    refused: int
    size: int  # the log's size after the batch


_INSERT_PENDING = sa.insert(_PENDING).returning(_PENDING.c.id)


@contextlib.contextmanager
def _queueing(store) -> Iterator[Connection]:  # type: ignore[no-untyped-def]
    """A connection for one INSERT into the queue, committed when it returns. PostgreSQL: the statement
    runs in autocommit, which is its own transaction (one statement, all or nothing) without the BEGIN and
    COMMIT round trips: a host's submission is one round trip. SQLite: an ordinary transaction."""
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        with store.engine.begin() as conn:
            yield conn


def submitter() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def submit(store, kind: str, data: bytes) -> Submitted:  # type: ignore[no-untyped-def]
    """Queue an entry for the sequencer: one INSERT, no writer lock, no log key."""
    if kind not in ("receipt", "approval"):
        raise StoreError(f"only receipts and approvals are submitted to the sequencer, not {kind!r}")
    if len(data) > MAX_ENTRY_BYTES:
        raise StoreError(f"the entry is {len(data)} bytes, over the {MAX_ENTRY_BYTES}-byte limit")
    digest = hashlib.sha256(data).hexdigest()
    row = {
        "kind": kind,
        "envelope": data,
        "digest": digest,
        "submitted_at": datetime.now(UTC),
        "submitter": submitter(),
    }
    with _queueing(store) as conn:
        pending_id = conn.execute(_INSERT_PENDING, row).scalar_one()
    return Submitted(pending_id, kind, digest)


def submit_many(store, items: list[tuple[str, bytes]]) -> list[Submitted]:  # type: ignore[no-untyped-def]
    """Queue several entries in one INSERT transaction (a host importing receipts, or a benchmark)."""
    now, who = datetime.now(UTC), submitter()
    rows = [
        {
            "kind": kind,
            "envelope": data,
            "digest": hashlib.sha256(data).hexdigest(),
            "submitted_at": now,
            "submitter": who,
        }
        for kind, data in items
    ]
    with store.engine.begin() as conn:  # one transaction: the INSERT may be sent in pages
        ids = conn.execute(sa.insert(_PENDING).returning(_PENDING.c.id, _PENDING.c.digest), rows).all()
    kinds = {r["digest"]: r["kind"] for r in rows}
    return [Submitted(i, kinds[d], d) for i, d in ids]


def queued(store) -> int:  # type: ignore[no-untyped-def]
    with store.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(_PENDING)).scalar_one()


def integrate(store, batch: int = BATCH_SIZE) -> Batch:  # type: ignore[no-untyped-def]
    """One batch: take up to `batch` queued entries under the writer lock and integrate them (see the
    module docstring). `store` must hold the log key."""
    with store.engine.connect() as conn:
        if conn.execute(_ANY_PENDING).first() is None:
            return Batch(0, 0, store.size())
    taken: list[int] = []
    early: list[tuple[int, str, str]] = []  # (pending id, digest, why) of rows that do not even parse

    def take(conn: Connection):  # type: ignore[no-untyped-def]
        items = []
        queue = conn.execute(_TAKE.limit(batch)).all()
        receipt_ids = [digest for _, kind, _, digest in queue if kind == "receipt"]
        placed: dict[str, int] = dict(
            conn.execute(
                sa.select(ReceiptRow.id, ReceiptRow.log_idx).where(ReceiptRow.id.in_(receipt_ids))
            ).all()
            if receipt_ids
            else []
        )
        for pending_id, kind, data, digest in queue:
            data = bytes(data)
            taken.append(pending_id)
            try:
                if hashlib.sha256(data).hexdigest() != digest:
                    raise StoreError("its digest column is not the sha256 of its bytes")
                if kind == "receipt":
                    item, _ = store._receipt_pending(parse_receipt(data), placed)
                else:
                    item, _ = store._approval_pending(data)
            except ReceiptsError as error:
                early.append((pending_id, digest, error.diagnostics()))
                continue
            items.append(item.__class__(item.kind, item.data, item.rows, (pending_id, digest)))
        return items

    def after(conn: Connection, refused) -> None:  # type: ignore[no-untyped-def]
        now = datetime.now(UTC)
        rows = [
            {"pending_id": i, "digest": d, "problem": why[:2000], "refused_at": now} for i, d, why in early
        ]
        rows += [
            {"pending_id": item.tag[0], "digest": item.tag[1], "problem": why[:2000], "refused_at": now}
            for item, why in refused
        ]
        if rows:
            conn.execute(sa.insert(_REFUSALS), rows)
        if taken:
            conn.execute(sa.delete(_PENDING).where(_PENDING.c.id.in_(taken)))

    appended = store._append(take, seal_each=False, after=after)
    return Batch(
        len(appended), len(taken) - len(appended), appended[-1].idx + 1 if appended else store.size()
    )


def run(  # type: ignore[no-untyped-def]
    store,
    *,
    batch: int = BATCH_SIZE,
    wait_s: float = BATCH_WAIT_S,
    until: Callable[[], bool] = lambda: False,
    on_batch: Callable[[Batch], None] | None = None,
) -> None:
    """The sequencer loop: integrate whatever is queued (a full batch at once), else look again after
    `wait_s`, until `until()` says stop."""
    while not until():
        done = integrate(store, batch)
        if on_batch is not None and (done.integrated or done.refused):
            on_batch(done)
        if done.integrated + done.refused < batch:
            time.sleep(wait_s)


def wait_sequenced(store, submitted: Submitted, timeout_s: float = DEFAULT_WAIT_S) -> int:  # type: ignore[no-untyped-def]
    """The log index the sequencer gave the entry; Refused with its reason; NotSequenced after
    `timeout_s` (the entry stays queued and is integrated when the sequencer runs)."""
    table = ReceiptRow.__table__ if submitted.kind == "receipt" else ApprovalRow.__table__
    placed = sa.select(table.c.log_idx).where(table.c.id == submitted.digest)
    refusal = sa.select(_REFUSALS.c.problem).where(_REFUSALS.c.pending_id == submitted.pending_id)
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = 0.02
    while True:
        with store.engine.connect() as conn:
            idx = conn.execute(placed).scalar()
            why = None if idx is not None else conn.execute(refusal).scalar()
        if idx is not None:
            return int(idx)
        if why is not None:
            raise Refused(f"the sequencer refused {submitted.kind} {submitted.digest[:16]}: {why}")
        if time.monotonic() >= deadline:
            raise NotSequenced(
                f"{submitted.kind} {submitted.digest[:16]} was not sequenced within {timeout_s:g}s; it stays "
                "queued: is the log's sequencer running (qualify log sequence, where the log key is)?"
            )
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.25)


def proven(store, digest: str, verifier: NoteVerifier) -> ReceiptReport:  # type: ignore[no-untyped-def]
    """The receipt's inclusion under the latest signed checkpoint, checked with the host's verifier key
    (never the key the database names); TamperError when it does not verify."""
    report = store.verify_receipt(digest, verifiers=[verifier])
    if not report.ok:
        raise TamperError(f"receipt {digest[:16]} was sequenced but does not verify: {report.problem}")
    return report


def append_as_host(  # type: ignore[no-untyped-def]
    store, data: bytes, verifier: NoteVerifier, timeout_s: float = DEFAULT_WAIT_S
) -> ReceiptRecord:
    """A host's append of a signed receipt: submit, wait for the sequencer, check the proof."""
    submitted = submit(store, "receipt", data)
    wait_sequenced(store, submitted, timeout_s)
    proven(store, submitted.digest, verifier)
    return store.get_receipt(submitted.digest)
