"""Reading the store: the log's identity and head, entries, Merkle roots and proofs from the stored
subtrees, checkpoints, keys, receipts and approvals, and verifying one receipt end to end."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from receipts import approval_rows, dsse, merkle, receipt_rows, trusted
from receipts.checkpoint import Checkpoint, NoteVerifier, open_checkpoint
from receipts.errors import NotFound, StoreError, TamperError, VerificationError
from receipts.keylog import KeyHistory
from receipts.keys import VerifyingKey
from receipts.models import (
    APPEND_ONLY_TABLES,
    ApprovalRow,
    CheckpointRow,
    KeyRevocation,
    LogEntry,
    LogMeta,
    MerkleNode,
    ReceiptRow,
    ReceiptSubject,
    SignerKey,
)
from receipts.records import ApprovalRecord, Entry, KeyInfo, ReceiptRecord, ReceiptReport, Subject
from receipts.subtrees import SqlSubtrees
from receipts.trusted import GoodHead

ENTRIES = LogEntry.__table__
RECEIPTS = ReceiptRow.__table__
SUBJECTS = ReceiptSubject.__table__
APPROVALS = ApprovalRow.__table__
_HEX = re.compile(r"[0-9a-f]+")
_MAX_VOUCHED = 200_000  # entries remembered as vouched for (about 20 MB)

# (highest index, latest checkpoint size, its root column, its signed note) in one round trip; built once,
# as the append path runs it thousands of times a second.
_LATEST = (
    sa.select(CheckpointRow.size, CheckpointRow.root, CheckpointRow.note)
    .order_by(CheckpointRow.size.desc())
    .limit(1)
    .subquery()
)
_HEAD = sa.select(
    sa.select(sa.func.max(LogEntry.idx)).scalar_subquery(),
    sa.select(_LATEST.c.size).scalar_subquery(),
    sa.select(_LATEST.c.root).scalar_subquery(),
    sa.select(_LATEST.c.note).scalar_subquery(),
)


# Values per IN list: well under every dialect's bound-parameter limit (SQLite: 32,766).
_IN_CHUNK = 1000


def _chunks(values: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


class Head(NamedTuple):
    """The log's head as stored: the next index, and the latest checkpoint row (not yet verified)."""

    next: int
    checkpoint_size: int | None
    root: bytes | None
    note: str | None


