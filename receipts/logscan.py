"""One slice of the log checked on its own, so that large logs are verified in parallel worker processes:
leaf hashes recomputed from the stored bytes, envelope signatures against the key history, checkpoint
notes against the log key, and the stored Merkle subtrees that lie inside the slice.

Only plain data crosses the process boundary; a worker opens its own database connection.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import Counter
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.engine import Engine

from receipts import dsse, merkle, receipt_rows
from receipts.checkpoint import Checkpoint, NoteSigner, NoteVerifier, open_checkpoint
from receipts.errors import ReceiptsError
from receipts.keylog import KeyHistory
from receipts.keys import VerifyingKey
from receipts.models import CheckpointRow, LogEntry, MerkleNode

# Slices are aligned to a power of two, so every complete subtree up to this level lies inside one slice.
SLICE_LEVEL = 12
SLICE = 1 << SLICE_LEVEL
# Below this many entries a worker pool costs more to start than it saves.
PARALLEL_THRESHOLD = 2 * SLICE

_ENTRIES = LogEntry.__table__
_CHECKPOINTS = CheckpointRow.__table__
_NODES = MerkleNode.__table__

KEY_KINDS = ("key-trust", "key-revoke")

# (keyid, public PEM, trusted_at, revoked_at): a KeyHistory as plain data.
KeyStates = list[tuple[str, bytes, int, int | None]]


@dataclass(frozen=True)
class LogKeys:
    """What checks the checkpoint notes: trusted verifier keys, the origin, and optionally the log's
    own signing seed. With the seed, a note is checked by signing its text again and comparing bytes
    (Ed25519 is deterministic, RFC 8032 5.1.6: equal bytes means a valid signature by that key),
    which costs a third of a verification; any difference falls back to verifying."""

    vkeys: tuple[str, ...]
    origin: str | None
    signer_name: str | None = None
    signer_seed: bytes | None = None


@dataclass
class SliceResult:
    lo: int
    hi: int
    leaves: list[bytes] = field(default_factory=list)  # recomputed, for lo.. up to the first gap
    kinds: Counter[str] = field(default_factory=Counter)
    envelope_ids: dict[int, tuple[str, str]] = field(default_factory=dict)  # idx -> (kind, sha256 hex)
    note_roots: dict[int, bytes] = field(default_factory=dict)  # checkpoint size -> root it signs
    bad_notes: set[int] = field(default_factory=set)  # sizes whose stored checkpoint is not valid
    subtrees: int = 0
    problems: list[tuple[int | None, str]] = field(default_factory=list)


def key_states(history: KeyHistory) -> KeyStates:
    return [(k, s.key.public_pem(), s.trusted_at, s.revoked_at) for k, s in history.keys.items()]


def _history(states: KeyStates) -> KeyHistory:
    history = KeyHistory()
    for _, pem, trusted_at, revoked_at in sorted(states, key=lambda s: s[2]):
        key = VerifyingKey.from_pem(pem)
        history.trust(trusted_at, key)
        if revoked_at is not None:
            history.revoke(revoked_at, key.keyid)
    return history


class _Signatures:
    def __init__(self, states: KeyStates) -> None:
        self.history = _history(states)
        self.cache: dict[tuple[bool, ...], dict[str, VerifyingKey]] = {}

    def check(self, idx: int, data: bytes) -> tuple[dsse.Envelope | None, list[str], str | None]:
        """(parsed envelope, key ids whose signatures verify, problem)."""
        # Validity changes only at key entries: cache the valid set per era between them.
        era = tuple(s.valid_at(idx) for s in self.history.keys.values())
        valid = self.cache.get(era)
        if valid is None:
            valid = self.cache[era] = self.history.valid_at(idx)
        try:
            parsed = dsse.parse(data)
        except ReceiptsError as error:
            return None, [], f"the entry is not a DSSE envelope: {error}"
        try:
            if not valid:
                raise ReceiptsError("no key is trusted at this index")
            keyids = dsse.verified_keyids(parsed, valid)
        except ReceiptsError as error:
            named = ", ".join(s.keyid[:16] for s in parsed.signatures) or "no key id"
            return parsed, [], f"the envelope signature (by {named}) is not valid at this index: {error}"
        return parsed, keyids, None


class _Notes:
    def __init__(self, keys: LogKeys) -> None:
        self.keys = keys
        self.verifiers = [NoteVerifier.from_vkey(v) for v in keys.vkeys]
        self.signer = None
        if keys.signer_seed is not None and keys.signer_name is not None:
            self.signer = NoteSigner(keys.signer_name, Ed25519PrivateKey.from_private_bytes(keys.signer_seed))

    def root(self, size: int, note: str) -> tuple[bytes | None, str | None]:
        """(root the note signs, problem)."""
        try:
            body = note[: note.rfind("\n\n") + 1]
            if self.signer is not None and body and self.signer.sign(body.encode()) == note:
                cp = Checkpoint.parse(body)
                if self.keys.origin is not None and cp.origin != self.keys.origin:
                    raise ReceiptsError(f"it is for log {cp.origin!r}, not {self.keys.origin!r}")
            else:
                cp = open_checkpoint(note, self.verifiers, self.keys.origin)
        except ReceiptsError as error:
            return None, f"the checkpoint note of size {size} does not verify: {error}"
        if cp.size != size:
            return cp.root, f"the checkpoint note says size {cp.size} but is stored as size {size}"
        return cp.root, None


def _subtree_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every complete subtree over `leaves` (aligned at the slice start), level by level."""
    levels = [leaves]
    while len(levels[-1]) >= 2 and len(levels) <= SLICE_LEVEL:
        below = levels[-1]
        levels.append([merkle.node_hash(below[i], below[i + 1]) for i in range(0, len(below) - 1, 2)])
    return levels


