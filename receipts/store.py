"""The store: an append-only RFC 9162 Merkle log of signed entries in SQL, with a signed checkpoint after
every append and query tables for receipts/approvals/keys (reading lives in receipts.reader).

Every append is one transaction under the single-writer lock: the log entry, the Merkle subtrees it
completes, its query rows and the new signed checkpoint are written together or not at all.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from receipts import approval_rows, dsse, merkle
from receipts.checkpoint import Checkpoint, NoteSigner, NoteVerifier, open_checkpoint, sign_checkpoint
from receipts.db import (
    SQLITE_ROLE,
    WRITER_ROLE,
    MissingStore,
    SessionRole,
    check_connection,
    create_engine,
    parse_url,
    shown,
    upgrade,
    use_role,
    write_transaction,
    writer,
    writer_role,
)
from receipts.errors import NotFound, ReceiptsError, StoreError, TamperError, VerificationError
from receipts.keylog import KeyHistory, revoke_record, trust_record
from receipts.keys import VerifyingKey
from receipts.models import (
    SCHEMA_REVISION,
    ApprovalRow,
    CheckpointRow,
    KeyRevocation,
    LogMeta,
    MerkleNode,
    ReceiptRow,
    SignerKey,
)
from receipts.reader import APPROVALS, ENTRIES, RECEIPTS, SUBJECTS, Head, LogReader
from receipts.receipt import ParsedReceipt, parse_receipt
from receipts.records import (
    Appended,
    ApprovalRecord,
    KeyInfo,
    ReceiptRecord,
)
from receipts.subtrees import SqlSubtrees, frontier

# Statements built once (the append path runs them thousands of times a second).
_RECEIPT_AT = sa.select(ReceiptRow.log_idx).where(ReceiptRow.id == sa.bindparam("id"))
_META = sa.select(LogMeta.origin, LogMeta.vkey)
_INSERT_ENTRY = sa.insert(ENTRIES)
_INSERT_NODES = sa.insert(MerkleNode.__table__)
_INSERT_CHECKPOINT = sa.insert(CheckpointRow.__table__)
_KEY_ENTRIES = (
    sa.select(ENTRIES.c.idx, ENTRIES.c.envelope)
    .where(
        ENTRIES.c.idx >= sa.bindparam("start"),
        ENTRIES.c.idx < sa.bindparam("end"),
        ENTRIES.c.kind.in_(("key-trust", "key-revoke")),
    )
    .order_by(ENTRIES.c.idx)
)

# Builds an entry's query rows once the index is known and the lock is held; raises to refuse it.
RowsFn = Callable[[Connection, int, KeyHistory], list[tuple[sa.Table, list[dict[str, Any]]]]]


_INSERTS: dict[str, sa.Insert] = {}


def _inserts(table: sa.Table) -> sa.Insert:
    if table.name not in _INSERTS:
        _INSERTS[table.name] = sa.insert(table)
    return _INSERTS[table.name]


@dataclass(frozen=True)
class _Pending:
    kind: str
    data: bytes
    rows: RowsFn
    tag: Any = None  # what the caller needs to know which item this was (the sequencer: its queue row)


# Tables in the order a batch's rows are written (each row's references written before it).
_BULK_ORDER = tuple(
    (table.name, sa.insert(table))
    for table in (
        ENTRIES,
        MerkleNode.__table__,
        SignerKey.__table__,
        KeyRevocation.__table__,
        RECEIPTS,
        SUBJECTS,
        APPROVALS,
    )
)

# The sequencer's hook, run in the integrating transaction after the entries: (connection, the items
# refused with why) -> None.
AfterFn = Callable[[Connection, list[tuple["_Pending", str]]], None]


# A Store built on an engine directly (not through Store.open) runs as whatever the engine connects as.
_UNCHOSEN = SessionRole(None, False, "sessions run as the engine's own role (not opened by Store.open)")


# What a refused append tells the person who has to fix the log.
_REPAIR = (
    "; see what is wrong with: qualify log verify; the store's owner can remove rows beyond the last good "
    "signed checkpoint with: qualify log repair"
)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _now() -> datetime:
    return datetime.now(UTC)


def signer_named(signer: NoteSigner, name: str) -> NoteSigner:
    """The same private key under key name `name` (a log signs under its origin, c2sp.org/tlog-checkpoint)."""
    return signer if signer.name == name else NoteSigner(name, signer.private_key)


def recorded_key_name(vkey: str) -> str:
    """The key name of a recorded verifier key (`<name>+<hash>+<key>`)."""
    return vkey.split("+", 1)[0]


def new_log_origin(name: str) -> str:
    """An origin of its own for a new log: `name` (e.g. qualify.local/<hostname>) and a random id, so that
    two logs on one host (even with one log key) never sign checkpoints that could be mistaken for each
    other's. A log keeps the origin it was created with (log_meta)."""
    return f"{name}/{secrets.token_hex(6)}"