class LogReader:
    """Read access to a store's database; the Store adds appending."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._meta: tuple[str, str] | None = None
        # ((size, root), tree) of the last stored leaves found to hash to a signed checkpoint's root.
        self._leaves: tuple[tuple[int, bytes], merkle.MemoryTree] | None = None
        # The log key the read paths trust (kept outside the database), and where it came from; None:
        # the key recorded in the store (see trusted_log_key).
        self._trust: tuple[NoteVerifier, str] | None = None
        self._trust_from_signer = False  # the trust is the appender's own key (Store.set_log_signer)
        # The last good checkpoint per log key, for the head row it was found under (reads re-check only
        # the head).
        self._good: dict[str, tuple[tuple[Any, ...], GoodHead]] = {}
        # Key history under the good checkpoint of (size, root).
        self._served_keys: tuple[int, bytes, KeyHistory] | None = None
        # Entries vouched for under the good checkpoint of (size, root): index -> (bytes digest, signers).
        self._vouched: tuple[int, bytes, dict[int, tuple[bytes, frozenset[str]]]] | None = None

    # ------------------------------------------------------------------ the log's identity

    def meta(self, refresh: bool = False) -> tuple[str, str] | None:
        """(origin, checkpoint verifier key) once the first entry was appended, else None. Cached, as it
        never changes; `refresh` reads it again (verification trusts nothing it read before)."""
        if self._meta is None or refresh:
            with self.engine.connect() as conn:
                row = conn.execute(sa.select(LogMeta.origin, LogMeta.vkey)).first()
            if row is not None:
                self._meta = (row.origin, row.vkey)
        return self._meta

    @property
    def origin(self) -> str | None:
        meta = self.meta()
        return meta[0] if meta else None

    def log_verifier(self) -> NoteVerifier:
        """The checkpoint verifier recorded in the store (trust it only as far as you trust the DB)."""
        meta = self.meta()
        if meta is None:
            raise NotFound("the log is empty: it has no checkpoint signer yet")
        return NoteVerifier.from_vkey(meta[1])

    def set_trusted_log_key(self, verifier: NoteVerifier, source: str) -> None:
        """The log key every read path checks checkpoints with (a copy kept outside the database)."""
        self._trust = (verifier, source)
        self._trust_from_signer = False

    def trusted_log_key(self) -> tuple[NoteVerifier, str]:
        """The key set with set_trusted_log_key, else (weakest) the one recorded in the store."""
        if self._trust is not None:
            return self._trust
        return self.log_verifier(), "the log key recorded in the store"

    # ------------------------------------------------------------------ what may be served

    def good_head(
        self, conn: Connection | None = None, verifier: tuple[NoteVerifier, str] | None = None
    ) -> GoodHead:
        """The last stored checkpoint that verifies with the trusted log key and names the stored tree
        (see receipts.trusted): every read path serves only what it covers. Verified once per head: a
        later call that finds the same head row reuses it."""
        if conn is None:
            with self.engine.connect() as own:
                return self.good_head(own, verifier)
        head = self._head(conn)
        if head.next == 0:
            return GoodHead(0, merkle.EMPTY_ROOT, None, 0, head.checkpoint_size, "an empty log")
        key, source = verifier or self.trusted_log_key()
        cache_key = (*head, key.vkey())
        cached = self._good.get(key.vkey())
        if cached is not None and cached[0] == cache_key:
            return cached[1]
        good = trusted.last_good(conn, key, self.origin, head.next, source)
        self._good[key.vkey()] = (cache_key, good)
        return good

    def good_checkpoint(self) -> str:
        """The signed note of the last good checkpoint (NotFound for an empty log)."""
        note = self.good_head().note
        if note is None:
            raise NotFound("the log is empty: there is no checkpoint yet")
        return note

    def verified_checkpoint(self, size: int) -> tuple[str, Checkpoint]:
        """The stored checkpoint of `size` once it verifies with the trusted log key and names the stored
        tree, and its size is at most the last good one's (NotFound / TamperError otherwise)."""
        with self.engine.connect() as conn:
            good = self.good_head(conn)
            if not 0 < size <= good.size:
                raise NotFound(
                    f"no checkpoint of size {size} is served: the last good checkpoint is of size {good.size}"
                )
            if size == good.size and good.note is not None:
                return good.note, open_checkpoint(good.note, [self.trusted_log_key()[0]])
            note = conn.execute(sa.select(CheckpointRow.note).where(CheckpointRow.size == size)).scalar()
            if note is None:
                raise NotFound(f"no checkpoint of size {size} in the store")
            try:
                cp = open_checkpoint(note, [self.trusted_log_key()[0]], self.origin)
            except VerificationError as error:
                raise TamperError(
                    f"the stored checkpoint of size {size} does not verify with the log key ({error}); "
                    "nothing served; run: qualify log verify"
                ) from error
            if cp.size != size or cp.root != SqlSubtrees(conn).run(lambda r: merkle.root_from(r, size)):
                raise TamperError(
                    f"the stored checkpoint of size {size} does not name the stored tree; nothing served; "
                    "run: qualify log verify"
                )
        return note, cp

    def served_history(self, conn: Connection | None = None, good: GoodHead | None = None) -> KeyHistory:
        """Key history from the key entries under the last good checkpoint, each proven included."""
        if conn is None:
            with self.engine.connect() as own:
                return self.served_history(own, good)
        good = good or self.good_head(conn)
        cached = self._served_keys
        if cached is not None and cached[:2] == (good.size, good.root):
            return cached[2]
        history = trusted.key_history(conn, good)
        self._served_keys = (good.size, good.root, history)
        return history

    def _vouch(
        self, conn: Connection, items: Sequence[tuple[int, bytes, str, str]], good: GoodHead | None = None
    ) -> GoodHead:
        """Refuse (TamperError) unless every (index, bytes, kind, keyid) is covered by the last good
        checkpoint and signed by a key the log trusted at its index, among them `keyid`. What was vouched
        for is remembered (by index and bytes digest) while the good checkpoint stays, or grows by a
        consistency proof: a repeated read (the API) checks the bytes only."""
        good = good or self.good_head(conn)
        vouched = self._vouched_under(conn, good)
        digests = [hashlib.sha256(data).digest() for _, data, _, _ in items]
        todo = [
            (item, digest)
            for item, digest in zip(items, digests, strict=True)
            if vouched.get(item[0], (None,))[0] != digest
        ]
        if todo:
            trusted.check_included(conn, good, [(item[0], item[1]) for item, _ in todo])
            history = self.served_history(conn, good)
            if len(vouched) > _MAX_VOUCHED:
                vouched.clear()
            for (idx, data, kind, _), digest in todo:
                vouched[idx] = (digest, frozenset(trusted.signers(history, idx, data, kind)))
        for idx, _, kind, keyid in items:
            if keyid not in vouched[idx][1]:
                raise TamperError(
                    f"the {kind} at log index {idx} is not signed by key {keyid[:16]}, which its query "
                    "row names: the row was edited outside the store; nothing served; run: qualify log "
                    "verify"
                )
        return good

    def _vouched_under(self, conn: Connection, good: GoodHead) -> dict[int, tuple[bytes, frozenset[str]]]:
        """The entries vouched for under `good`: those vouched for under an earlier good checkpoint stay
        when the stored tree proves the new one extends it (RFC 9162 consistency); else none."""
        cached = self._vouched
        if cached is not None and cached[:2] == (good.size, good.root):
            return cached[2]
        kept: dict[int, tuple[bytes, frozenset[str]]] = {}
        if cached is not None and 0 < cached[0] <= good.size:
            size, root, entries = cached
            try:
                proof = SqlSubtrees(conn).run(lambda r: merkle.consistency_proof_from(r, size, good.size))
                merkle.verify_consistency(size, good.size, proof, root, good.root)
                kept = entries
            except (merkle.ProofError, TamperError):
                kept = {}
        self._vouched = (good.size, good.root, kept)
        return kept

    # ------------------------------------------------------------------ the head

    def _head(self, conn: Connection) -> Head:
        last, size, root, note = conn.execute(_HEAD).one()
        return Head(0 if last is None else last + 1, size, None if root is None else bytes(root), note)

    # ------------------------------------------------------------------ reading

    def size(self) -> int:
        with self.engine.connect() as conn:
            return self._head(conn)[0]

    def entry(self, idx: int) -> Entry:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(ENTRIES).where(ENTRIES.c.idx == idx)).first()
        if row is None:
            raise NotFound(f"no log entry at index {idx}")
        return Entry(row.idx, row.kind, bytes(row.envelope), bytes(row.leaf_hash), row.created_at)

    def iter_entries(self, kind: str | None = None, batch: int = 5000) -> Iterator[Entry]:
        """Every entry in index order (optionally of one kind), read in batches."""
        start = 0
        while True:
            query = sa.select(ENTRIES).where(ENTRIES.c.idx >= start).order_by(ENTRIES.c.idx).limit(batch)
            if kind is not None:
                query = query.where(ENTRIES.c.kind == kind)
            with self.engine.connect() as conn:
                rows = conn.execute(query).all()
            for row in rows:
                yield Entry(row.idx, row.kind, bytes(row.envelope), bytes(row.leaf_hash), row.created_at)
            if len(rows) < batch:
                return
            start = rows[-1].idx + 1

    def _size_arg(self, conn: Connection, size: int | None) -> int:
        current = self._head(conn)[0]
        if size is None:
            return current
        if not 0 <= size <= current:
            raise NotFound(f"the log has {current} entries; there is no tree of size {size}")
        return size

    def root(self, size: int | None = None) -> bytes:
        with self.engine.connect() as conn:
            n = self._size_arg(conn, size)
            return SqlSubtrees(conn).run(lambda r: merkle.root_from(r, n))

    def inclusion_proof(self, idx: int, size: int | None = None) -> list[bytes]:
        with self.engine.connect() as conn:
            n = self._size_arg(conn, size)
            if not 0 <= idx < n:
                raise NotFound(f"no log entry at index {idx} in a tree of size {n}")
            return SqlSubtrees(conn).run(lambda r: merkle.inclusion_proof_from(r, idx, n))

    def consistency_proof(self, size1: int, size2: int | None = None) -> list[bytes]:
        with self.engine.connect() as conn:
            n2 = self._size_arg(conn, size2)
            if not 0 <= size1 <= n2:
                raise NotFound(f"cannot prove consistency from size {size1} to {n2}; pick size1 <= size2")
            return SqlSubtrees(conn).run(lambda r: merkle.consistency_proof_from(r, size1, n2))

    def checkpoint(self, size: int | None = None) -> str:
        """The stored signed checkpoint for `size` (default: the latest)."""
        query = sa.select(CheckpointRow.note)
        query = (
            query.order_by(CheckpointRow.size.desc()).limit(1)
            if size is None
            else query.where(CheckpointRow.size == size)
        )
        with self.engine.connect() as conn:
            note = conn.execute(query).scalar()
        if note is None:
            raise NotFound(
                "the log is empty: there is no checkpoint yet"
                if size is None
                else f"no checkpoint of size {size}"
            )
        return note

    def latest_checkpoint(self) -> str:
        return self.checkpoint()

    def iter_checkpoints(self, batch: int = 5000) -> Iterator[tuple[int, bytes, str]]:
        """(size, root, note) of every stored checkpoint, by size."""
        start = 0
        table = CheckpointRow.__table__
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    sa.select(table.c.size, table.c.root, table.c.note)
                    .where(table.c.size >= start)
                    .order_by(table.c.size)
                    .limit(batch)
                ).all()
            for size, root, note in rows:
                yield size, bytes(root), note
            if len(rows) < batch:
                return
            start = rows[-1][0] + 1

    # keys

    def signer_keys(self) -> list[KeyInfo]:
        """Every signer key ever trusted, in log order, with its revocation if any: derived from the log's
        own key entries under the last good checkpoint (each proven included in it), never from the query
        tables nor from key entries beyond that checkpoint."""
        return [
            KeyInfo(
                keyid,
                state.key.algorithm,
                state.key.public_pem().decode("ascii"),
                state.note,
                state.trusted_at,
                state.revoked_at,
                reason=state.reason,
            )
            for keyid, state in sorted(self.served_history().keys.items(), key=lambda kv: kv[1].trusted_at)
        ]

    def key_rows(self) -> list[KeyInfo]:
        """The signer_keys/key_revocations query rows as stored (what `log verify` checks against the log)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    SignerKey.keyid,
                    SignerKey.algorithm,
                    SignerKey.public_pem,
                    SignerKey.note,
                    SignerKey.trusted_at_idx,
                    KeyRevocation.revoked_at_idx,
                    KeyRevocation.reason,
                )
                .outerjoin(KeyRevocation, KeyRevocation.keyid == SignerKey.keyid)
                .order_by(SignerKey.trusted_at_idx)
            ).all()
        return [KeyInfo(*row[:6], reason=row[6] or "") for row in rows]

    def key(self, keyid_or_prefix: str) -> KeyInfo:
        """One key by full id or unique prefix (NotFound / StoreError when unknown / ambiguous)."""
        prefix = keyid_or_prefix.strip().lower()
        matches = [k for k in self.signer_keys() if k.keyid.startswith(prefix)] if prefix else []
        if not matches:
            raise NotFound(f"no key {keyid_or_prefix!r} in the log; list keys with: qualify keys list")
        if len(matches) > 1:
            raise StoreError(
                f"key prefix {keyid_or_prefix!r} is ambiguous ({len(matches)} keys); give more of it"
            )
        return matches[0]

    def trusted_keys(self, at_idx: int | None = None) -> dict[str, VerifyingKey]:
        """Keys that may sign the entry at `at_idx` (default: the next entry), from the log's key entries
        under the last good checkpoint (a key-trust entry no good checkpoint covers trusts nothing)."""
        with self.engine.connect() as conn:
            good = self.good_head(conn)
            return self.served_history(conn, good).valid_at(good.size if at_idx is None else at_idx)

    def key_history(self) -> KeyHistory:
        """Key history replayed from every stored key entry (not from the query tables), verified by
        nothing: for whole-log checks; what is served uses served_history."""
        history = KeyHistory()
        query = (
            sa.select(ENTRIES.c.idx, ENTRIES.c.envelope)
            .where(ENTRIES.c.kind.in_(("key-trust", "key-revoke")))
            .order_by(ENTRIES.c.idx)
        )
        with self.engine.connect() as conn:
            for idx, data in conn.execute(query):
                history.apply(idx, bytes(data))
        return history

    # receipts

    def _records(self, conn: Connection, rows: Sequence[Any], envelopes: bool = False) -> list[ReceiptRecord]:
        if not rows:
            return []
        ids = [r.id for r in rows]
        subjects: dict[str, list[Subject]] = {i: [] for i in ids}
        for chunk in _chunks(ids):
            for rid, digest, name in conn.execute(
                sa.select(SUBJECTS.c.receipt_id, SUBJECTS.c.digest, SUBJECTS.c.name).where(
                    SUBJECTS.c.receipt_id.in_(chunk)
                )
            ):
                subjects[rid].append(Subject(name=name, digest=digest))
        data: dict[int, bytes] = {}
        if envelopes:
            for chunk in _chunks([r.log_idx for r in rows]):
                data.update(
                    (i, bytes(e))
                    for i, e in conn.execute(
                        sa.select(ENTRIES.c.idx, ENTRIES.c.envelope).where(ENTRIES.c.idx.in_(chunk))
                    )
                )
        return [
            ReceiptRecord(
                id=r.id,
                log_idx=r.log_idx,
                verdict=r.verdict,
                target=r.target,
                host=r.host,
                started_at=r.started_at,
                finished_at=r.finished_at,
                keyid=r.keyid,
                subjects=tuple(sorted(subjects[r.id], key=lambda s: s.digest)),
                predicate=r.predicate,
                envelope=data.get(r.log_idx),
            )
            for r in rows
        ]

    def list_receipts(
        self,
        verdict: str | None = None,
        since: datetime | None = None,
        subject: str | None = None,
        limit: int | None = 100,
        offset: int = 0,
        *,
        checked: bool = False,
    ) -> list[ReceiptRecord]:
        """Receipts in log order, filtered by verdict, finish time (>= since) and subject digest. With
        `checked`, only rows the last good checkpoint covers are listed, each checked against its log
        entry, signature and inclusion as get_receipt does (TamperError names the first that fails): for
        listings shown to people; callers that verify every receipt themselves (approve) leave it off."""
        query = sa.select(RECEIPTS).order_by(RECEIPTS.c.log_idx)
        if verdict is not None:
            query = query.where(RECEIPTS.c.verdict == verdict)
        if since is not None:
            query = query.where(RECEIPTS.c.finished_at >= since)
        if subject is not None:
            digest = subject if ":" in subject else f"sha256:{subject}"
            query = query.where(
                RECEIPTS.c.id.in_(sa.select(SUBJECTS.c.receipt_id).where(SUBJECTS.c.digest == digest))
            )
        query = query.offset(offset)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            good = self.good_head(conn) if checked else None
            if good is not None:  # only what the last good checkpoint covers is shown
                query = query.where(RECEIPTS.c.log_idx < good.size)
            records = self._records(conn, conn.execute(query).all(), envelopes=checked)
            return self._checked(conn, records, good) if checked else records

    def _checked(
        self, conn: sa.Connection, records: list[ReceiptRecord], good: GoodHead | None = None
    ) -> list[ReceiptRecord]:
        """Each record's query row checked against its log entry, and the entry against its signature and
        the last good checkpoint (TamperError names the first that fails); records carry their bytes."""
        if not records:
            return records
        entries = {
            row.idx: row
            for row in conn.execute(
                sa.select(ENTRIES.c.idx, ENTRIES.c.kind, ENTRIES.c.leaf_hash).where(
                    ENTRIES.c.idx.in_([r.log_idx for r in records])
                )
            )
        }
        for record in records:
            receipt_rows.check_served(record, entries.get(record.log_idx))
        self._vouch(conn, [(r.log_idx, r.envelope or b"", "receipt", r.keyid) for r in records], good)
        return records

    def find_receipts(
        self,
        *,
        verdict: str | None = None,
        since: datetime | None = None,
        subject: str | None = None,
        host: str | None = None,
        limit: int | None = 20,
        offset: int = 0,
    ) -> tuple[list[ReceiptRecord], int]:
        """Receipts newest first (by log index) matching every filter given, from `offset`, at most `limit`;
        and how many match in all. Filters and count run in SQL on the query tables; each row served is
        checked against its log entry first."""
        where = []
        if verdict is not None:
            where.append(RECEIPTS.c.verdict == verdict)
        if since is not None:
            where.append(RECEIPTS.c.finished_at >= since)
        if host is not None:
            where.append(RECEIPTS.c.host == host)
        if subject is not None:
            digest = subject if ":" in subject else f"sha256:{subject}"
            where.append(
                RECEIPTS.c.id.in_(sa.select(SUBJECTS.c.receipt_id).where(SUBJECTS.c.digest == digest))
            )
        query = sa.select(RECEIPTS).where(*where).order_by(RECEIPTS.c.log_idx.desc()).offset(offset)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            # Only what the last good checkpoint covers (rows beyond it were written outside the store).
            good = self.good_head(conn)
            where.append(RECEIPTS.c.log_idx < good.size)
            query = query.where(where[-1])
            total = conn.execute(sa.select(sa.func.count()).select_from(RECEIPTS).where(*where)).scalar_one()
            rows = conn.execute(query).all()
            return self._checked(conn, self._records(conn, rows, envelopes=True), good), total

    def receipt_at(self, log_idx: int) -> ReceiptRecord:
        """The receipt at a log index, with its envelope bytes (NotFound when that entry is no receipt)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(RECEIPTS).where(RECEIPTS.c.log_idx == log_idx)).all()
            if not rows:
                kind = conn.execute(sa.select(ENTRIES.c.kind).where(ENTRIES.c.idx == log_idx)).scalar()
                raise NotFound(
                    f"log index {log_idx} is a {kind} entry, not a receipt"
                    if kind
                    else f"no log entry at index {log_idx}; list receipts with: qualify receipts list"
                )
            return self._checked(conn, self._records(conn, rows, envelopes=True))[0]

    def get_receipt(self, id_or_prefix: str, *, checked: bool = True) -> ReceiptRecord:
        """One receipt, with its envelope bytes, by id or unique id prefix (at least 4 hex digits). Its
        query row is checked against its log entry first (TamperError when they disagree); `checked=False`
        is for verify_receipt, which judges the signed bytes themselves (a row pointing at other bytes is
        a failed check there). A checked receipt is also signed by a key the log trusted at its index and
        covered by the last good checkpoint (receipts.trusted), or it is not served."""
        prefix = id_or_prefix.strip().lower()
        if prefix.startswith("sha256:"):
            prefix = prefix[len("sha256:") :]
        if len(prefix) < 4 or len(prefix) > 64 or not _HEX.fullmatch(prefix):
            raise NotFound(f"{id_or_prefix!r} is not a receipt id; give at least 4 hex digits of one")
        with self.engine.connect() as conn:
            # A full id is looked up by the primary key; only a prefix typed by a person needs LIKE.
            match = RECEIPTS.c.id == prefix if len(prefix) == 64 else RECEIPTS.c.id.like(prefix + "%")
            rows = conn.execute(sa.select(RECEIPTS).where(match).limit(2)).all()
            if not rows:
                raise NotFound(
                    f"no receipt {id_or_prefix!r} in the store; list them with: qualify receipts list"
                )
            if len(rows) > 1:
                raise StoreError(f"receipt id prefix {id_or_prefix!r} is ambiguous; give more digits")
            record = self._records(conn, rows, envelopes=True)[0]
            kind = conn.execute(
                sa.select(ENTRIES.c.kind, ENTRIES.c.leaf_hash).where(ENTRIES.c.idx == record.log_idx)
            ).first()
            if checked:
                receipt_rows.check_served(record, kind)
                self._vouch(conn, [(record.log_idx, record.envelope or b"", "receipt", record.keyid)])
        return record

    def get_approval(self, approval_id: str) -> ApprovalRecord:
        found = self._approvals(APPROVALS.c.id == approval_id)
        if not found:
            raise NotFound(f"no approval {approval_id!r} in the store")
        return found[0]

    def list_approvals(
        self,
        subject: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        *,
        newest_first: bool = False,
    ) -> list[ApprovalRecord]:
        """Rollout decisions in log order (or newest first), optionally about one subject; `limit` (None:
        all) from `offset`."""
        condition = None if subject is None else APPROVALS.c.subject == subject
        return self._approvals(condition, limit, offset, newest_first=newest_first)

    def _approvals(
        self, condition: Any, limit: int | None = None, offset: int = 0, *, newest_first: bool = False
    ) -> list[ApprovalRecord]:
        """Approval records as their signed statements give them (each row is checked against its log
        entry first: TamperError names a row that points at other bytes)."""
        query = (
            sa.select(APPROVALS, ENTRIES.c.kind, ENTRIES.c.envelope)
            .join(ENTRIES, ENTRIES.c.idx == APPROVALS.c.log_idx, isouter=True)
            .order_by(APPROVALS.c.log_idx.desc() if newest_first else APPROVALS.c.log_idx)
        )
        if condition is not None:
            query = query.where(condition)
        if offset:
            query = query.offset(offset)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            good = self.good_head(conn)
            rows = conn.execute(query.where(APPROVALS.c.log_idx < good.size)).all()
            served = [approval_rows.served(r) for r in rows]
            self._vouch(conn, [(r.log_idx, bytes(r.envelope), "approval", r.keyid) for r in rows], good)
        return served

    def counts(self) -> dict[str, int]:
        """Rows per table (for status output and for tests that check nothing was written)."""
        with self.engine.connect() as conn:
            return {
                t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in APPEND_ONLY_TABLES
            }

    # ------------------------------------------------------------------ verifying one receipt

    def verify_receipt(
        self,
        id_or_prefix: str,
        verifiers: Sequence[NoteVerifier] | None = None,
        history: KeyHistory | None = None,
        *,
        check_row: bool = True,
    ) -> ReceiptReport:
        """Check one receipt end to end: its bytes and id, its query row against them (unless `check_row`
        is off: approve judges the signed bytes themselves), its signature against
        the key history at its index, and its inclusion under the last good checkpoint: the latest stored
        one that verifies with the log key (`verifiers`, default: the trusted log key, see
        trusted_log_key) and names the stored tree. `report.notice` says when rows beyond it exist."""
        record = self.get_receipt(id_or_prefix, checked=False)
        return self.verify_receipts([record], verifiers, history, check_row=check_row)[0][0]

    def verify_receipts(
        self,
        records: Sequence[ReceiptRecord],
        verifiers: Sequence[NoteVerifier] | None = None,
        history: KeyHistory | None = None,
        *,
        good: GoodHead | None = None,
        check_row: bool = True,
    ) -> list[tuple[ReceiptReport, bytes | None]]:
        """verify_receipt for many receipts at once, each with its verified envelope bytes (None when it
        does not verify). The last good checkpoint (the latest stored one that verifies with `verifiers`,
        default the trusted log key, and names the stored tree) is found once for all of them; entries
        and the subtrees their proofs need are read in a few batched queries, not per receipt. `good`:
        the last good checkpoint to verify against, e.g. one found once for a whole decision; `history`
        (default: the key history under it, each key entry proven included); `check_row` as in
        verify_receipt."""
        given = (verifiers[0], "the log key given to verify with") if verifiers else None
        out: list[tuple[ReceiptReport, bytes | None]] = []
        with self.engine.connect() as conn:
            cp_problem = None
            try:
                if good is None:
                    good = self.good_head(conn, given)
                if history is None:
                    history = self.served_history(conn, good)
            except (VerificationError, TamperError, NotFound) as error:
                good, cp_problem = None, str(error)
            notice = None if good is None else good.notice()
            reader: Any = SqlSubtrees(conn)
            if good is not None and good.size and len(records) * max(1, good.size.bit_length()) >= good.size:
                # Receipts are a large part of the log: read its leaves once and rebuild the tree in
                # memory (proofs then need no queries); used only if it has the signed root.
                cached = self._leaves
                if cached is not None and cached[0] == (good.size, good.root):
                    reader = cached[1]  # the same signed tree as a call before (a decision's steps)
                else:
                    whole = self._leaf_tree(conn, good.size)
                    if whole is not None and whole.root(good.size) == good.root:
                        reader = whole
                        self._leaves = ((good.size, good.root), whole)
            for chunk in _chunks(records, 500):
                entries = {
                    row.idx: row
                    for row in conn.execute(
                        sa.select(
                            ENTRIES.c.idx, ENTRIES.c.kind, ENTRIES.c.envelope, ENTRIES.c.leaf_hash
                        ).where(ENTRIES.c.idx.in_([r.log_idx for r in chunk]))
                    )
                }
                if good is not None and isinstance(reader, SqlSubtrees):
                    # One dry run over the chunk's proofs, then their subtrees in batched queries.
                    wanted = [r.log_idx for r in chunk if r.log_idx in entries and r.log_idx < good.size]
                    size = good.size
                    reader.prefetch(
                        lambda rd, w=wanted, n=size: [merkle.inclusion_proof_from(rd, i, n) for i in w]
                    )
                for record in chunk:
                    report, envelope = self._verify_one(
                        record, entries.get(record.log_idx), history, good, cp_problem, reader, check_row
                    )
                    report.notice = notice
                    out.append((report, envelope))
                if isinstance(reader, SqlSubtrees) and len(reader.cache) > 200_000:
                    reader.cache.clear()
        return out

    @staticmethod
    def _leaf_tree(conn: Connection, size: int) -> merkle.MemoryTree | None:
        """The tree of the first `size` stored leaves (level-0 subtrees), or None when one is missing."""
        tree = merkle.MemoryTree()
        nodes = MerkleNode.__table__
        query = (
            sa.select(nodes.c.node_index, nodes.c.hash)
            .where(nodes.c.level == 0, nodes.c.node_index < size)
            .order_by(nodes.c.node_index)
        )
        for index, digest in conn.execute(query):
            if index != tree.size or len(digest) != merkle.HASH_SIZE:
                return None
            tree.append(bytes(digest))
        return tree if tree.size == size else None

    @staticmethod
    def _verify_one(
        record: ReceiptRecord,
        entry: Any,
        history: KeyHistory | None,
        good: GoodHead | None,
        cp_problem: str | None,
        reader: merkle.SubtreeReader,
        check_row: bool = True,
    ) -> tuple[ReceiptReport, bytes | None]:
        report = ReceiptReport(id=record.id, log_idx=record.log_idx)
        try:
            if entry is None:
                raise NotFound(f"no log entry at index {record.log_idx}")
            envelope, leaf = bytes(entry.envelope), bytes(entry.leaf_hash)
            report.checks["id_matches_bytes"] = hashlib.sha256(envelope).hexdigest() == record.id
            report.checks["leaf_hash"] = merkle.leaf_hash(envelope) == leaf
            if not all(report.checks.values()):
                raise TamperError(f"receipt {record.id[:16]}: stored bytes do not match its id or leaf hash")
            row_problem = None
            if check_row:
                try:
                    receipt_rows.check_served(dataclasses.replace(record, envelope=envelope), entry)
                except TamperError as error:
                    row_problem = str(error)
                report.checks["query_row"] = row_problem is None
            if good is None or history is None:
                raise VerificationError(cp_problem or "no checkpoint verifies with the log key")
            parsed = dsse.parse(envelope)
            report.keyid = history.signers(parsed, entry.idx, "receipt")[0]
            report.checks["signature"] = True
            report.checkpoint_size = good.size
            report.checks["checkpoint_signature"] = True
            if not 0 <= entry.idx < good.size:
                raise TamperError(
                    f"log index {entry.idx} lies beyond the last checkpoint that verifies with the log key "
                    f"(size {good.size}): it was written outside the store; {trusted.NOT_SERVED}"
                )
            proof = merkle.inclusion_proof_from(reader, entry.idx, good.size)
            merkle.verify_inclusion(entry.idx, good.size, leaf, proof, good.root)
            report.checks["inclusion"] = True
            report.problem = row_problem
        except (VerificationError, TamperError, merkle.ProofError, NotFound) as error:
            report.problem = str(error)
            return report, None
        return report, envelope
