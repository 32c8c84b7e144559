"""RFC 9162 Merkle math against published vectors, every small tree exhaustively, and a mutant suite."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from receipts import merkle
from receipts.errors import ProofError, ReceiptsError
from receipts.merkle import (
    EMPTY_ROOT,
    MemoryTree,
    consistency_proof,
    consistency_proof_from,
    inclusion_proof,
    inclusion_proof_from,
    leaf_hash,
    new_subtrees,
    node_hash,
    root_from,
    root_hash,
    verify_consistency,
    verify_inclusion,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "rfc6962.json").read_text())
LEAVES = [leaf_hash(bytes.fromhex(x)) for x in VECTORS["leaves_hex"]]
ROOTS = {int(k): bytes.fromhex(v) for k, v in VECTORS["roots_by_size"].items()}
H = bytes.fromhex


def _tree(n: int) -> list[bytes]:
    return [leaf_hash(i.to_bytes(4, "big")) for i in range(n)]


def _memory_tree(hashes: list[bytes]) -> MemoryTree:
    t = MemoryTree()
    for h in hashes:
        t.append(h)
    return t


def _refused(fn, *args) -> bool:
    try:
        fn(*args)
    except ProofError:
        return True
    return False


def _flip(h: bytes, bit: int) -> bytes:
    b = bytearray(h)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


# Independent of the verifier's bit arithmetic: the side of each proof hash (leaf upward), read off the
# recursive RFC 6962 PATH / SUBPROOF definitions. Two claims with equal shapes consume a proof identically,
# so no verifier can tell them apart; claims with different shapes must be refused.
def _split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def _inclusion_shape(m: int, n: int) -> tuple[str, ...]:
    if n == 1:
        return ()
    k = _split(n)
    return _inclusion_shape(m, k) + ("R",) if m < k else _inclusion_shape(m - k, n - k) + ("L",)


def _consistency_shape(m: int, n: int, whole: bool = True) -> tuple[str, ...]:
    if m == n:
        return ("implicit-seed",) if whole else ("seed",)
    k = _split(n)
    if m <= k:
        return _consistency_shape(m, k, whole) + ("R",)
    return _consistency_shape(m - k, n - k, False) + ("L",)


# --- published vectors ---


def test_leaf_and_node_hashes_match_published_answers():
    for kat in VECTORS["leaf_hash_kat"]:
        assert leaf_hash(H(kat["data"])) == H(kat["hash"])
    for kat in VECTORS["node_hash_kat"]:
        assert node_hash(H(kat["left"]), H(kat["right"])) == H(kat["hash"])


def test_empty_tree_root_is_sha256_of_nothing():
    assert root_hash([]) == EMPTY_ROOT == hashlib.sha256(b"").digest() == H(VECTORS["empty_root"])
    assert root_from(MemoryTree(), 0) == EMPTY_ROOT


@pytest.mark.parametrize("size", range(1, 9))
def test_roots_of_the_rfc6962_test_tree_match_published_roots(size):
    assert root_hash(LEAVES[:size]) == ROOTS[size]
    assert root_from(_memory_tree(LEAVES), size) == ROOTS[size]


def test_eight_leaf_root_is_the_published_5dc9():
    assert root_hash(LEAVES).hex() == "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


@pytest.mark.parametrize("vec", VECTORS["inclusion"], ids=lambda v: f"{v['index']}of{v['size']}")
def test_published_inclusion_proofs_are_produced_and_verify(vec):
    index, size, want = vec["index"], vec["size"], [H(x) for x in vec["proof"]]
    assert inclusion_proof(LEAVES[:size], index) == want
    assert inclusion_proof_from(_memory_tree(LEAVES), index, size) == want
    verify_inclusion(index, size, LEAVES[index], want, ROOTS[size])


@pytest.mark.parametrize("vec", VECTORS["consistency"], ids=lambda v: f"{v['size1']}to{v['size2']}")
def test_published_consistency_proofs_are_produced_and_verify(vec):
    s1, s2, want = vec["size1"], vec["size2"], [H(x) for x in vec["proof"]]
    assert consistency_proof(LEAVES[:s2], s1) == want
    assert consistency_proof_from(_memory_tree(LEAVES), s1, s2) == want
    verify_consistency(s1, s2, want, ROOTS[s1], ROOTS[s2])


def test_a_real_ct_log_audit_path_verifies_at_three_million_leaves():
    v = VECTORS["real_log_inclusion"]
    proof = [H(x) for x in v["proof"]]
    verify_inclusion(v["index"], v["size"], H(v["leaf_hash"]), proof, H(v["root"]))
    with pytest.raises(ProofError):
        verify_inclusion(v["index"], v["size"], H(v["leaf_hash"]), proof, bytes(32))
    with pytest.raises(ProofError):
        verify_inclusion(v["index"] + 1, v["size"], H(v["leaf_hash"]), proof, H(v["root"]))


# --- every small tree ---


def test_every_inclusion_proof_up_to_eight_leaves_verifies():
    for size in range(1, 9):
        for index in range(size):
            proof = inclusion_proof(LEAVES[:size], index)
            assert len(proof) == len(_inclusion_shape(index, size))
            verify_inclusion(index, size, LEAVES[index], proof, ROOTS[size])


def test_every_consistency_proof_up_to_eight_leaves_verifies():
    for s2 in range(1, 9):
        for s1 in range(0, s2 + 1):
            proof = consistency_proof(LEAVES[:s2], s1)
            verify_consistency(s1, s2, proof, ROOTS.get(s1, EMPTY_ROOT), ROOTS[s2])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 100).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1), st.integers(0, n))))
def test_random_proofs_up_to_a_hundred_leaves_verify_from_list_and_store(case):
    n, index, s1 = case
    hashes = _tree(n)
    tree = _memory_tree(hashes)
    root = root_hash(hashes)
    proof = inclusion_proof(hashes, index)
    assert proof == tree.inclusion_proof(index)
    verify_inclusion(index, n, hashes[index], proof, root)
    cproof = consistency_proof(hashes, s1)
    assert cproof == tree.consistency_proof(s1)
    verify_consistency(s1, n, cproof, root_hash(hashes[:s1]), root)


def test_store_based_proofs_equal_list_based_proofs_for_every_size_up_to_seventy():
    hashes = _tree(70)
    tree = _memory_tree(hashes)
    for size in range(0, 71):
        assert root_from(tree, size) == root_hash(hashes[:size])
        for index in range(size):
            assert inclusion_proof_from(tree, index, size) == inclusion_proof(hashes[:size], index)
        for s1 in range(0, size + 1):
            assert consistency_proof_from(tree, s1, size) == consistency_proof(hashes[:size], s1)


# --- stored subtrees ---


class _CountingReader:
    """Any (level, index) answers a distinct hash: counts reads without building a million-leaf tree."""

    def __init__(self) -> None:
        self.reads = 0

    def subtree(self, level: int, index: int) -> bytes:
        self.reads += 1
        return hashlib.sha256(f"{level}/{index}".encode()).digest()


def test_appending_the_eighth_leaf_completes_one_subtree_per_level_and_reads_only_left_siblings():
    tree = _memory_tree(LEAVES[:7])
    reads: list[tuple[int, int]] = []

    class Spy:
        def subtree(self, level: int, index: int) -> bytes:
            reads.append((level, index))
            return tree.subtree(level, index)

    done = new_subtrees(7, LEAVES[7], Spy())
    assert [(lvl, idx) for lvl, idx, _ in done] == [(0, 7), (1, 3), (2, 1), (3, 0)]
    assert done[-1][2] == ROOTS[8]
    assert reads == [(0, 6), (1, 2), (2, 0)]
    assert [(lvl, idx) for lvl, idx, _ in new_subtrees(6, LEAVES[6], Spy())] == [(0, 6)]


@pytest.mark.parametrize("size", [100_000, 131_071, 131_072, 999_999, (1 << 20) - 1])
def test_store_reads_stay_logarithmic_at_a_million_leaves(size):
    bound = 2 * size.bit_length() + 2
    r = _CountingReader()
    root_from(r, size)
    assert r.reads <= size.bit_length()
    for index in (0, 1, size // 3, size - 2, size - 1):
        r.reads = 0
        inclusion_proof_from(r, index, size)
        assert r.reads <= bound
    for s1 in (1, 2, 3, size // 3, size - 2, size - 1):
        r.reads = 0
        consistency_proof_from(r, s1, size)
        assert r.reads <= bound


def test_asking_for_leaves_the_store_does_not_have_is_refused():
    tree = _memory_tree(LEAVES[:5])
    with pytest.raises(ProofError):
        tree.subtree(0, 5)
    with pytest.raises(ProofError):
        root_from(tree, 6)
    with pytest.raises(ProofError):
        inclusion_proof_from(tree, 5, 5)
    with pytest.raises(ProofError):
        consistency_proof_from(tree, 6, 5)


def test_generators_refuse_out_of_range_requests():
    with pytest.raises(ProofError):
        inclusion_proof(LEAVES[:3], 3)
    with pytest.raises(ProofError):
        inclusion_proof([], 0)
    with pytest.raises(ProofError):
        consistency_proof(LEAVES[:3], 4)
    with pytest.raises(ProofError):
        consistency_proof(LEAVES[:3], -1)


def test_proof_error_is_reexported_and_is_a_receipts_error():
    assert merkle.ProofError is ProofError
    assert issubclass(ProofError, ReceiptsError)


# --- mutants: every tampered proof or claim is refused ---


def _inclusion_cases():
    for size in range(1, 9):
        for index in range(size):
            yield index, size


@pytest.mark.parametrize("index,size", list(_inclusion_cases()))
def test_every_mutated_inclusion_proof_is_refused(index, size):
    leaf, root = LEAVES[index], ROOTS[size]
    proof = inclusion_proof(LEAVES[:size], index)
    other_root = ROOTS[size % 8 + 1]
    mutants: list[tuple[str, tuple]] = []
    for i in range(len(proof)):
        for bit in (0, 7, 100, 255):
            bad = list(proof)
            bad[i] = _flip(proof[i], bit)
            mutants.append((f"bit {bit} of hash {i}", (index, size, leaf, bad, root)))
        mutants.append((f"hash {i} removed", (index, size, leaf, proof[:i] + proof[i + 1 :], root)))
        mutants.append((f"hash {i} duplicated", (index, size, leaf, proof[: i + 1] + proof[i:], root)))
    for extra in (bytes(32), root, leaf, b""):
        mutants.append(("hash appended", (index, size, leaf, [*proof, extra], root)))
        mutants.append(("hash prepended", (index, size, leaf, [extra, *proof], root)))
    for bit in (0, 255):
        mutants.append(("leaf bit flipped", (index, size, _flip(leaf, bit), proof, root)))
        mutants.append(("root bit flipped", (index, size, leaf, proof, _flip(root, bit))))
    mutants += [
        ("another size's root", (index, size, leaf, proof, other_root)),
        ("leaf hash is the root", (index, size, root, proof, leaf)),
        ("index + 1", (index + 1, size, leaf, proof, root)),
        ("index = size", (size, size, leaf, proof, root)),
        ("size 0", (index, 0, leaf, proof, root)),
        ("negative index", (-1, size, leaf, proof, root)),
        ("short leaf hash", (index, size, leaf[:31], proof, root)),
        ("long root", (index, size, leaf, proof, root + b"\0")),
        ("reversed proof", (index, size, leaf, proof[::-1], root)),
    ]
    if index > 0:
        mutants.append(("index - 1", (index - 1, size, leaf, proof, root)))
    if proof:
        mutants.append(("empty proof", (index, size, leaf, [], root)))
    original = (index, size, leaf, proof, root)
    mutants = [m for m in mutants if m[1] != original]  # e.g. reversing a one-hash proof changes nothing
    accepted = [desc for desc, args in mutants if not _refused(verify_inclusion, *args)]
    assert accepted == []


@pytest.mark.parametrize("index,size", list(_inclusion_cases()))
def test_a_different_tree_size_is_refused_unless_its_proof_shape_is_identical(index, size):
    # RFC 9162 proofs do not commit to the tree size beyond the shape of the path: a claim whose path has the
    # same shape consumes the proof identically and must verify; every other size must be refused.
    proof = inclusion_proof(LEAVES[:size], index)
    for other in (size - 1, size + 1, size * 2, size // 2):
        if other <= index:
            assert _refused(verify_inclusion, index, other, LEAVES[index], proof, ROOTS[size])
            continue
        same = _inclusion_shape(index, other) == _inclusion_shape(index, size)
        assert _refused(verify_inclusion, index, other, LEAVES[index], proof, ROOTS[size]) is not same


def _consistency_cases():
    for s2 in range(2, 9):
        for s1 in range(1, s2):
            yield s1, s2


@pytest.mark.parametrize("s1,s2", list(_consistency_cases()))
def test_every_mutated_consistency_proof_is_refused(s1, s2):
    r1, r2 = ROOTS[s1], ROOTS[s2]
    proof = consistency_proof(LEAVES[:s2], s1)
    mutants: list[tuple[str, tuple]] = []
    for i in range(len(proof)):
        for bit in (0, 7, 100, 255):
            bad = list(proof)
            bad[i] = _flip(proof[i], bit)
            mutants.append((f"bit {bit} of hash {i}", (s1, s2, bad, r1, r2)))
        mutants.append((f"hash {i} removed", (s1, s2, proof[:i] + proof[i + 1 :], r1, r2)))
        mutants.append((f"hash {i} duplicated", (s1, s2, proof[: i + 1] + proof[i:], r1, r2)))
    for extra in (bytes(32), r1, r2, proof[0], b""):
        mutants.append(("hash appended", (s1, s2, [*proof, extra], r1, r2)))
        mutants.append(("hash prepended", (s1, s2, [extra, *proof], r1, r2)))
    for bit in (0, 255):
        mutants.append(("old root bit flipped", (s1, s2, proof, _flip(r1, bit), r2)))
        mutants.append(("new root bit flipped", (s1, s2, proof, r1, _flip(r2, bit))))
    mutants += [
        ("swapped roots", (s1, s2, proof, r2, r1)),
        ("empty proof", (s1, s2, [], r1, r2)),
        ("sizes reversed", (s2, s1, proof, r2, r1)),
        ("old size 0", (0, s2, proof, r1, r2)),
        ("equal sizes", (s2, s2, proof, r2, r2)),
        ("short old root", (s1, s2, proof, r1[:31], r2)),
        ("long new root", (s1, s2, proof, r1, r2 + b"\0")),
        ("negative size", (-1, s2, proof, r1, r2)),
    ]
    if proof != proof[::-1]:
        mutants.append(("reversed proof", (s1, s2, proof[::-1], r1, r2)))
    accepted = [desc for desc, args in mutants if not _refused(verify_consistency, *args)]
    assert accepted == []


@pytest.mark.parametrize("s1,s2", list(_consistency_cases()))
def test_different_consistency_sizes_are_refused_unless_the_proof_shape_is_identical(s1, s2):
    proof = consistency_proof(LEAVES[:s2], s1)
    r1, r2 = ROOTS[s1], ROOTS[s2]
    want = _consistency_shape(s1, s2)
    for a, b in ((s1 - 1, s2), (s1 + 1, s2), (s1, s2 - 1), (s1, s2 + 1), (s1, s2 * 2), (s1 ^ 2, s2)):
        if not 0 < a < b:
            assert _refused(verify_consistency, a, b, proof, r1, r2), (a, b)
            continue
        same = _consistency_shape(a, b) == want
        assert _refused(verify_consistency, a, b, proof, r1, r2) is not same, (a, b)


def test_trivial_consistency_claims_follow_the_rfc():
    verify_consistency(0, 5, [], EMPTY_ROOT, ROOTS[5])
    verify_consistency(5, 5, [], ROOTS[5], ROOTS[5])
    verify_consistency(0, 0, [], EMPTY_ROOT, EMPTY_ROOT)
    for args in [
        (0, 5, [], ROOTS[1], ROOTS[5]),  # a non-empty root for the empty tree
        (0, 5, [ROOTS[5]], EMPTY_ROOT, ROOTS[5]),  # the empty tree needs no proof hashes
        (5, 5, [], ROOTS[5], ROOTS[6]),  # one size, two roots: a fork
        (5, 5, [ROOTS[5]], ROOTS[5], ROOTS[5]),  # equal sizes need no proof hashes
        (6, 5, [], ROOTS[6], ROOTS[5]),  # shrinking
    ]:
        assert _refused(verify_consistency, *args), args


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 100).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n - 1))), st.data())
def test_random_bit_flips_in_larger_proofs_are_refused(case, data):
    n, k = case
    hashes = _tree(n)
    root = root_hash(hashes)
    index = k - 1
    proof = inclusion_proof(hashes, index)
    if proof:
        i = data.draw(st.integers(0, len(proof) - 1))
        bit = data.draw(st.integers(0, 255))
        bad = list(proof)
        bad[i] = _flip(bad[i], bit)
        assert _refused(verify_inclusion, index, n, hashes[index], bad, root)
    cproof = consistency_proof(hashes, k)
    i = data.draw(st.integers(0, len(cproof) - 1))
    bit = data.draw(st.integers(0, 255))
    bad = list(cproof)
    bad[i] = _flip(bad[i], bit)
    assert _refused(verify_consistency, k, n, bad, root_hash(hashes[:k]), root)
    assert _refused(verify_consistency, k, n, cproof, root, root_hash(hashes[:k]))