class Store(LogReader):
    """An open store. Reads need nothing more; appends need the log's checkpoint signer."""

    def __init__(self, engine: Engine, db_role: SessionRole | None = None) -> None:
        super().__init__(engine)
        if db_role is None:
            db_role = SQLITE_ROLE if engine.dialect.name == "sqlite" else _UNCHOSEN
        # The role this store's sessions run as, and why not the writer role when they cannot (§6).
        self.db_role = db_role
        self._writer = writer(engine)
        # (size, root, frontier subtrees) after this process's last append: the next append reuses
        # them when the log's head is still that size and root, instead of reading merkle_nodes.
        self._frontier: tuple[int, bytes, dict[tuple[int, int], bytes]] | None = None
        self._signer: NoteSigner | None = None
        self._origin: str | None = None
        # Whether the signer's name and the origin are the log's own (read from log_meta), not yet the
        # provisional ones of a log that did not exist when set_log_signer was called.
        self._bound = False
        # Key history replayed from key entries below the given index (see _history).
        self._keys_cache: tuple[KeyHistory, int] | None = None
        # How long an append waits for the single-writer lock before LockTimeout (None: the default,
        # DEFAULT_LOCK_TIMEOUT_S). A caller with a deadline (qualify run --timeout) sets what is left.
        # A host also waits at most this long for the sequencer to place its entry.
        self.lock_timeout_s: float | None = None
        # A fleet host (no log key): the log's verifier key; appends go through the sequencer's queue.
        self.host_verifier: NoteVerifier | None = None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        url: str,
        *,
        log_signer: NoteSigner | None = None,
        origin: str | None = None,
        create: bool = True,
        lock_timeout_s: float | None = None,
    ) -> Store:
        """Connect and bring the schema to head (as the connecting user: migrations need the owner), then
        run every later session as the non-owner writer role where it can (`db_role` says which role and,
        if not the writer role, why). With `create=False`, a store that does not exist yet is a StoreError
        instead of being created (for read-only commands). `lock_timeout_s` bounds each append's wait for
        the single-writer lock (default DEFAULT_LOCK_TIMEOUT_S; see `lock_timeout_s` below)."""
        parsed = parse_url(url)
        engine = create_engine(parsed, create=create)
        try:
            revision = check_connection(engine)
            if revision is None and not create:
                raise MissingStore(
                    f"no qualify store in {shown(parsed)} yet: nothing has been recorded there"
                )
            if revision != SCHEMA_REVISION:
                upgrade(engine)
            db_role = writer_role(engine, grant=True)
            if db_role.writer:
                use_role(engine, WRITER_ROLE)
        except BaseException:
            engine.dispose()
            raise
        store = cls(engine, db_role)
        store.lock_timeout_s = lock_timeout_s
        if log_signer is not None:
            store.set_log_signer(log_signer, origin)
        return store

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return shown(self.engine.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def revision(self) -> str | None:
        return check_connection(self.engine)

    def set_log_signer(
        self, signer: NoteSigner, origin: str | None = None, *, new_origin: str | None = None
    ) -> None:
        """Use `signer`'s private key for checkpoints; refused if the store was started with another key
        (or, with `origin`, under another origin). The signer's key is also the key the read paths trust
        (unless another was set with set_trusted_log_key).

        C2SP tlog-checkpoint: the log's key name is its origin. An existing log signs under the key name
        recorded with it (for logs created before key name = origin, the old name, so that their
        checkpoints keep verifying with the verifier key auditors hold). A log that does not exist yet
        gets the origin `origin`, else `new_origin`, else the signer's name, and signs under that name:
        both are chosen under the writer lock by the first append (_ensure_meta), so that concurrent first
        uses agree on the origin and key name of the one that committed first."""
        meta = self.meta()
        if meta is not None:
            name = recorded_key_name(meta[1])
            signer = signer_named(signer, name)
            if signer.vkey() != meta[1]:
                raise StoreError(
                    f"the log key ({signer.vkey()}) is not this store's log key ({meta[1]}); "
                    "use the log key the store was created with"
                )
            if origin is not None and origin != meta[0]:
                raise StoreError(f"this store's log origin is {meta[0]!r}, not {origin!r}")
            origin = meta[0]
            self._bound = True
        else:
            self._bound = False
            # Provisional until the first append records it under the writer lock (_ensure_meta).
            origin = origin or new_origin or signer.name
            signer = signer_named(signer, origin)
        self._signer, self._origin = signer, origin
        if self._trust is None or self._trust_from_signer:
            self.set_trusted_log_key(signer.verifier(), "the log key this store appends with")
            self._trust_from_signer = True

    def set_host(self, verifier: NoteVerifier) -> None:
        """Append as a fleet host: submit to the sequencer's queue and wait for it, then check the entry's
        inclusion under the checkpoint with `verifier`, the log's verifier key the host holds (it must be
        the key this log records)."""
        meta = self.meta()
        if meta is None:
            raise StoreError(
                "this fleet log has no entries yet: start its sequencer first (qualify log sequence, where "
                "the log key is)"
            )
        if verifier.vkey() != meta[1]:
            raise StoreError(
                f"the log's verifier key you hold ({verifier.vkey()}) is not this store's ({meta[1]}); "
                "check --db and the key you were given"
            )
        self.host_verifier = verifier
        if self._trust is None:
            self.set_trusted_log_key(verifier, "the log's verifier key this host holds")

    def ensure_log(self) -> None:
        """Record the log's identity (origin and verifier key) now, before its first entry, so that hosts
        can check the key they hold against it (the sequencer does this when it starts)."""
        if self.meta() is None:
            self._append([])

    def _host_wait(self) -> float:
        from receipts.sequencer import DEFAULT_WAIT_S

        return DEFAULT_WAIT_S if self.lock_timeout_s is None else max(0.0, self.lock_timeout_s)

    @property
    def log_signer(self) -> NoteSigner | None:
        """The checkpoint signer in use (named for this log), once set_log_signer was called."""
        return self._signer

    # ------------------------------------------------------------------ appending

    def _verified_head(self, head: Head, signer: NoteSigner, origin: str, reader: SqlSubtrees) -> bytes:
        """The root of the log as it stands, after checking that the latest checkpoint is signed by the log
        key, covers every stored entry and matches the stored subtrees. Without this an appender would
        sign a checkpoint over rows planted with a plain INSERT (entries or key-trust records)."""
        idx = head.next
        if idx == 0:
            if head.checkpoint_size is not None:
                raise TamperError(
                    "the log has no entries but holds checkpoints: its entries were removed; nothing "
                    "appended; run: qualify log verify"
                )
            return merkle.EMPTY_ROOT
        size = head.checkpoint_size
        if size != idx or head.note is None:
            if size is not None and size < idx:
                rows = f"log entry {size}" + (f" (and {idx - 1 - size} after it)" if idx - 1 > size else "")
                what = f"{rows} is not covered by a signed checkpoint"
            else:
                what = f"a checkpoint row of size {size} lies beyond the log's {idx} entries"
            raise TamperError(
                f"the log holds entries up to index {idx - 1} but its latest signed checkpoint is of size "
                f"{size}: {what}, written outside the store; nothing appended{_REPAIR}"
            )
        try:
            cp = open_checkpoint(head.note, [signer.verifier()], origin)
        except ReceiptsError as error:
            raise TamperError(
                f"the latest checkpoint (size {idx}) does not verify with the log key ({error}): it was "
                f"written outside the store; nothing appended{_REPAIR}"
            ) from error
        if cp.size != idx or cp.root != merkle.root_from(reader, idx):
            raise TamperError(
                f"the stored Merkle tree of size {idx} is not the one the latest signed checkpoint names; "
                f"nothing appended{_REPAIR}"
            )
        return cp.root

    def _history(self, conn: Connection, size: int, root: bytes, reader: SqlSubtrees) -> KeyHistory:
        """Key history replayed from the log's own key entries (never from the query tables, which a plain
        INSERT can extend), each proven included in the verified tree of `size` leaves with `root`.
        Cached: only key entries appended since the last call are read."""
        cached = self._keys_cache
        history, upto = cached if cached is not None and cached[1] <= size else (KeyHistory(), 0)
        self._keys_cache = None  # until the replay below completes
        try:
            for idx, data in conn.execute(_KEY_ENTRIES, {"start": upto, "end": size}):
                data = bytes(data)
                leaf = merkle.leaf_hash(data)
                proof = reader.run(lambda r, i=idx: merkle.inclusion_proof_from(r, i, size))
                merkle.verify_inclusion(idx, size, leaf, proof, root)
                history.apply(idx, data)
        except (merkle.ProofError, VerificationError) as error:
            raise TamperError(
                f"a key entry of the log does not verify ({error}); nothing appended; run: qualify log verify"
            ) from error
        self._keys_cache = (history, size)
        return history

    def _ensure_meta(self, conn: Connection, signer: NoteSigner) -> tuple[str, NoteSigner]:
        """The log's origin and the signer named for it, read under the writer lock; the first append of a
        new log records them (key name = origin). A log that another process created meanwhile keeps the
        origin and key name that process chose."""
        row = conn.execute(_META).first()
        if row is None:
            # set_log_signer named the signer for this origin (key name = origin, C2SP tlog-checkpoint).
            origin = self._origin or signer.name
            conn.execute(
                sa.insert(LogMeta), {"id": 1, "origin": origin, "vkey": signer.vkey(), "created_at": _now()}
            )
        else:
            # Another process created the log meanwhile: its origin and key name are the log's.
            origin = row.origin
            signer = signer_named(signer, recorded_key_name(row.vkey))
            if row.vkey != signer.vkey():
                raise StoreError(
                    f"the log key is not this store's log key ({row.vkey}); use the store's log key"
                )
        self._signer, self._origin, self._bound = signer, origin, True
        if self._trust is None or self._trust_from_signer:
            self.set_trusted_log_key(signer.verifier(), "the log key this store appends with")
            self._trust_from_signer = True
        return origin, signer

    def _append(
        self,
        pending: Sequence[_Pending] | Callable[[Connection], Sequence[_Pending]],
        *,
        seal_each: bool = True,
        after: AfterFn | None = None,
    ) -> list[Appended]:
        """Append entries in one transaction: all of them, or none.

        `seal_each`: sign a checkpoint after every entry (an embedded append); off, one checkpoint seals
        the whole batch (the sequencer). `pending` may be a function of the open transaction (the
        sequencer takes its queue rows under the writer lock). With `after`, an item whose rows are
        refused (a bad signature, a duplicate) is left out instead of failing the batch, and `after`
        runs in the same transaction with the refused items."""
        signer = self._signer
        if signer is None:
            raise StoreError("appending needs the log's checkpoint key; open the store with log_signer=")
        out: list[Appended] = []
        refused: list[tuple[_Pending, str]] = []
        try:
            with write_transaction(self._writer, self.lock_timeout_s) as conn:
                if self._meta and self._bound:
                    origin = self._meta[0]
                else:
                    origin, signer = self._ensure_meta(conn, signer)
                head = self._head(conn)
                idx = head.next
                reader = SqlSubtrees(conn)
                cached = self._frontier
                if (
                    cached is not None
                    and cached[0] == idx
                    and head.checkpoint_size == idx
                    and cached[1] == head.root
                ):
                    # The head is the one this process signed last: nothing else was appended since.
                    reader.cache.update(cached[2])
                    root = cached[1]
                else:
                    reader.fetch(frontier(idx))
                    root = self._verified_head(head, signer, origin, reader)
                history = self._history(conn, idx, root, reader)
                items = pending(conn) if callable(pending) else pending
                now = _now()
                # The batch's rows, written table by table (one statement each) when a checkpoint seals
                # the whole batch: the insert guards accept rows of any entry not sealed yet.
                bulk: dict[str, list[dict[str, Any]]] = {}

                def flush() -> None:
                    for name, statement in _BULK_ORDER:
                        values = bulk.pop(name, None)
                        if values:
                            if name == "merkle_nodes":
                                values.sort(key=lambda v: (v["level"], v["node_index"]))
                            conn.execute(statement, values)

                for item in items:
                    if not seal_each and item.kind == "approval":
                        flush()  # its relied-on receipts may be earlier entries of this batch
                    try:
                        rows = item.rows(conn, idx, history)
                    except (StoreError, VerificationError, NotFound) as error:
                        if after is None:
                            raise
                        refused.append((item, str(error)))
                        continue
                    leaf = merkle.leaf_hash(item.data)
                    nodes = merkle.new_subtrees(idx, leaf, reader)
                    reader.add(nodes)
                    size = idx + 1
                    if seal_each:
                        now = _now()
                    entry = {
                        "idx": idx,
                        "kind": item.kind,
                        "envelope": item.data,
                        "leaf_hash": leaf,
                        "created_at": now,
                    }
                    node_rows = [{"level": lv, "node_index": ix, "hash": h} for lv, ix, h in nodes]
                    if seal_each:
                        conn.execute(_INSERT_ENTRY, entry)
                        conn.execute(_INSERT_NODES, node_rows)
                    else:
                        bulk.setdefault("log_entries", []).append(entry)
                        bulk.setdefault("merkle_nodes", []).extend(node_rows)
                    for table, values in rows:
                        if table is APPROVALS:
                            # An approval row carries its entry's append time (the batch's).
                            values = [{**v, "created_at": now} for v in values]
                        if values and seal_each:
                            conn.execute(_inserts(table), values)
                        elif values:
                            bulk.setdefault(table.name, []).extend(values)
                    if item.kind in ("key-trust", "key-revoke"):
                        history.apply(idx, item.data)  # later items of the batch are judged by it
                    note = ""
                    if seal_each:
                        root = merkle.root_from(reader, size)
                        note = sign_checkpoint(Checkpoint(origin, size, root), signer)
                        conn.execute(
                            _INSERT_CHECKPOINT, {"size": size, "root": root, "note": note, "created_at": now}
                        )
                    out.append(Appended(idx=idx, kind=item.kind, checkpoint=note))
                    idx = size
                flush()
                if not seal_each and out:
                    # One signed checkpoint for the batch, at the time every entry of it carries.
                    root = merkle.root_from(reader, idx)
                    note = sign_checkpoint(Checkpoint(origin, idx, root), signer)
                    conn.execute(
                        _INSERT_CHECKPOINT, {"size": idx, "root": root, "note": note, "created_at": now}
                    )
                    out = [Appended(a.idx, a.kind, note) for a in out]
                if after is not None:
                    after(conn, refused)
                tip = {key: reader.cache[key] for key in frontier(idx)}
        except sa.exc.IntegrityError as error:
            self._keys_cache = None
            # A row already stands where this append writes (planted outside the store), or an insert guard
            # refused a row: either way the log is not as this store left it.
            cause = str(getattr(error, "orig", error)).strip().splitlines() or ["integrity error"]
            raise TamperError(
                f"the database refused the append ({cause[0]}): rows were written outside "
                f"the store; nothing appended{_REPAIR}"
            ) from error
        except BaseException:
            self._keys_cache = None  # key entries of a rolled-back batch were applied to it
            raise
        # Only after the commit: a rolled-back append must not leave a frontier that never existed.
        self._frontier = (idx, root, tip)
        self._keys_cache = (history, idx)
        if self._meta is None:
            self.meta()
        return out

    def _receipt_pending(
        self, receipt: ParsedReceipt, placed: dict[str, int] | None = None
    ) -> tuple[_Pending, Callable[[], ReceiptRecord]]:
        """The pending append of a receipt. `placed` (the sequencer's batch): the log index of every
        receipt of the batch already in the log, read in one query, and of those the batch places."""
        appended: dict[str, Any] = {}  # index and signer, once the append has placed the receipt

        def rows(
            conn: Connection, idx: int, history: KeyHistory
        ) -> list[tuple[sa.Table, list[dict[str, Any]]]]:
            keyid = history.signers(receipt.envelope, idx, "receipt")[0]
            if placed is None:
                dup = conn.execute(_RECEIPT_AT, {"id": receipt.id}).scalar()
            else:
                dup = placed.get(receipt.id)
            if dup is not None:
                raise StoreError(
                    f"receipt {receipt.id[:16]} is already in the log at index {dup}; nothing appended"
                )
            if placed is not None:
                placed[receipt.id] = idx
            appended.update(idx=idx, keyid=keyid)
            subject_rows = [
                {"receipt_id": receipt.id, "digest": s.digest, "name": s.name} for s in receipt.subjects
            ]
            return [(RECEIPTS, [receipt.row(idx, keyid)]), (SUBJECTS, subject_rows)]

        return _Pending("receipt", receipt.data, rows), lambda: receipt.record(
            appended["idx"], appended["keyid"]
        )

    def _named(self, receipts: list[ParsedReceipt]) -> list[ParsedReceipt]:
        """Receipts whose signatures lack a keyid, stored with the keyid of the trusted key that signed
        them (so the stored envelope verifies with securesystemslib too). Which key is valid is decided
        again under the writer lock, by the same signatures."""
        if all(s.keyid for r in receipts for s in r.envelope.signatures):
            return receipts
        trusted = self.trusted_keys()
        return [
            r
            if all(s.keyid for s in r.envelope.signatures)
            else parse_receipt(dsse.envelope_bytes(dsse.with_keyids(r.envelope, trusted)))
            for r in receipts
        ]

    def append_receipt(self, envelope: dsse.EnvelopeInput | ParsedReceipt) -> ReceiptRecord:
        """Append a signed receipt: its signature must verify with a key valid at its log index. A
        signature without a keyid is stored with the keyid of the trusted key that made it."""
        receipt = envelope if isinstance(envelope, ParsedReceipt) else parse_receipt(envelope)
        receipt = self._named([receipt])[0]
        if self._signer is None and self.host_verifier is not None:
            from receipts import sequencer

            return sequencer.append_as_host(self, receipt.data, self.host_verifier, self._host_wait())
        pending, record = self._receipt_pending(receipt)
        self._append([pending])
        return record()

    def append_receipts(self, envelopes: Sequence[dsse.EnvelopeInput | ParsedReceipt]) -> list[ReceiptRecord]:
        """Append several receipts in one transaction (all or none), e.g. an import from another node."""
        receipts = self._named([e if isinstance(e, ParsedReceipt) else parse_receipt(e) for e in envelopes])
        if len({r.id for r in receipts}) != len(receipts):
            raise StoreError("the same receipt appears twice in the batch; nothing appended")
        if self._signer is None and self.host_verifier is not None:
            from receipts import sequencer

            # Queued together; each placed (or refused) by the sequencer on its own.
            submitted = sequencer.submit_many(self, [("receipt", r.data) for r in receipts])
            for item in submitted:
                sequencer.wait_sequenced(self, item, self._host_wait())
            for item in submitted:
                sequencer.proven(self, item.digest, self.host_verifier)
            return [self.get_receipt(item.digest) for item in submitted]
        prepared = [self._receipt_pending(r) for r in receipts]
        self._append([pending for pending, _ in prepared])
        return [record() for _, record in prepared]

    def append_approval(
        self,
        envelope: dsse.EnvelopeInput,
        *,
        subject: str | None = None,
        decision: str | None = None,
        policy_digest: str | None = None,
        receipt_ids: Sequence[str] | None = None,
        reasons: Sequence[str] | None = None,
    ) -> ApprovalRecord:
        """Append a signed rollout decision, based on receipts already in the log. Its `approvals` row is
        derived from the signed approval statement; fields a caller also passes must equal the signed ones
        (a mismatch is refused and nothing is written)."""
        data = dsse.envelope_bytes(envelope)
        pending, aid = self._approval_pending(
            data,
            subject=subject,
            decision=decision,
            policy_digest=policy_digest,
            receipt_ids=receipt_ids,
            reasons=reasons,
        )
        if self._signer is None and self.host_verifier is not None:
            from receipts import sequencer

            sequencer.wait_sequenced(self, sequencer.submit(self, "approval", data), self._host_wait())
            return self.get_approval(aid)
        self._append([pending])
        return self.get_approval(aid)

    def _approval_pending(
        self,
        data: bytes,
        *,
        subject: str | None = None,
        decision: str | None = None,
        policy_digest: str | None = None,
        receipt_ids: Sequence[str] | None = None,
        reasons: Sequence[str] | None = None,
    ) -> tuple[_Pending, str]:
        """The pending append of a signed approval's bytes, and its id (see append_approval)."""
        parsed = dsse.parse(data)
        signed = approval_rows.signed_fields(parsed)
        given = {
            "subject": subject,
            "decision": decision,
            "policy_digest": policy_digest,
            "receipt_ids": None if receipt_ids is None else list(receipt_ids),
            "reasons": None if reasons is None else list(reasons),
        }
        for name, value in given.items():
            if value is not None and value != signed[name]:
                raise StoreError(
                    f"approval {name} {_short(value)} disagrees with the signed envelope's "
                    f"{_short(signed[name])}; nothing appended; pass the fields of the signed statement"
                )
        relied_on: list[str] = signed["receipt_ids"]
        aid = hashlib.sha256(data).hexdigest()

        def rows(
            conn: Connection, idx: int, history: KeyHistory
        ) -> list[tuple[sa.Table, list[dict[str, Any]]]]:
            keyids = history.signers(parsed, idx, "approval")
            if relied_on:
                found = set(
                    conn.execute(sa.select(ReceiptRow.id).where(ReceiptRow.id.in_(relied_on))).scalars()
                )
                missing = [r for r in relied_on if r not in found]
                if missing:
                    raise NotFound(f"approval refers to receipt {missing[0][:16]} which is not in the log")
            if conn.execute(sa.select(APPROVALS.c.log_idx).where(APPROVALS.c.id == aid)).scalar() is not None:
                raise StoreError(f"approval {aid[:16]} is already in the log; nothing appended")
            row = {"id": aid, "log_idx": idx, **signed, "keyid": keyids[0], "created_at": _now()}
            return [(ApprovalRow.__table__, [row])]

        return _Pending("approval", data, rows), aid

    def _administrator_only(self, what: str) -> None:
        if self._signer is None and self.host_verifier is not None:
            raise StoreError(
                f"{what} a key is an administrator's act: run it where the log key is "
                "(the sequencer's machine), e.g. qualify keys trust FILE --db URL"
            )

    def trust_key(self, key: VerifyingKey, note: str = "") -> KeyInfo:
        """Append a key-trust entry: `key` signs for every entry after it until revoked."""
        self._administrator_only("trusting")
        data = trust_record(key, note, _now())

        def rows(
            conn: Connection, idx: int, history: KeyHistory
        ) -> list[tuple[sa.Table, list[dict[str, Any]]]]:
            if (why := history.trust_refusal(key.keyid)) is not None:
                raise StoreError(why)
            row = {
                "keyid": key.keyid,
                "algorithm": key.algorithm,
                "public_pem": key.public_pem().decode("ascii"),
                "note": note,
                "trusted_at_idx": idx,
            }
            return [(SignerKey.__table__, [row])]

        self._append([_Pending("key-trust", data, rows)])
        return self.key(key.keyid)

    def revoke_key(self, keyid: str, reason: str = "") -> KeyInfo:
        """Append a key-revoke entry: from here on the key signs nothing; earlier entries stay valid."""
        self._administrator_only("revoking")
        full = self.key(keyid).keyid
        data = revoke_record(full, reason, _now())

        def rows(
            conn: Connection, idx: int, history: KeyHistory
        ) -> list[tuple[sa.Table, list[dict[str, Any]]]]:
            if (why := history.revoke_refusal(full)) is not None:
                raise (NotFound if full not in history.keys else StoreError)(why)
            return [(KeyRevocation.__table__, [{"keyid": full, "revoked_at_idx": idx, "reason": reason}])]

        self._append([_Pending("key-revoke", data, rows)])
        return self.key(full)
