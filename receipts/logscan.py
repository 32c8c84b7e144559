"""One slice of the log checked on its own, so that large logs are verified in parallel worker processes:
leaf hashes recomputed from the stored bytes, envelope signatures against the key history, checkpoint
notes against the log key, and the stored Merkle subtrees that lie inside the slice.

Only plain data crosses the process boundary; a worker opens its own database connection.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from binascii import a2b_base64, b2a_base64
from bisect import bisect_right
from collections import Counter
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.engine import Connection, Engine

from receipts import approval_rows, dsse, merkle, receipt_rows
from receipts.checkpoint import Checkpoint, NoteSigner, NoteVerifier, open_checkpoint
from receipts.db import use_role
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

# A worker checks many slices: it opens its engine once (per process, as a forked child must not reuse
# its parent's). NullPool: no connection outlives a slice.
_ENGINES: dict[tuple[int, str, str | None], Engine] = {}

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


def _envelope(data: bytes) -> dsse.Envelope:
    """dsse.parse(data), with a fast path for what the log stores (standard padded base64, a keyid on
    every signature). The fast path decodes only what dsse.parse decodes to the same bytes (strict
    standard base64 is a subset of what it accepts); anything else goes to dsse.parse itself."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return dsse.parse(data)  # raises its own one-line error
    if type(obj) is dict:
        payload_type, payload, raw = obj.get("payloadType"), obj.get("payload"), obj.get("signatures")
        if type(payload_type) is str and payload_type and type(payload) is str and type(raw) is list and raw:
            try:
                signatures = tuple(
                    dsse.Signature(s["keyid"], a2b_base64(s["sig"], strict_mode=True))
                    for s in raw
                    if type(s) is dict and type(s.get("keyid")) is str and type(s.get("sig")) is str
                )
                if len(signatures) == len(raw):
                    return dsse.Envelope(payload_type, a2b_base64(payload, strict_mode=True), signatures)
            except ValueError:  # binascii.Error, or non-ASCII text
                pass
    return dsse.parse(obj)


class _Signatures:
    def __init__(self, states: KeyStates) -> None:
        self.history = _history(states)
        # Which keys are valid changes only where a key becomes valid (the entry after its trust entry)
        # or stops being valid (at its revocation): one valid set per era between those indexes.
        self.changes = sorted(
            {s.trusted_at + 1 for s in self.history.keys.values()}
            | {s.revoked_at for s in self.history.keys.values() if s.revoked_at is not None}
        )
        self.cache: dict[int, dict[str, VerifyingKey]] = {}

    def check(self, idx: int, data: bytes) -> tuple[dsse.Envelope | None, list[str], str | None]:
        """(parsed envelope, key ids whose signatures verify, problem)."""
        era = bisect_right(self.changes, idx)
        valid = self.cache.get(era)
        if valid is None:
            valid = self.cache[era] = self.history.valid_at(idx)
        try:
            parsed = _envelope(data)
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
    """Checks the stored checkpoint notes against the trusted log keys.

    A note as the log writes it (its checkpoint body rebuilt from the stored size and root column, then
    one signature line by a trusted key) is checked directly: the exact text open_checkpoint would accept
    for that body, with the signature verified (or, with the log's seed, re-signed and compared). Any
    other text, and any failure, goes through open_checkpoint, which gives the reason."""

    def __init__(self, keys: LogKeys) -> None:
        self.keys = keys
        self.verifiers = [NoteVerifier.from_vkey(v) for v in keys.vkeys]
        self.signer = None
        if keys.signer_seed is not None and keys.signer_name is not None:
            self.signer = NoteSigner(keys.signer_name, Ed25519PrivateKey.from_private_bytes(keys.signer_seed))
        # The direct check needs an origin that open_checkpoint accepts, and trusted keys that are told
        # apart by name and key hash (two alike make open_note refuse the note as ambiguous).
        idents = [(v.name, v.key_hash) for v in self.verifiers]
        self.prefixes: dict[str, NoteVerifier] = {}
        if keys.origin is not None and len(set(idents)) == len(idents):
            try:
                Checkpoint(keys.origin, 0, merkle.EMPTY_ROOT)
            except ValueError:
                pass
            else:
                self.prefixes = {f"— {v.name} ": v for v in self.verifiers}

    def root(self, size: int, note: str, column_root: bytes) -> tuple[bytes | None, str | None]:
        """(root the note signs, problem); the root column must equal the signed root."""
        if (
            self.prefixes
            and len(column_root) == merkle.HASH_SIZE
            and self._as_written(size, note, column_root)
        ):
            return column_root, None
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
        if cp.root != column_root:
            return cp.root, f"checkpoint {size}: the root column differs from the signed note"
        return cp.root, None

    def _as_written(self, size: int, note: str, column_root: bytes) -> bool:
        body = f"{self.keys.origin}\n{size}\n{b2a_base64(column_root, newline=False).decode()}\n"
        head = len(body)
        if not note.startswith(body) or note[head : head + 3] != "\n— " or not note.endswith("\n"):
            return False
        line = note[head + 1 : -1]
        if "\n" in line:
            return False  # more than one signature line
        name_end = line.find(" ", 2)
        verifier = self.prefixes.get(line[: name_end + 1])
        if verifier is None:
            return False
        if self.signer is not None and self.signer.key_hash == verifier.key_hash:
            return self.signer.sign(body.encode()) == note
        text = line[name_end + 1 :]
        try:
            blob = a2b_base64(text, strict_mode=True)
        except ValueError:
            return False
        if (
            len(blob) != 4 + 64
            or blob[:4] != verifier.key_hash
            or b2a_base64(blob, newline=False) != text.encode()
        ):
            return False
        return verifier.verify(body.encode(), blob[4:])