def check_slice(source: str | Engine, lo: int, hi: int, states: KeyStates, keys: LogKeys) -> SliceResult:
    """Check entries [lo, hi), checkpoints of sizes (lo, hi], and the subtrees inside [lo, hi)."""
    engine = sa.create_engine(source, poolclass=sa.pool.NullPool) if isinstance(source, str) else source
    result = SliceResult(lo, hi)
    signatures = _Signatures(states)
    notes = _Notes(keys)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(_ENTRIES.c.idx, _ENTRIES.c.kind, _ENTRIES.c.envelope, _ENTRIES.c.leaf_hash)
                .where(_ENTRIES.c.idx >= lo, _ENTRIES.c.idx < hi)
                .order_by(_ENTRIES.c.idx)
            )
            expected = lo
            signed_receipts: dict[int, tuple[dsse.Envelope, list[str]]] = {}
            for idx, kind, data, stored_leaf in rows:
                if idx != expected:
                    result.problems.append(
                        (expected, f"log entries {expected}..{idx - 1} are missing (deleted rows)")
                    )
                    break
                data = bytes(data)
                leaf = merkle.leaf_hash(data)
                if leaf != bytes(stored_leaf):
                    result.problems.append(
                        (idx, "the stored bytes do not hash to the stored leaf hash (edited entry)")
                    )
                result.leaves.append(leaf)
                result.kinds[kind] += 1
                if kind in ("receipt", "approval"):
                    result.envelope_ids[idx] = (kind, hashlib.sha256(data).hexdigest())
                    parsed, keyids, problem = signatures.check(idx, data)
                    if problem is not None:
                        result.problems.append((idx, problem))
                    elif kind == "receipt" and parsed is not None:
                        signed_receipts[idx] = (parsed, keyids)
                elif kind not in KEY_KINDS:
                    # The kind column is not hashed; an entry of no known kind would escape every check.
                    result.problems.append((idx, f"the entry's kind {kind!r} is not a kind this log writes"))
                expected += 1
            else:
                if expected < hi:
                    result.problems.append(
                        (expected, f"log entries {expected}..{hi - 1} are missing (deleted rows)")
                    )
            if signed_receipts:
                result.problems.extend(receipt_rows.check(conn, lo, hi, signed_receipts))
            for size, column_root, note in conn.execute(
                sa.select(_CHECKPOINTS.c.size, _CHECKPOINTS.c.root, _CHECKPOINTS.c.note)
                .where(_CHECKPOINTS.c.size > lo, _CHECKPOINTS.c.size <= hi)
                .order_by(_CHECKPOINTS.c.size)
            ):
                root, problem = notes.root(size, note)
                if problem is None and root != bytes(column_root):
                    problem = f"checkpoint {size}: the root column differs from the signed note"
                if problem is not None:
                    result.problems.append((size - 1, problem))
                    result.bad_notes.add(size)
                elif root is not None:
                    result.note_roots[size] = root
            if len(result.leaves) == hi - lo:
                result.subtrees = _check_subtrees(conn, lo, hi, result)
    finally:
        if isinstance(source, str):
            engine.dispose()
    return result


def _check_subtrees(conn: Any, lo: int, hi: int, result: SliceResult) -> int:
    levels = _subtree_levels(result.leaves)
    stored: dict[tuple[int, int], bytes] = {}
    in_slice = sa.or_(
        *(
            sa.and_(
                _NODES.c.level == level, _NODES.c.node_index >= lo >> level, _NODES.c.node_index < hi >> level
            )
            for level in range(len(levels))
        )
    )
    query = sa.select(_NODES.c.level, _NODES.c.node_index, _NODES.c.hash).where(in_slice)
    for level, index, digest in conn.execute(query):
        stored[(level, index)] = bytes(digest)
    checked = 0
    for level, hashes in enumerate(levels):
        base = lo >> level
        for offset, digest in enumerate(hashes):
            checked += 1
            if stored.get((level, base + offset)) != digest:
                result.problems.append(
                    (
                        (base + offset) << level,
                        f"stored Merkle subtree (level {level}, index {base + offset}) is wrong or missing",
                    )
                )
                return checked
    if len(stored) != checked:
        result.problems.append(
            (lo, f"merkle_nodes holds {len(stored) - checked} unexpected subtrees in {lo}..{hi - 1}")
        )
    return checked


def worker_count(entries: int) -> int:
    if entries < PARALLEL_THRESHOLD:
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return cpus if cpus > 1 else 0


class _Inline(Executor):
    """Runs submitted work at once, in this process (small logs, one CPU)."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(error)
        return future


def executor(workers: int) -> Executor:
    if workers <= 0:
        return _Inline()
    # fork: workers start at once with the modules already imported. A process with other threads
    # (a server) must not fork, so it pays for fresh interpreters instead.
    method = "fork" if threading.active_count() == 1 and sys.platform == "linux" else "spawn"
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context(method))
