"""The intra-chunk half of the KDA prefill (docs/KDA.md, chunked prefill) in one launch: one program per
(chunk, head) computes the bounded gate and its within-chunk cumulative sum Γ, the normalised q̂ and k̂,
Q̃ = q̂·e^Γ, K̄ = k̂·e^{Γ_C − Γ} and β·K̃ = β·k̂·e^Γ, the matrices A and P, and the inverse
X = (I + A)^{-1}; it writes only what the sequential pass reads: Q̃, K̄, β·K̃, Γ_C (per chunk), P and X.
Γ itself never leaves the program.

The whole chunk is one [BT, BK] tile per K slice (BK-wide slices of K, so no K-wide tile is held), and A
and P are each one [BT, BT] accumulator: every product is a whole-chunk dot whose exponent is split at a
point where neither factor overflows, and whose entries outside the blocks it is exact for are masked:

- the pair dot: rows and columns of each 32-row pair of sub-chunks (16 rows each) against Γ at the pair's
  middle boundary (each factor within e^{±|L|·16}); exact for the diagonal blocks and the block just below
  each (blocks (0,0), (1,0), (1,1), (2,2), (3,2), (3,3) of a 64-token chunk);
- the quadrant dot (64-token chunks): rows 32..63 against columns 0..31 at Γ of row 31, where both
  factors are at most 1; exact for blocks (2,0), (2,1), (3,0), (3,1), and zero elsewhere by its operands.

q and k are normalised before the slice loop (one pass over the rows for the norms), so every operand is
bounded by its norm times its factor. After the loop, β goes on A's rows; A (fp32, strictly lower) is
written to the program's rows of x, the diagonal inverses D_i = (I + A_ii)^{-1} are found by forward
substitution over rows read back, and the blocks left of the diagonal X_ij = −D_i·Σ_{j≤m<i} A_im·X_mj
(full fp32: errors there are amplified through the inverse) are written over A's.

Scratch rows are token rows (the chunk's rows only); Γ_C is kept per chunk, at the chunk's index in the
chunk list, which is where the sequential pass finds it (chunk_offsets[seq] + chunk within the sequence).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_bounds(
    chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT: tl.constexpr, DEVICE_COUNT: tl.constexpr
):
    """First token row and row count of chunk c; 0 rows for a program past the chunk count (the count is
    read from n_chunks_ptr when DEVICE_COUNT, so one captured grid serves any count)."""
    if DEVICE_COUNT:
        n_chunks = tl.load(n_chunks_ptr)
    live = c < n_chunks
    seq = tl.load(chunk_indices + 2 * c, mask=live, other=0)
    cc = tl.load(chunk_indices + 2 * c + 1, mask=live, other=0)
    bos = tl.load(cu_seqlens + seq)
    eos = tl.load(cu_seqlens + seq + 1)
    t0 = bos + cc * BT
    return t0, tl.where(live, tl.minimum(BT, eos - t0), 0)


@triton.jit
def _load(ptr, rows, m, dk, K: tl.constexpr):
    return tl.load(ptr + rows[:, None] * K + dk[None, :], mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _row_of(x, r, j):
    """Row j of the [BT, BK] tile x (rows indexed by r), as a [BK] vector."""
    return tl.sum(tl.where((r == j)[:, None], x, 0.0), axis=0)


@triton.jit
def _diag_inverse(x, t0, n, h, i: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """(I + A_ii)^{-1} for diagonal block i of the strictly lower A stored in x, by forward substitution:
    with Y = (I + A_ii)^{-1} − I, row s is Y_s = −A_s − Σ_{m<s} A_sm·Y_m (rows 0 and 1 are −A's own)."""
    ci = tl.arange(0, BC)
    rb = i * BC + ci
    rows = (t0 + rb) * H + h
    y = -tl.load(x + rows[:, None] * BT + rb[None, :], mask=(rb < n)[:, None], other=0.0)
    for s in tl.static_range(2, BC):
        a_s = tl.load(x + ((t0 + i * BC + s) * H + h) * BT + rb, mask=(ci < s) & (i * BC + s < n), other=0.0)
        y_s = -a_s - tl.sum(a_s[:, None] * y, axis=0)
        y = tl.where((ci == s)[:, None], y_s[None, :], y)
    return y + tl.where(ci[:, None] == ci[None, :], 1.0, 0.0)


@triton.jit
def _blk(x, t0, n, h, i: tl.constexpr, j: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
         BC: tl.constexpr):  # fmt: skip
    """Block (i, j) of the [BT, BT] matrix stored in x's rows."""
    ci = tl.arange(0, BC)
    rb = i * BC + ci
    ptr = x + ((t0 + rb) * H + h)[:, None] * BT + (j * BC + ci)[None, :]
    return tl.load(ptr, mask=(rb < n)[:, None], other=0.0)


@triton.jit
def _put(x, t0, n, h, i: tl.constexpr, j: tl.constexpr, blk, H: tl.constexpr, BT: tl.constexpr,
         BC: tl.constexpr):  # fmt: skip
    ci = tl.arange(0, BC)
    rb = i * BC + ci
    ptr = x + ((t0 + rb) * H + h)[:, None] * BT + (j * BC + ci)[None, :]
    tl.store(ptr, blk, mask=(rb < n)[:, None])


@triton.jit
def _mm(x, y):
    # The merge's 16×16 products stay full fp32: their errors would be amplified through the inverse.
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def intra_kernel(
    q,
    k,
    a,
    b,
    A_log,
    dt_bias,
    q_tilde,
    k_bar,
    kt,
    p,
    x,
    glast,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    scale,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
):
    """Per (chunk, head): see the module docstring. BT is 16, 32 or 64 (one, two or four sub-chunks)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    if n <= 0:
        return
    r = tl.arange(0, BT)
    m = r < n
    rows = (t0 + r) * H + h
    # The norms first, over the same K slices as the main loop (so they come out in its layout).
    sq = tl.zeros([BT], dtype=tl.float32)
    sk = tl.zeros([BT], dtype=tl.float32)
    for kb in range(K // BK):
        dk = kb * BK + tl.arange(0, BK)
        qq = _load(q, rows, m, dk, K)
        kk = _load(k, rows, m, dk, K)
        sq += tl.sum(qq * qq, axis=1)
        sk += tl.sum(kk * kk, axis=1)
    nq = scale / tl.sqrt(sq + 1e-6)
    nk = 1.0 / tl.sqrt(sk + 1e-6)
    beta = tl.where(m, tl.sigmoid(tl.load(b + rows, mask=m, other=0.0).to(tl.float32)), 0.0)
    A = tl.exp(tl.load(A_log + h).to(tl.float32))
    # Which entries each dot is exact for: the same 32-row pair (the pair dot); the quadrant dot's
    # operands are zero outside rows ≥ 32 x columns < 32.
    same_pair = (r[:, None] // (2 * BC)) == (r[None, :] // (2 * BC))
    low, left = r >= 2 * BC, r < 2 * BC
    acc_a = tl.zeros([BT, BT], dtype=tl.float32)
    acc_p = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(K // BK):
        dk = kb * BK + tl.arange(0, BK)
        bias = tl.load(dt_bias + h * K + dk).to(tl.float32)
        g = lower_bound * tl.sigmoid(A * (_load(a, rows, m, dk, K) + bias[None, :]))
        G = tl.cumsum(tl.where(m[:, None], g, 0.0), axis=0)  # rows past the chunk decay nothing
        g_c = _row_of(G, r, BT - 1)  # Γ_C
        kh = _load(k, rows, m, dk, K) * nk[:, None]
        qh = _load(q, rows, m, dk, K) * nq[:, None]
        off = rows[:, None] * K + dk[None, :]
        eg = tl.exp(G)
        tl.store(q_tilde + off, (qh * eg).to(q_tilde.dtype.element_ty), mask=m[:, None])
        tl.store(kt + off, (kh * (eg * beta[:, None])).to(kt.dtype.element_ty), mask=m[:, None])
        tl.store(k_bar + off, (kh * tl.exp(g_c[None, :] - G)).to(k_bar.dtype.element_ty), mask=m[:, None])
        tl.store(glast + (c * H + h) * K + dk, g_c)
        # The pair dot.
        ref_lo = _row_of(G, r, BC - 1)
        if BT == 64:
            ref_hi = _row_of(G, r, 3 * BC - 1)
        else:
            ref_hi = ref_lo
        ref = tl.where((r < 2 * BC)[:, None], ref_lo[None, :], ref_hi[None, :])
        rf = tl.exp(G - ref)
        col = tl.trans((kh * tl.exp(ref - G)).to(DT))
        acc_a += tl.where(same_pair, tl.dot((kh * rf).to(DT), col), 0.0)
        acc_p += tl.where(same_pair, tl.dot((qh * rf).to(DT), col), 0.0)
        if BT == 64:
            # The quadrant dot: rows below row 31 against columns up to it, split at Γ of row 31.
            mid = _row_of(G, r, 2 * BC - 1)[None, :]
            f = tl.exp(tl.where(low[:, None], G - mid, mid - G))
            col = tl.trans(tl.where(left[:, None], kh * f, 0.0).to(DT))
            acc_a = tl.dot(tl.where(low[:, None], kh * f, 0.0).to(DT), col, acc_a)
            acc_p = tl.dot(tl.where(low[:, None], qh * f, 0.0).to(DT), col, acc_p)
    # P is done; A gets β on its rows and goes to x (fp32, strictly lower), where the inverse is assembled.
    lower_eq = r[None, :] <= r[:, None]
    tile = rows[:, None] * BT + r[None, :]
    tl.store(p + tile, tl.where(lower_eq, acc_p, 0.0).to(p.dtype.element_ty), mask=m[:, None])
    tl.store(x + tile, tl.where(r[None, :] < r[:, None], acc_a * beta[:, None], 0.0), mask=m[:, None])
    tl.debug_barrier()
    NC: tl.constexpr = BT // BC
    d0 = _diag_inverse(x, t0, n, h, 0, H, BT, BC)
    if NC >= 2:
        d1 = _diag_inverse(x, t0, n, h, 1, H, BT, BC)
        x10 = -_mm(d1, _mm(_blk(x, t0, n, h, 1, 0, H, BT, BC), d0))
    if NC >= 4:
        d2 = _diag_inverse(x, t0, n, h, 2, H, BT, BC)
        d3 = _diag_inverse(x, t0, n, h, 3, H, BT, BC)
        a21 = _blk(x, t0, n, h, 2, 1, H, BT, BC)
        x21 = -_mm(d2, _mm(a21, d1))
        x20 = -_mm(d2, _mm(_blk(x, t0, n, h, 2, 0, H, BT, BC), d0) + _mm(a21, x10))
        a31 = _blk(x, t0, n, h, 3, 1, H, BT, BC)
        a32 = _blk(x, t0, n, h, 3, 2, H, BT, BC)
        x32 = -_mm(d3, _mm(a32, d2))
        x31 = -_mm(d3, _mm(a31, d1) + _mm(a32, x21))
        x30 = -_mm(d3, _mm(_blk(x, t0, n, h, 3, 0, H, BT, BC), d0) + _mm(a31, x10) + _mm(a32, x20))
    tl.debug_barrier()  # every read of A is done before X is written over it
    _put(x, t0, n, h, 0, 0, d0, H, BT, BC)
    if NC >= 2:
        _put(x, t0, n, h, 1, 0, x10, H, BT, BC)
        _put(x, t0, n, h, 1, 1, d1, H, BT, BC)
    if NC >= 4:
        _put(x, t0, n, h, 2, 0, x20, H, BT, BC)
        _put(x, t0, n, h, 2, 1, x21, H, BT, BC)
        _put(x, t0, n, h, 2, 2, d2, H, BT, BC)
        _put(x, t0, n, h, 3, 0, x30, H, BT, BC)
        _put(x, t0, n, h, 3, 1, x31, H, BT, BC)
        _put(x, t0, n, h, 3, 2, x32, H, BT, BC)
        _put(x, t0, n, h, 3, 3, d3, H, BT, BC)
