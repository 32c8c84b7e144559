"""The Merkle subtrees kept in `merkle_nodes`, read as a merkle.SubtreeReader with one query per proof:
the subtrees a computation needs are found first by a dry run, then fetched together."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from receipts.errors import TamperError
from receipts.models import MerkleNode

T = TypeVar("T")
_DUMMY = bytes(32)
_BATCH = 200  # keys per query; well under every dialect's bound-parameter limit
_NODES = MerkleNode.__table__
_FETCH: dict[int, sa.Select] = {}


def _fetch_statement(count: int) -> sa.Select:
    """SELECT of `count` subtrees by (level, index), built once per count. An OR of key equalities,
    because SQLite answers a row-value IN list with a full table scan but this with index lookups."""
    if count not in _FETCH:
        condition = sa.or_(
            *(
                sa.and_(_NODES.c.level == sa.bindparam(f"l{i}"), _NODES.c.node_index == sa.bindparam(f"i{i}"))
                for i in range(count)
            )
        )
        _FETCH[count] = sa.select(_NODES.c.level, _NODES.c.node_index, _NODES.c.hash).where(condition)
    return _FETCH[count]


def frontier(size: int) -> list[tuple[int, int]]:
    """(level, index) of the complete subtrees that make up a tree of `size` leaves, largest first."""
    out, begin = [], 0
    for level in range(size.bit_length() - 1, -1, -1):
        if size >> level & 1:
            out.append((level, begin >> level))
            begin += 1 << level
    return out


class _Recorder:
    """A reader that answers anything and remembers what was asked (the dry run)."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, int]] = set()

    def subtree(self, level: int, index: int) -> bytes:
        self.keys.add((level, index))
        return _DUMMY


class SqlSubtrees:
    """merkle.SubtreeReader over `merkle_nodes`; a missing subtree means a damaged store."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.cache: dict[tuple[int, int], bytes] = {}

    def fetch(self, keys: Iterable[tuple[int, int]]) -> None:
        wanted = [k for k in keys if k not in self.cache]
        for start in range(0, len(wanted), _BATCH):
            chunk = wanted[start : start + _BATCH]
            params = {}
            for i, (level, index) in enumerate(chunk):
                params[f"l{i}"], params[f"i{i}"] = level, index
            for level, index, digest in self.conn.execute(_fetch_statement(len(chunk)), params):
                self.cache[(level, index)] = bytes(digest)

    def add(self, nodes: Iterable[tuple[int, int, bytes]]) -> None:
        for level, index, digest in nodes:
            self.cache[(level, index)] = digest

    def subtree(self, level: int, index: int) -> bytes:
        try:
            return self.cache[(level, index)]
        except KeyError:
            self.fetch([(level, index)])
        if (level, index) not in self.cache:
            raise TamperError(
                f"merkle_nodes lacks the subtree at level {level}, index {index}: the store is damaged; "
                "run: qualify log verify"
            )
        return self.cache[(level, index)]

    def prefetch(self, compute: Callable[[object], object]) -> None:
        """Fetch, in batched queries, every subtree a dry run of `compute(reader)` asks for."""
        recorder = _Recorder()
        compute(recorder)
        self.fetch(recorder.keys)

    def run(self, compute: Callable[[object], T]) -> T:
        """`compute(reader)` after fetching, in one query, every subtree a dry run of it asks for."""
        recorder = _Recorder()
        compute(recorder)
        self.fetch(recorder.keys)
        return compute(self)
