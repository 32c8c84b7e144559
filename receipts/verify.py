"""Whole-log verification: recompute every leaf and the tree from the stored bytes alone, check every
signature against the key history, every stored checkpoint and subtree, the query tables, and
consistency with a checkpoint kept outside the database. Any discrepancy is a TamperError naming the
first bad index.

Slices of the log are checked in parallel (receipts.logscan); this module rebuilds the tree from the
slices' leaf hashes, in order, and compares it with the signed checkpoints.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from receipts import logscan, merkle, repair, time_rows
from receipts.checkpoint import Checkpoint, NoteSigner, NoteVerifier, open_checkpoint
from receipts.errors import ReceiptsError, TamperError
from receipts.keylog import KeyHistory
from receipts.models import ApprovalRow, LogEntry, LogRepair, MerkleNode, ReceiptRow

if TYPE_CHECKING:
    from receipts.records import KeyInfo
    from receipts.store import Store

MAX_PROBLEMS = 50

_COUNT_AND_MAX = sa.text("SELECT count(*), max(idx) FROM log_entries")
# The end of a gapless log (gaps are reported separately), counted once (a count walks the whole table)
# in the same statement as the rows beyond it.
_ORPHANS = sa.text(
    "SELECT e.n, (SELECT count(*) FROM checkpoints WHERE size > e.n OR size < 1), "
    "(SELECT max(size) FROM checkpoints WHERE size > e.n), "
    "(SELECT count(*) FROM merkle_nodes WHERE ((node_index + 1) << level) > e.n) "
    "FROM (SELECT count(*) AS n FROM log_entries) AS e"
)
_ENTRIES = LogEntry.__table__


@dataclass(frozen=True)
class Problem:
    idx: int | None  # the first log index concerned; None for a problem of the log as a whole
    message: str

    def __str__(self) -> str:
        return self.message if self.idx is None else f"index {self.idx}: {self.message}"


@dataclass
class LogReport:
    size: int = 0
    root: bytes = merkle.EMPTY_ROOT
    kinds: dict[str, int] = field(default_factory=dict)
    checkpoints: int = 0
    subtrees: int = 0
    external: Checkpoint | None = None
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    # Owner repairs recorded in log_repairs (not a problem: they are how a stopped log was mended).
    repairs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def first_problem(self) -> Problem | None:
        indexed = [p for p in self.problems if p.idx is not None]
        if indexed:
            return min(indexed, key=lambda p: p.idx or 0)
        return self.problems[0] if self.problems else None

    def to_json(self) -> dict[str, Any]:
        first = self.first_problem()
        external = self.external
        return {
            "ok": self.ok,
            "size": self.size,
            "root_hash": self.root.hex(),
            "entries": self.kinds,
            "checkpoints_checked": self.checkpoints,
            "subtrees_checked": self.subtrees,
            "external_checkpoint": None
            if external is None
            else {"origin": external.origin, "size": external.size, "root_hash": external.root.hex()},
            "first_bad_index": None if first is None else first.idx,
            "problems": [str(p) for p in self.problems],
            "repairs": self.repairs,
            "seconds": round(self.seconds, 3),
        }


class Rebuilt:
    """The tree recomputed from leaf hashes: every complete subtree, level by level."""

    def __init__(self) -> None:
        self.levels: list[list[bytes]] = [[]]

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def append(self, leaf: bytes) -> None:
        levels, sha256 = self.levels, hashlib.sha256
        levels[0].append(leaf)
        digest, level, index = leaf, 0, len(levels[0]) - 1
        while index & 1:
            digest = sha256(b"\x01" + levels[level][index - 1] + digest).digest()  # merkle.node_hash
            level, index = level + 1, index >> 1
            if level == len(levels):
                levels.append([])
            levels[level].append(digest)

    def root(self, size: int) -> bytes:
        """RFC 9162 root of the first `size` leaves: fold the complete subtrees of `size` from the right.

        The subtree at level L (bit L of `size` set) is the last complete one there, index (size >> L) - 1;
        the smallest is innermost. This runs once per stored checkpoint, hence merkle.node_hash inlined."""
        if size == 0:
            return merkle.EMPTY_ROOT
        levels, sha256 = self.levels, hashlib.sha256
        level = (size & -size).bit_length() - 1
        digest = levels[level][(size >> level) - 1]
        rest = size >> level + 1  # bit j: the subtree at level + 1 + j
        while rest:
            skip = (rest & -rest).bit_length()  # to the next set bit
            level, rest = level + skip, rest >> skip
            digest = sha256(b"\x01" + levels[level][(size >> level) - 1] + digest).digest()
        return digest

    def subtree(self, level: int, index: int) -> bytes:
        try:
            return self.levels[level][index]
        except IndexError:
            raise merkle.ProofError(f"no complete subtree at level {level}, index {index}") from None


class _Verifier:
    def __init__(
        self,
        store: Store,
        verifiers: Sequence[NoteVerifier] | None,
        log_signer: NoteSigner | None,
        workers: int | None,
        notes_dir: Path | None = None,
    ) -> None:
        self.store = store
        self.notes_dir = notes_dir
        self.report = LogReport()
        self.tree = Rebuilt()
        self.meta = store.meta(refresh=True)
        self.verifiers = list(verifiers) if verifiers else ([store.log_verifier()] if self.meta else [])
        self.log_signer = log_signer
        self.workers = workers
        self.envelope_ids: dict[int, tuple[str, str]] = {}
        # Read by _read_tables during the slice checks.
        self.tables: dict[str, dict[int, str]] = {}
        self.orphans: tuple[int, int, int | None, int] = (0, 0, None, 0)
        self.stored_keys: list[KeyInfo] = []

    def problem(self, idx: int | None, message: str) -> None:
        if len(self.report.problems) < MAX_PROBLEMS:
            self.report.problems.append(Problem(idx, message))

    def _log_keys(self) -> logscan.LogKeys:
        vkeys = tuple(v.vkey() for v in self.verifiers)
        origin = self.meta[0] if self.meta else None
        signer = self.log_signer
        if signer is None or signer.vkey() not in vkeys:
            return logscan.LogKeys(vkeys, origin)
        seed = signer.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return logscan.LogKeys(vkeys, origin, signer.name, seed)

    def run(self, checkpoint_text: str | None) -> LogReport:
        started = time.perf_counter()
        size = self._size()
        self.report.size = size
        if self.meta is not None and self.meta[1] not in {v.vkey() for v in self.verifiers}:
            self.problem(
                None, f"the log key recorded in the store ({self.meta[1]}) is not the trusted log key"
            )
        if size and not self.verifiers:
            self.problem(None, "the log has entries but no log key is recorded (deleted rows)")
        history = self._history(size)
        self._slices(size, history)
        self._upper_subtrees(size)
        self._query_tables(size, history)
        with self.store.engine.connect() as conn:
            time_rows.check(conn, size, self.problem)
            self.report.repairs = [
                {
                    "number": r.id,
                    "repaired_at": r.repaired_at.isoformat().replace("+00:00", "Z"),
                    "kept_size": r.kept_size,
                    "removed_entries": r.removed_entries,
                    "removed_rows": r.removed_rows,
                    "evidence_sha256": r.evidence_sha256,
                    "by_role": r.by_role,
                    "reason": r.reason,
                }
                for r in conn.execute(sa.select(LogRepair).order_by(LogRepair.id)).all()
            ]
        self._orphans()
        if self.notes_dir is not None and self.meta is not None:
            self._repair_notes(self.notes_dir, self.meta[0])
        if checkpoint_text is not None:
            self._external(checkpoint_text, size)
        self.report.root = self.tree.root(self.tree.size)
        self.report.seconds = time.perf_counter() - started
        return self.report

    def _size(self) -> int:
        """The size to check, fixed up front (entries appended meanwhile are not this check's business).
        Rows must number exactly highest index + 1; if not, scan only as many as there are, so that a row
        planted at a huge index cannot make verification walk an empty range."""
        with self.store.engine.connect() as conn:
            rows, highest = conn.execute(_COUNT_AND_MAX).one()
        if rows and rows != highest + 1:
            # Some index below `rows` is then absent; the slice scan names it.
            self.problem(
                None, f"log indexes are not gapless: {rows} entries but the highest index is {highest}"
            )
        return min(rows, 0 if highest is None else highest + 1)

    def _orphans(self) -> None:
        """Checkpoints or subtrees beyond the log's end (read in one statement with the end itself, so
        concurrent appends, which write all three together, never count)."""
        end, checkpoints, largest, subtrees = self.orphans
        if largest is not None:
            # A signed tree larger than the log: its newest entries were deleted (or the row was planted).
            self.problem(
                end,
                f"stored checkpoint for size {largest} but the log holds {end} entries: the newest entries "
                f"were removed, or checkpoint rows planted ({checkpoints} checkpoint(s) lie beyond the end "
                "of the log)",
            )
        elif checkpoints:
            self.problem(None, f"{checkpoints} checkpoint(s) lie beyond the end of the log (planted rows)")
        if subtrees:
            self.problem(None, f"{subtrees} Merkle subtree(s) lie beyond the end of the log (planted rows)")

    def _history(self, size: int) -> KeyHistory:
        """Key history replayed from the log's own key entries (not from the query tables)."""
        history = KeyHistory()
        query = (
            sa.select(_ENTRIES.c.idx, _ENTRIES.c.kind, _ENTRIES.c.envelope)
            .where(_ENTRIES.c.kind.in_(logscan.KEY_KINDS), _ENTRIES.c.idx < size)
            .order_by(_ENTRIES.c.idx)
        )
        with self.store.engine.connect() as conn:
            entries = conn.execute(query).all()  # one pass over the log for both kinds
        for idx, kind, envelope in entries:
            try:
                history.apply(idx, bytes(envelope))
            except ReceiptsError as error:
                self.problem(idx, f"bad {kind} entry: {error}")
        return history

    def _slices(self, size: int, history: KeyHistory) -> None:
        states = logscan.key_states(history)
        keys = self._log_keys()
        workers = logscan.worker_count(size) if self.workers is None else self.workers
        # A worker opens its own connection: hand it the URL (with password), never the pooled engine.
        source: Any = (
            self.store.engine.url.render_as_string(hide_password=False) if workers else self.store.engine
        )
        role = self.store.db_role.role if self.store.db_role.writer else None
        kinds: Counter[str] = Counter()
        complete = True
        with logscan.executor(workers) as pool:
            futures = [
                pool.submit(
                    logscan.check_slice, source, lo, min(lo + logscan.SLICE, size), states, keys, role
                )
                for lo in range(0, size, logscan.SLICE)
            ]
            self._read_tables(size)
            for future in futures:
                result = future.result()
                for idx, message in result.problems:
                    self.problem(idx, message)
                kinds.update(result.kinds)
                self.envelope_ids.update(result.envelope_ids)
                self.report.subtrees += result.subtrees
                if complete:
                    for leaf in result.leaves:
                        self.tree.append(leaf)
                    complete = len(result.leaves) == result.hi - result.lo
                self._compare_roots(result)
        self.report.kinds = dict(kinds)

    def _compare_roots(self, result: logscan.SliceResult) -> None:
        for cp_size in range(result.lo + 1, result.hi + 1):
            root = result.note_roots.get(cp_size)
            if root is None:
                # A batch has one checkpoint, at its end; the one the log ends with must be there. (Within
                # the log, time_rows finds a batch's checkpoint deleted: its entries' time is not the next
                # checkpoint's.)
                if cp_size == self.report.size and cp_size not in result.bad_notes:
                    self.problem(
                        cp_size - 1,
                        f"the checkpoint of size {cp_size}, where the log ends, is missing (deleted row): "
                        "its last entries are not covered by a signed checkpoint",
                    )
                continue
            self.report.checkpoints += 1
            if cp_size > self.tree.size:
                continue  # entries before it are missing; reported already
            if self.tree.root(cp_size) != root:
                self.problem(
                    cp_size - 1,
                    f"the signed checkpoint of size {cp_size} does not match the tree recomputed from the "
                    f"stored entries: entry {cp_size - 1} was changed, moved or inserted",
                )

    def _upper_subtrees(self, size: int) -> None:
        """Stored subtrees above slice level (the slices check the ones below)."""
        if self.tree.size != size:
            return
        table = MerkleNode.__table__
        expected = sum(size >> level for level in range(logscan.SLICE_LEVEL + 1, size.bit_length()))
        seen = 0
        with self.store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(table.c.level, table.c.node_index, table.c.hash).where(
                    table.c.level > logscan.SLICE_LEVEL
                )
            )
            for level, index, digest in rows:
                if (index + 1) << level > size:
                    continue  # appended after verification started
                seen += 1
                try:
                    ours = self.tree.subtree(level, index)
                except merkle.ProofError:
                    ours = None
                if ours != bytes(digest):
                    self.problem(
                        index << level, f"the stored Merkle subtree (level {level}, index {index}) is wrong"
                    )
        if seen != expected:
            self.problem(
                None, f"merkle_nodes holds {seen} upper subtrees for {size} entries, expected {expected}"
            )
        self.report.subtrees += seen

    def _read_tables(self, size: int) -> None:
        """Read what the query-table and orphan checks compare, while the workers check the slices (the
        size is fixed already; rows added meanwhile lie beyond it). Reported later, in the usual order."""
        with self.store.engine.connect() as conn:
            self.tables = {
                "receipt": {
                    i: rid
                    for rid, i in conn.execute(sa.select(ReceiptRow.id, ReceiptRow.log_idx))
                    if i < size
                },
                "approval": {
                    i: aid
                    for aid, i in conn.execute(sa.select(ApprovalRow.id, ApprovalRow.log_idx))
                    if i < size
                },
            }
            end, checkpoints, largest, subtrees = conn.execute(_ORPHANS).one()
            self.orphans = (end, checkpoints, largest, subtrees)
        self.stored_keys = self.store.key_rows()

    def _query_tables(self, size: int, history: KeyHistory) -> None:
        """The receipts/approvals/keys tables agree with the log entries they were derived from."""
        for kind, rows in self.tables.items():
            expected = {i: digest for i, (k, digest) in self.envelope_ids.items() if k == kind}
            if rows != expected:
                bad = sorted(set(rows.items()) ^ set(expected.items()))
                self.problem(bad[0][0], f"the {kind}s table disagrees with the log entries (id or index)")
        # Every column: a rewritten public key, note or reason would otherwise be shown as the log's.
        table_keys = {
            (k.keyid, k.trusted_at, k.revoked_at, k.algorithm, k.public_pem, k.note, k.reason)
            for k in self.stored_keys
            if k.trusted_at < size
        }
        log_keys = {
            (
                k,
                s.trusted_at,
                s.revoked_at,
                s.key.algorithm,
                s.key.public_pem().decode("ascii"),
                s.note,
                s.reason,
            )
            for k, s in history.keys.items()
        }
        if table_keys != log_keys:
            names = ("keyid", "trusted_at", "revoked_at", "algorithm", "public_pem", "note", "reason")
            bad = sorted(table_keys ^ log_keys, key=lambda t: t[1])
            logged = {t[0]: t for t in log_keys}.get(bad[0][0])
            stored = {t[0]: t for t in table_keys}.get(bad[0][0])
            wrong = (
                [n for n, a, b in zip(names, stored, logged, strict=True) if a != b]
                if stored and logged
                else ["the row itself"]
            )
            self.problem(
                bad[0][1],
                f"the signer_keys/key_revocations rows of key {bad[0][0][:16]} disagree with its key entries "
                f"({', '.join(wrong)}): they were edited or planted",
            )

    def _repair_notes(self, notes_dir: Path, origin: str) -> None:
        """Every repair is recorded twice: a log_repairs row and a note signed by the log key in the data
        dir. A note without its row is a deleted record; a row without its note, later than a signed one
        and where the log key is, a forged or unsigned one; a note's kept root must be the log's."""
        notes = repair.repair_notes(notes_dir, origin)
        rows = {r["number"]: r for r in self.report.repairs}
        for number, path in sorted(notes.items()):
            try:
                fields = repair.open_repair_note(path.read_text(), self.verifiers)
            except (OSError, UnicodeDecodeError, ReceiptsError) as error:
                self.problem(None, f"the repair note {path} does not verify with the log key: {error}")
                continue
            row = rows.get(number)
            if row is None:
                self.problem(
                    None,
                    f"repair {number} (signed note {path}, kept size {fields.get('kept')}) has no "
                    "log_repairs row: the record of a repair was deleted",
                )
                continue
            recorded = {
                "origin": origin,
                "number": str(number),
                "kept": str(row["kept_size"]),
                "removed_entries": str(row["removed_entries"]),
                "removed_rows": str(row["removed_rows"]),
                "evidence": row["evidence_sha256"],
            }
            wrong = [k for k, v in recorded.items() if fields.get(k) != v]
            if wrong:
                self.problem(
                    None,
                    f"the log_repairs row of repair {number} disagrees with its signed note "
                    f"({', '.join(wrong)})",
                )
                continue
            kept = row["kept_size"]
            if kept <= self.tree.size and fields.get("root") != self.tree.root(kept).hex():
                self.problem(
                    None,
                    f"the log's first {kept} entries no longer hash to the root repair {number} kept: "
                    "history was rewritten after the repair",
                )
        signer = self.log_signer
        if notes and signer is not None and signer.vkey() in {v.vkey() for v in self.verifiers}:
            # Where the log key is and repairs are signed: every repair after the first signed one has its
            # note (repairs recorded before signed notes existed have none).
            for number in sorted(n for n in set(rows) - set(notes) if n > min(notes)):
                self.problem(
                    None,
                    f"repair {number} has no note signed by the log key in {notes_dir}: it was not made by "
                    "qualify log repair where the log key is (or its note was removed)",
                )

    def _external(self, text: str, size: int) -> None:
        """A checkpoint kept outside the database: its tree must be a prefix of the recomputed one."""
        origin = self.meta[0] if self.meta else None
        try:
            cp = open_checkpoint(text, self.verifiers)
            if origin is not None and cp.origin != origin:
                self.problem(
                    None,
                    f"the external checkpoint belongs to log {cp.origin!r}, not to this log ({origin!r}); "
                    "check it against the store it came from",
                )
                return
        except ReceiptsError as error:
            self.problem(None, f"the external checkpoint does not verify with the log key: {error}")
            return
        self.report.external = cp
        if cp.size > size:
            self.problem(
                size,
                f"the external checkpoint covers {cp.size} entries but the log holds {size}: "
                "entries were removed",
            )
            return
        if cp.size > self.tree.size:
            return  # entries are missing; reported already
        if self.tree.root(cp.size) != cp.root:
            self.problem(
                None,
                f"the log's first {cp.size} entries no longer hash to the external checkpoint's root: "
                "history was rewritten (or the checkpoint comes from another log with the same origin "
                "and log key)",
            )
            return
        try:
            proof = merkle.consistency_proof_from(self.tree, cp.size, size)
            merkle.verify_consistency(cp.size, size, proof, cp.root, self.tree.root(size))
        except merkle.ProofError as error:
            self.problem(None, f"the log is not consistent with the external checkpoint: {error}")


def verify_log(
    store: Store,
    *,
    checkpoint_text: str | None = None,
    verifiers: Sequence[NoteVerifier] | None = None,
    log_signer: NoteSigner | None = None,
    workers: int | None = None,
    notes_dir: Path | None = None,
) -> LogReport:
    """Verify the whole log; TamperError (naming the first bad index; `.report` holds all) on any discrepancy.

    `verifiers`: trusted checkpoint keys (default: the log key recorded in the store, which whoever rewrote
    the database could have replaced: pass the real one). `log_signer`: the log's own key, if at hand,
    makes checkpoint checks cheaper (see logscan.LogKeys). `workers`: processes for the slices (default:
    one per CPU for large logs, none for small ones). `notes_dir`: where `log repair` keeps its signed
    notes (the data dir's log-repairs/): each must have its log_repairs row, and the reverse."""
    report = _Verifier(store, verifiers, log_signer, workers, notes_dir).run(checkpoint_text)
    if not report.ok:
        first = report.first_problem()
        more = len(report.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        where = "" if first is None or first.idx is None else f" at index {first.idx}"
        message = first.message if first is not None else "unknown problem"
        error = TamperError(f"log verification failed{where}: {message}{suffix}")
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report
