"""What the read paths may serve: the last stored checkpoint that verifies with the trusted log key (kept
outside the database where one is at hand) and names the stored tree, and the entries it covers whose
signatures verify with a key that the log's own key entries (under that checkpoint) trusted by then.

Rows beyond that checkpoint (a forged append, a junk checkpoint row) are not served and not trusted; the
reads go on from the last good checkpoint and say so (`GoodHead.notice`), instead of failing for every
entry. Only when no stored checkpoint verifies at all is nothing served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from receipts import dsse, merkle
from receipts.checkpoint import NoteVerifier, open_checkpoint
from receipts.errors import ReceiptsError, TamperError
from receipts.keylog import KeyHistory
from receipts.models import CheckpointRow, LogEntry
from receipts.subtrees import SqlSubtrees

# How many stored checkpoints (newest first) are tried before giving up: rows beyond the last good one
# are planted ones, and each costs a signature check and a root read.
MAX_WALK = 1000
KEY_KINDS = ("key-trust", "key-revoke")
_ENTRIES = LogEntry.__table__
_CHECKPOINTS = CheckpointRow.__table__
_WALK = (
    sa.select(_CHECKPOINTS.c.size, _CHECKPOINTS.c.note)
    .where(_CHECKPOINTS.c.size <= sa.bindparam("n"))
    .order_by(_CHECKPOINTS.c.size.desc())
    .limit(MAX_WALK)
)
_LATEST_SIZE = sa.select(sa.func.max(_CHECKPOINTS.c.size))
NOT_SERVED = "nothing served; see what is wrong with: qualify log verify"


@dataclass(frozen=True)
class GoodHead:
    """The last good checkpoint: `size` entries under `root`, signed in `note` (None for an empty log)."""

    size: int
    root: bytes
    note: str | None
    entries: int  # entries stored (highest index + 1)
    latest: int | None  # the size of the latest checkpoint row, verified or not
    trust: str  # where the log key it verifies with came from

    @property
    def stale(self) -> bool:
        return self.entries != self.size or (self.latest or 0) != self.size

    def notice(self) -> str | None:
        """One line saying that rows beyond the last good checkpoint are not served, or None."""
        if not self.stale:
            return None
        beyond = self.entries - self.size
        rows = f"{beyond} log entr{'y' if beyond == 1 else 'ies'}" if beyond else "checkpoint rows"
        return (
            f"the store holds {rows} beyond the last checkpoint that verifies with the log key (size "
            f"{self.size}; the latest checkpoint row is of size {self.latest}): served from size "
            f"{self.size}, nothing beyond it; see them with: qualify log verify (the owner removes them "
            "with: qualify log repair)"
        )


def last_good(
    conn: Connection, verifier: NoteVerifier, origin: str | None, entries: int, trust: str
) -> GoodHead:
    """The largest stored checkpoint that verifies with `verifier` (and `origin`) and whose root is the one
    the stored subtrees give for its size; TamperError when the log has entries but none does."""
    latest = conn.execute(_LATEST_SIZE).scalar()
    if entries == 0:
        return GoodHead(0, merkle.EMPTY_ROOT, None, 0, latest, trust)
    reader = SqlSubtrees(conn)
    first: str | None = None
    for size, note in conn.execute(_WALK, {"n": entries}).all():
        try:
            cp = open_checkpoint(note, [verifier], origin)
            if cp.size != size:
                raise TamperError(f"the checkpoint row of size {size} holds a note of size {cp.size}")
            if reader.run(lambda r, n=size: merkle.root_from(r, n)) != cp.root:
                raise TamperError(f"the stored tree of size {size} is not the one its checkpoint names")
        except (ReceiptsError, merkle.ProofError, ValueError) as error:
            first = first or f"size {size}: {error}"
            continue
        return GoodHead(int(size), cp.root, note, entries, latest, trust)
    raise TamperError(
        f"the log holds {entries} entries but no stored checkpoint verifies with the log key "
        f"{verifier.vkey()} ({trust}) and names the stored tree (first refused: {first or 'none stored'}); "
        f"{NOT_SERVED}"
    )


def check_included(conn: Connection, good: GoodHead, items: Sequence[tuple[int, bytes]]) -> None:
    """Each (index, bytes) is a leaf of the good checkpoint's tree (one query for every proof's subtrees);
    TamperError naming the first that is not."""
    if not items:
        return
    for idx, _ in items:
        if not 0 <= idx < good.size:
            raise TamperError(
                f"log index {idx} lies beyond the last checkpoint that verifies with the log key (size "
                f"{good.size}): it was written outside the store; {NOT_SERVED}"
            )
    proofs = SqlSubtrees(conn).run(
        lambda r: [merkle.inclusion_proof_from(r, idx, good.size) for idx, _ in items]
    )
    for (idx, data), proof in zip(items, proofs, strict=True):
        try:
            merkle.verify_inclusion(idx, good.size, merkle.leaf_hash(data), proof, good.root)
        except merkle.ProofError as error:
            raise TamperError(
                f"log entry {idx} is not the one the signed checkpoint of size {good.size} covers ({error}): "
                f"its bytes or the stored Merkle tree were changed outside the store; {NOT_SERVED}"
            ) from error


def key_history(conn: Connection, good: GoodHead) -> KeyHistory:
    """Key history replayed from the key entries under the good checkpoint, each proven included in it (a
    key-trust entry planted beyond it, or with plain SQL inside it, never makes a key trusted)."""
    rows = [
        (int(idx), bytes(data))
        for idx, data in conn.execute(
            sa.select(_ENTRIES.c.idx, _ENTRIES.c.envelope)
            .where(_ENTRIES.c.kind.in_(KEY_KINDS), _ENTRIES.c.idx < good.size)
            .order_by(_ENTRIES.c.idx)
        )
    ]
    check_included(conn, good, rows)
    history = KeyHistory()
    for idx, data in rows:
        try:
            history.apply(idx, data)
        except ReceiptsError as error:
            raise TamperError(
                f"the key entry at log index {idx} does not replay ({error}); {NOT_SERVED}"
            ) from error
    return history


def signers(history: KeyHistory, idx: int, data: bytes, what: str) -> list[str]:
    """Key ids of the trusted keys whose signatures on the entry verify; TamperError when none does."""
    try:
        return history.signers(dsse.parse(data), idx, what)
    except ReceiptsError as error:
        raise TamperError(
            f"the {what} at log index {idx} does not verify with a key the log trusted there ({error}); "
            f"{NOT_SERVED}"
        ) from error
