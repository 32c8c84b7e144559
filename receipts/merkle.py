"""RFC 9162 Merkle tree math: leaf/node hashing, roots, inclusion and consistency proofs and their
verification, computed either from a list of leaf hashes or from stored complete aligned subtrees."""

from __future__ import annotations

import hashlib
from typing import Protocol

from receipts.errors import ProofError

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "MemoryTree",
    "ProofError",
    "SubtreeReader",
    "consistency_proof",
    "consistency_proof_from",
    "inclusion_proof",
    "inclusion_proof_from",
    "leaf_hash",
    "new_subtrees",
    "node_hash",
    "root_from",
    "root_hash",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    """MTH of a one-leaf tree: SHA-256(0x00 || data)."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """Interior node: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly below n (n >= 2): where RFC 9162 splits a tree of n leaves."""
    return 1 << ((n - 1).bit_length() - 1)


# --- list-based (RFC 9162 §2.1.1, §2.1.3.1, §2.1.4.1, written recursively as the RFC defines them) ---


def _mth(leaves: list[bytes]) -> bytes:
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return node_hash(_mth(leaves[:k]), _mth(leaves[k:]))


def root_hash(leaf_hashes: list[bytes]) -> bytes:
    """Merkle Tree Hash of the given leaf hashes; the empty tree is SHA-256 of nothing."""
    return _mth(list(leaf_hashes)) if leaf_hashes else EMPTY_ROOT


def _path(m: int, leaves: list[bytes]) -> list[bytes]:
    if len(leaves) == 1:
        return []
    k = _split(len(leaves))
    if m < k:
        return _path(m, leaves[:k]) + [_mth(leaves[k:])]
    return _path(m - k, leaves[k:]) + [_mth(leaves[:k])]


def inclusion_proof(leaf_hashes: list[bytes], index: int) -> list[bytes]:
    """The audit path for leaf `index`, from the leaf's sibling up to the root's child."""
    leaves = list(leaf_hashes)
    if not 0 <= index < len(leaves):
        raise ProofError(
            f"cannot prove leaf {index} in a tree of {len(leaves)} leaves; pick 0 <= index < size"
        )
    return _path(index, leaves)


def _subproof(m: int, leaves: list[bytes], whole: bool) -> list[bytes]:
    n = len(leaves)
    if m == n:
        # The old tree is this very subtree: the verifier knows its hash already unless it is a strict part.
        return [] if whole else [_mth(leaves)]
    k = _split(n)
    if m <= k:
        return _subproof(m, leaves[:k], whole) + [_mth(leaves[k:])]
    return _subproof(m - k, leaves[k:], False) + [_mth(leaves[:k])]


def consistency_proof(leaf_hashes: list[bytes], size1: int) -> list[bytes]:
    """Proof that the first `size1` leaves form a prefix of the tree of all `leaf_hashes`."""
    leaves = list(leaf_hashes)
    if not 0 <= size1 <= len(leaves):
        raise ProofError(
            f"cannot prove consistency from size {size1} to size {len(leaves)}; pick 0 <= size1 <= size2"
        )
    if size1 == 0 or size1 == len(leaves):
        return []
    return _subproof(size1, leaves, True)


# --- verification (RFC 9162 §2.1.3.2 and §2.1.4.2) ---


def _check_hash(what: str, value: bytes) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_SIZE:
        raise ProofError(f"{what} is not a {HASH_SIZE}-byte SHA-256 hash; pass the raw digest bytes")


def _check_size(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProofError(f"{what} must be a non-negative integer, got {value!r}")


def verify_inclusion(index: int, size: int, leaf_hash: bytes, proof: list[bytes], root: bytes) -> None:
    """Raise ProofError unless `proof` shows `leaf_hash` at `index` in the tree of `size` with `root`."""
    _check_size("leaf index", index)
    _check_size("tree size", size)
    if index >= size:
        raise ProofError(f"leaf index {index} is outside a tree of size {size}")
    _check_hash("leaf hash", leaf_hash)
    _check_hash("root hash", root)
    for i, p in enumerate(proof):
        _check_hash(f"inclusion proof hash #{i}", p)
    fn, sn, r = index, size - 1, bytes(leaf_hash)
    for p in proof:
        if sn == 0:
            raise ProofError(f"inclusion proof has {len(proof)} hashes, too many for leaf {index} of {size}")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            # Skip levels where this node is the right edge and has no sibling.
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError(f"inclusion proof has {len(proof)} hashes, too few for leaf {index} of {size}")
    if r != root:
        raise ProofError(f"inclusion proof for leaf {index} of {size} does not lead to the expected root")


def verify_consistency(size1: int, size2: int, proof: list[bytes], root1: bytes, root2: bytes) -> None:
    """Raise ProofError unless `proof` shows the tree (size1, root1) is a prefix of (size2, root2)."""
    _check_size("old tree size", size1)
    _check_size("new tree size", size2)
    if size1 > size2:
        raise ProofError(f"old tree size {size1} is larger than new tree size {size2}; a log only grows")
    _check_hash("old root hash", root1)
    _check_hash("new root hash", root2)
    for i, p in enumerate(proof):
        _check_hash(f"consistency proof hash #{i}", p)
    if size1 == size2:
        if proof:
            raise ProofError(f"consistency proof between equal sizes {size1} must be empty")
        if root1 != root2:
            raise ProofError(f"two different roots for the same tree size {size1}: the log forked")
        return
    if size1 == 0:
        # Everything extends the empty tree, but its root is fixed: a different one is not an empty tree.
        if proof:
            raise ProofError("consistency proof from the empty tree must be empty")
        if root1 != EMPTY_ROOT:
            raise ProofError("old root is not the empty-tree hash although the old size is 0")
        return
    if not proof:
        raise ProofError(f"consistency proof from {size1} to {size2} is empty; it needs at least one hash")
    path = list(proof)
    if size1 & (size1 - 1) == 0:
        # The old tree is a complete subtree of the new one; its root is the proof's implicit first node.
        path.insert(0, bytes(root1))
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError(f"consistency proof from {size1} to {size2} has too many hashes")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError(f"consistency proof from {size1} to {size2} has too few hashes")
    if fr != root1:
        raise ProofError(f"consistency proof does not lead to the old root of size {size1}")
    if sr != root2:
        raise ProofError(f"consistency proof does not lead to the new root of size {size2}")


# --- stored complete aligned subtrees ---


class SubtreeReader(Protocol):
    def subtree(self, level: int, index: int) -> bytes:
        """Hash of the complete subtree over leaves [index * 2**level, (index + 1) * 2**level)."""
        ...


def new_subtrees(leaf_index: int, leaf_hash: bytes, reader: SubtreeReader) -> list[tuple[int, int, bytes]]:
    """(level, index, hash) of every complete aligned subtree that appending a leaf at `leaf_index`
    completes, lowest first; only earlier (left-sibling) subtrees are read."""
    _check_size("leaf index", leaf_index)
    _check_hash("leaf hash", leaf_hash)
    out = [(0, leaf_index, bytes(leaf_hash))]
    level, index, h = 0, leaf_index, bytes(leaf_hash)
    while index & 1:
        h = node_hash(reader.subtree(level, index - 1), h)
        level, index = level + 1, index >> 1
        out.append((level, index, h))
    return out


def _range_hash(reader: SubtreeReader, begin: int, end: int) -> bytes:
    """MTH of leaves [begin, end), where `begin` is aligned to the tree node covering that range.

    The range splits into maximal aligned power-of-two subtrees, largest first; RFC 9162's right-heavy
    tree folds them from the right."""
    parts: list[bytes] = []
    while begin < end:
        level = (end - begin).bit_length() - 1
        # Alignment of `begin` can cap the subtree size; node ranges never hit that cap, but be exact.
        if begin:
            level = min(level, (begin & -begin).bit_length() - 1)
        parts.append(reader.subtree(level, begin >> level))
        begin += 1 << level
    h = parts[-1]
    for left in reversed(parts[:-1]):
        h = node_hash(left, h)
    return h


def root_from(reader: SubtreeReader, size: int) -> bytes:
    """Root of the tree of the first `size` leaves, from at most log2(size) + 1 stored subtrees."""
    _check_size("tree size", size)
    return _range_hash(reader, 0, size) if size else EMPTY_ROOT


def inclusion_proof_from(reader: SubtreeReader, index: int, size: int) -> list[bytes]:
    """Same as inclusion_proof over the first `size` leaves, read from stored subtrees."""
    _check_size("tree size", size)
    if not isinstance(index, int) or not 0 <= index < size:
        raise ProofError(f"cannot prove leaf {index} in a tree of {size} leaves; pick 0 <= index < size")
    path: list[bytes] = []
    begin, end, m = 0, size, index
    while end - begin > 1:
        k = _split(end - begin)
        if m < k:
            path.append(_range_hash(reader, begin + k, end))
            end = begin + k
        else:
            path.append(_range_hash(reader, begin, begin + k))
            begin, m = begin + k, m - k
    path.reverse()
    return path


def consistency_proof_from(reader: SubtreeReader, size1: int, size2: int) -> list[bytes]:
    """Same as consistency_proof from `size1` to `size2`, read from stored subtrees."""
    _check_size("old tree size", size1)
    _check_size("new tree size", size2)
    if size1 > size2:
        raise ProofError(f"cannot prove consistency from size {size1} to size {size2}; pick size1 <= size2")
    if size1 == 0 or size1 == size2:
        return []
    path: list[bytes] = []
    begin, end, m, whole = 0, size2, size1, True
    while m != end - begin:
        k = _split(end - begin)
        if m <= k:
            path.append(_range_hash(reader, begin + k, end))
            end = begin + k
        else:
            path.append(_range_hash(reader, begin, begin + k))
            begin, m, whole = begin + k, m - k, False
    if not whole:
        path.append(_range_hash(reader, begin, end))
    path.reverse()
    return path


class MemoryTree:
    """An in-memory append-only tree that keeps every complete aligned subtree (a SubtreeReader)."""

    def __init__(self) -> None:
        self._levels: list[list[bytes]] = []
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def append(self, leaf_hash: bytes) -> None:
        for level, index, h in new_subtrees(self._size, leaf_hash, self):
            if level == len(self._levels):
                self._levels.append([])
            assert len(self._levels[level]) == index  # appends arrive in order, so each level grows by one
            self._levels[level].append(h)
        self._size += 1

    def subtree(self, level: int, index: int) -> bytes:
        if 0 <= level < len(self._levels) and 0 <= index < len(self._levels[level]):
            return self._levels[level][index]
        raise ProofError(f"no complete subtree at level {level}, index {index} in a tree of {self._size}")

    def root(self, size: int | None = None) -> bytes:
        return root_from(self, self._size if size is None else size)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        return inclusion_proof_from(self, index, self._size if size is None else size)

    def consistency_proof(self, size1: int, size2: int | None = None) -> list[bytes]:
        return consistency_proof_from(self, size1, self._size if size2 is None else size2)