def _engine(url: str, role: str | None) -> Engine:
    key = (os.getpid(), url, role)
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = sa.create_engine(url, poolclass=sa.pool.NullPool)
        if role is not None:
            use_role(engine, role)  # the worker reads as the store's own sessions do
    return engine


def _subtree_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every complete subtree over `leaves` (aligned at the slice start), level by level."""
    levels = [leaves]
    while len(levels[-1]) >= 2 and len(levels) <= SLICE_LEVEL:
        below = levels[-1]
        levels.append([merkle.node_hash(below[i], below[i + 1]) for i in range(0, len(below) - 1, 2)])
    return levels


def check_slice(
    source: str | Engine, lo: int, hi: int, states: KeyStates, keys: LogKeys, role: str | None = None
) -> SliceResult:
    """Check entries [lo, hi), checkpoints of sizes (lo, hi], and the subtrees inside [lo, hi). `source`
    is the store's engine, or (in a worker process) its URL and the role its sessions run as."""
    engine = _engine(source, role) if isinstance(source, str) else source
    result = SliceResult(lo, hi)
    with engine.connect() as conn:
        signed_receipts, signed_approvals = _check_entries(conn, lo, hi, _Signatures(states), result)
        if signed_receipts:
            result.problems.extend(receipt_rows.check(conn, lo, hi, signed_receipts))
        if signed_approvals:
            result.problems.extend(approval_rows.check(conn, lo, hi, signed_approvals))
        notes = _Notes(keys)
        for size, column_root, note in conn.execute(
            sa.select(_CHECKPOINTS.c.size, _CHECKPOINTS.c.root, _CHECKPOINTS.c.note)
            .where(_CHECKPOINTS.c.size > lo, _CHECKPOINTS.c.size <= hi)
            .order_by(_CHECKPOINTS.c.size)
        ):
            root, problem = notes.root(size, note, bytes(column_root))
            if problem is not None:
                result.problems.append((size - 1, problem))
                result.bad_notes.add(size)
            elif root is not None:
                result.note_roots[size] = root
        if len(result.leaves) == hi - lo:
            result.subtrees = _check_subtrees(conn, lo, hi, result)
    return result


Signed = dict[int, tuple[bytes, list[str]]]  # index -> (statement payload, key ids whose signatures verify)


def _check_entries(
    conn: Connection, lo: int, hi: int, signatures: _Signatures, result: SliceResult
) -> tuple[Signed, Signed]:
    """Leaf hashes, kinds and envelope signatures of entries [lo, hi); returns the receipts and the
    approvals whose signatures verify."""
    sha256, leaves, kinds, envelope_ids, problems = (
        hashlib.sha256,
        result.leaves,
        result.kinds,
        result.envelope_ids,
        result.problems,
    )
    signed_receipts: Signed = {}
    signed_approvals: Signed = {}
    expected = lo
    rows = conn.execute(
        sa.select(_ENTRIES.c.idx, _ENTRIES.c.kind, _ENTRIES.c.envelope, _ENTRIES.c.leaf_hash)
        .where(_ENTRIES.c.idx >= lo, _ENTRIES.c.idx < hi)
        .order_by(_ENTRIES.c.idx)
    )
    for idx, kind, data, stored_leaf in rows:
        if idx != expected:
            problems.append((expected, f"log entries {expected}..{idx - 1} are missing (deleted rows)"))
            break
        data = bytes(data)
        leaf = sha256(b"\x00" + data).digest()  # merkle.leaf_hash, inlined: it runs for every entry
        if leaf != bytes(stored_leaf):
            problems.append((idx, "the stored bytes do not hash to the stored leaf hash (edited entry)"))
        leaves.append(leaf)
        kinds[kind] += 1
        if kind == "receipt" or kind == "approval":
            envelope_ids[idx] = (kind, sha256(data).hexdigest())
            parsed, keyids, problem = signatures.check(idx, data)
            if problem is not None:
                problems.append((idx, problem))
            elif parsed is not None:
                (signed_receipts if kind == "receipt" else signed_approvals)[idx] = (parsed.payload, keyids)
        elif kind not in KEY_KINDS:
            # The kind column is not hashed; an entry of no known kind would escape every check.
            problems.append((idx, f"the entry's kind {kind!r} is not a kind this log writes"))
        expected += 1
    else:
        if expected < hi:
            problems.append((expected, f"log entries {expected}..{hi - 1} are missing (deleted rows)"))
    return signed_receipts, signed_approvals


def _check_subtrees(conn: Any, lo: int, hi: int, result: SliceResult) -> int:
    levels = _subtree_levels(result.leaves)
    # Per level, node index -> hash (plain int keys: nothing for the cycle collector to walk).
    stored: list[dict[int, bytes]] = [{} for _ in levels]
    in_slice = sa.or_(
        *(
            sa.and_(
                _NODES.c.level == level, _NODES.c.node_index >= lo >> level, _NODES.c.node_index < hi >> level
            )
            for level in range(len(levels))
        )
    )
    query = sa.select(_NODES.c.level, _NODES.c.node_index, _NODES.c.hash).where(in_slice)
    found = 0
    for level, index, digest in conn.execute(query):
        stored[level][index] = bytes(digest)
        found += 1
    checked = 0
    for level, hashes in enumerate(levels):
        base, at_level = lo >> level, stored[level]
        for offset, digest in enumerate(hashes):
            checked += 1
            if at_level.get(base + offset) != digest:
                result.problems.append(
                    (
                        (base + offset) << level,
                        f"stored Merkle subtree (level {level}, index {base + offset}) is wrong or missing",
                    )
                )
                return checked
    if found != checked:
        result.problems.append(
            (lo, f"merkle_nodes holds {found - checked} unexpected subtrees in {lo}..{hi - 1}")
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
