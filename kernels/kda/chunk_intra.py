"""The intra-chunk half of the KDA prefill (docs/KDA.md, chunked prefill) in two launches, the structure fla
uses: a diagonal pass with one program per 16-row sub-chunk (its diagonal blocks of A and P, Q̃, K̄, the
row norms, and the sub-chunk's own (I + A_ii)^{-1}), then one program per chunk for the off-diagonal
blocks (K in BK-wide slices, so few registers) and the merged inverse X = (I + A)^{-1}; a third launch
applies it, W = X·Diag(β)·K̃ and U = X·Diag(β)·V, as whole-chunk products.

Norms factor out of every product: A_rj = β_r·n_r·n_j·Σ_d k_r[d]·k_j[d]·e^{Γ_r[d]−Γ_j[d]} with n the
inverse L2 norm of the raw key row, so the off-diagonal pass multiplies raw q and k and scales the 16×16
results by the norms the diagonal pass stored; it never holds a K-wide normalised tile.

Scratch rows are token rows (the chunk's rows only: rows past the chunk's end belong to the next one):
p [total, H, BT] gets P (bf16, zeros right of the diagonal), x [total, H, BT] gets X (fp32, zeros right
of the diagonal; wu_kernel applies it), rn [total, H, 2] the inverse norms of k and q (q's with the scale),
which the later passes read instead of normalising again.
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
def _beta(b, rows, m):
    """β = sigmoid(b) for the given token rows, zero where m is false."""
    return tl.where(m, tl.sigmoid(tl.load(b + rows, mask=m, other=0.0).to(tl.float32)), 0.0)


@triton.jit
def _gate_tile(a, ea, bias, rows, m, d, K: tl.constexpr, lower_bound):
    """The bounded gate g = L·sigmoid(e^{A_log}·(a + dt_bias)) of the token rows, zero past the chunk."""
    x = tl.load(a + rows[:, None] * K + d[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    return tl.where(m[:, None], lower_bound * tl.sigmoid(ea * (x + bias[None, :])), 0.0)


@triton.jit
def diag_kernel(
    q,
    k,
    a,
    b,
    A_log,
    dt_bias,
    gcum,
    q_tilde,
    k_bar,
    p,
    x_inv,
    rn,
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
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
):
    """Per (chunk, sub-chunk i, head): the bounded gate and Γ for the sub-chunk's rows (the gate of the
    chunk's other sub-chunks summed per channel for the offset before them and for Γ at the chunk's end),
    stored to gcum; inverse norms, Q̃_i and K̄_i, the diagonal blocks P_ii and A_ii (reference point in the
    middle of the sub-chunk, so each factor is within e^{±|L|·BC/2}), zeros right of the diagonal in p,
    then (I + A_ii)^{-1} by forward substitution over rows read back from x."""
    c = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    if i * BC >= n:
        return  # past the chunk's end, or past the chunk count
    ci = tl.arange(0, BC)
    rb = i * BC + ci
    mb = rb < n
    d = tl.arange(0, K)
    rows = (t0 + rb) * H + h
    off = rows[:, None] * K + d[None, :]
    # The gate: every sub-chunk of the chunk in turn (the other programs of this chunk read the same rows,
    # so all but the first read come from L2); this one's own tile kept, the others summed.
    ea = tl.exp(tl.load(A_log + h).to(tl.float32))
    bias = tl.load(dt_bias + h * K + d).to(tl.float32)
    before = tl.zeros([K], dtype=tl.float32)
    g_end = tl.zeros([K], dtype=tl.float32)
    g_own = tl.zeros([BC, K], dtype=tl.float32)
    for j in tl.static_range(BT // BC):
        rj = j * BC + ci
        gj = _gate_tile(a, ea, bias, (t0 + rj) * H + h, rj < n, d, K, lower_bound)
        sj = tl.sum(gj, axis=0)
        g_end += sj
        before += tl.where(i > j, sj, 0.0)
        g_own = tl.where(i == j, gj, g_own)
    gi = before[None, :] + tl.cumsum(g_own, axis=0)
    tl.store(gcum + off, gi, mask=mb[:, None])
    kk = tl.load(k + off, mask=mb[:, None], other=0.0).to(tl.float32)
    qq = tl.load(q + off, mask=mb[:, None], other=0.0).to(tl.float32)
    nk = 1.0 / tl.sqrt(tl.sum(kk * kk, axis=1) + 1e-6)
    nq = scale / tl.sqrt(tl.sum(qq * qq, axis=1) + 1e-6)
    tl.store(rn + rows * 2, nk, mask=mb)
    tl.store(rn + rows * 2 + 1, nq, mask=mb)
    kh = kk * nk[:, None]
    qh = qq * nq[:, None]
    tl.store(q_tilde + off, (qh * tl.exp(gi)).to(q_tilde.dtype.element_ty), mask=mb[:, None])
    tl.store(k_bar + off, (kh * tl.exp(g_end[None, :] - gi)).to(k_bar.dtype.element_ty), mask=mb[:, None])
    beta = _beta(b, rows, mb)
    mid = tl.minimum(BC // 2, n - 1 - i * BC)  # the reference row, within the sub-chunk
    g_mid = tl.sum(tl.where((ci == mid)[:, None], gi, 0.0), axis=0)
    rf = tl.exp(tl.where(mb[:, None], gi - g_mid[None, :], float("-inf")))
    cf = tl.exp(tl.where(mb[:, None], g_mid[None, :] - gi, float("-inf")))
    kc = (kh * cf).to(DT)
    aa = tl.dot((kh * rf).to(DT), tl.trans(kc))
    pq = tl.dot((qh * rf).to(DT), tl.trans(kc))
    aa = tl.where(ci[None, :] < ci[:, None], aa, 0.0) * beta[:, None]
    pq = tl.where(ci[None, :] <= ci[:, None], pq, 0.0)
    cols = tl.arange(0, BT)
    right = mb[:, None] & (cols >= (i + 1) * BC)[None, :]
    prow = p + rows[:, None] * BT
    tl.store(prow + rb[None, :], pq.to(p.dtype.element_ty), mask=mb[:, None])
    tl.store(prow + cols[None, :], tl.zeros([BC, BT], dtype=p.dtype.element_ty), mask=right)
    xrow = x_inv + rows[:, None] * BC + ci[None, :]
    tl.store(xrow, aa, mask=mb[:, None])
    tl.debug_barrier()
    # Y = (I + A_ii)^{-1} − I, row by row: Y_s = −A_s − Σ_{m<s} A_sm·Y_m (rows 0 and 1 are −A's own).
    y = -aa
    for s in range(2, BC):
        row = x_inv + ((t0 + i * BC + s) * H + h) * BC + ci
        a_s = tl.load(row, mask=(ci < s) & (i * BC + s < n), other=0.0)
        y_s = -a_s - tl.sum(a_s[:, None] * y, axis=0)
        y = tl.where((ci == s)[:, None], y_s[None, :], y)
    tl.debug_barrier()
    eye = tl.where(ci[:, None] == ci[None, :], 1.0, 0.0)
    tl.store(xrow, y + eye, mask=mb[:, None])


@triton.jit
def _mm(x, y):
    # The merge's 16×16 products stay full fp32: their errors would be amplified through the inverse.
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _rows(t0, n, h, j: tl.constexpr, H: tl.constexpr, BC: tl.constexpr):
    r = j * BC + tl.arange(0, BC)
    return (t0 + r) * H + h, r < n


@triton.jit
def _ktile(k, gcum, rows, m, dk, gn, K: tl.constexpr, DT: tl.constexpr):
    """Raw key rows of an earlier sub-chunk times e^{Γ_n − Γ_j} (≤ 1), transposed for the product."""
    off = rows[:, None] * K + dk[None, :]
    kj = tl.load(k + off, mask=m[:, None], other=0.0).to(tl.float32)
    gj = tl.load(gcum + off, mask=m[:, None], other=0.0)
    return tl.trans((kj * tl.exp(tl.where(m[:, None], gn[None, :] - gj, float("-inf")))).to(DT))


@triton.jit
def _qk_rows(q, k, gcum, rows, m, dk, gn, K: tl.constexpr, DT: tl.constexpr):
    """Raw query and key rows of sub-chunk i times e^{Γ_r − Γ_n} (≤ 1), n its first row."""
    off = rows[:, None] * K + dk[None, :]
    gi = tl.load(gcum + off, mask=m[:, None], other=0.0)
    e = tl.exp(tl.where(m[:, None], gi - gn[None, :], float("-inf")))
    qi = tl.load(q + off, mask=m[:, None], other=0.0).to(tl.float32) * e
    ki = tl.load(k + off, mask=m[:, None], other=0.0).to(tl.float32) * e
    return qi.to(DT), ki.to(DT)


@triton.jit
def _cross(qi, ki, k, gcum, rows_j, m_j, dk, gn, a, p, K: tl.constexpr, DT: tl.constexpr):
    """One K slice of A_ij and P_ij (unscaled) added to the accumulators a and p."""
    kt = _ktile(k, gcum, rows_j, m_j, dk, gn, K, DT)
    return tl.dot(ki, kt, a), tl.dot(qi, kt, p)


@triton.jit
def _store_blk(ptr, rows, m, col0: tl.constexpr, blk, BT: tl.constexpr, BC: tl.constexpr):
    tl.store(ptr + rows[:, None] * BT + (col0 + tl.arange(0, BC))[None, :], blk.to(ptr.dtype.element_ty),
             mask=m[:, None])  # fmt: skip


@triton.jit
def _load_diag(x_inv, rows, m, BC: tl.constexpr):
    """The sub-chunk's own (I + A_ii)^{-1}, as the diagonal pass stored it (zero rows past the chunk)."""
    return tl.load(x_inv + rows[:, None] * BC + tl.arange(0, BC)[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _beta_nk(b, rn, rows, m):
    """β·nk for the rows of a sub-chunk (zero past the chunk), and nk and nq."""
    nk = tl.load(rn + rows * 2, mask=m, other=0.0)
    nq = tl.load(rn + rows * 2 + 1, mask=m, other=0.0)
    return _beta(b, rows, m) * nk, nk, nq


@triton.jit
def _scaled(x, gcum, rows, m, dn, s, N: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr):
    """A sub-chunk's rows of x (row stride N, columns dn) times the row scales s, and by e^{Γ} (≤ 1) where
    DECAY; zero past the chunk."""
    off = rows[:, None] * N + dn[None, :]
    t = tl.load(x + off, mask=m[:, None], other=0.0).to(tl.float32) * s[:, None]
    if DECAY:
        t = t * tl.exp(tl.load(gcum + off, mask=m[:, None], other=0.0))
    return t.to(DT)


@triton.jit
def _put(ptr, rows, m, dn, blk, N: tl.constexpr):
    tl.store(ptr + rows[:, None] * N + dn[None, :], blk.to(ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _apply_x(
    x, gcum, out, s0, s1, s2, s3, r0, r1, r2, r3, m0, m1, m2, m3,
    d0, d1, d2, d3, x10, x20, x21, x30, x31, x32,
    N: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """out = X·(Diag(s)·x [·e^{Γ}]) for the chunk, row block by row block (X_ii = D_i), in BN-wide slices."""
    for nb in tl.static_range(N // BN):
        dn = nb * BN + tl.arange(0, BN)
        t0 = _scaled(x, gcum, r0, m0, dn, s0, N, DECAY, DT)
        _put(out, r0, m0, dn, tl.dot(d0, t0), N)
        if NC >= 2:
            t1 = _scaled(x, gcum, r1, m1, dn, s1, N, DECAY, DT)
            _put(out, r1, m1, dn, tl.dot(d1, t1, tl.dot(x10, t0)), N)
        if NC >= 4:
            t2 = _scaled(x, gcum, r2, m2, dn, s2, N, DECAY, DT)
            _put(out, r2, m2, dn, tl.dot(d2, t2, tl.dot(x21, t1, tl.dot(x20, t0))), N)
            t3 = _scaled(x, gcum, r3, m3, dn, s3, N, DECAY, DT)
            o3 = tl.dot(d3, t3, tl.dot(x32, t2, tl.dot(x31, t1, tl.dot(x30, t0))))
            _put(out, r3, m3, dn, o3, N)


@triton.jit
def inter_solve_kernel(
    q,
    k,
    v,
    b,
    gcum,
    p,
    x_inv,
    rn,
    w,
    u,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
    WU_DT: tl.constexpr,
):
    """Per (chunk, head): the off-diagonal blocks A_ij and P_ij (j < i), each row block split at Γ of its
    own first row (both factors ≤ 1), accumulated over BK-wide slices of K; P_ij to p; the blocks of
    X = (I + A)^{-1} left of the diagonal, X_ij = −D_i·Σ_{j≤m<i} A_im·X_mj, from the diagonal inverses D_i
    in x; then W = X·Diag(β)·K̃ and U = X·Diag(β)·V, X held as its 16×16 blocks."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    NC: tl.constexpr = BT // BC
    if n <= 0:
        return  # past the chunk count
    r0, m0 = _rows(t0, n, h, 0, H, BC)
    r1, m1 = _rows(t0, n, h, 1, H, BC)
    r2, m2 = _rows(t0, n, h, 2, H, BC)
    r3, m3 = _rows(t0, n, h, 3, H, BC)
    bk0, nk0, nq0 = _beta_nk(b, rn, r0, m0)
    bk1, nk1, nq1 = _beta_nk(b, rn, r1, m1)
    bk2, nk2, nq2 = _beta_nk(b, rn, r2, m2)
    bk3, nk3, nq3 = _beta_nk(b, rn, r3, m3)
    d0 = _load_diag(x_inv, r0, m0, BC)
    d1 = _load_diag(x_inv, r1, m1, BC)
    d2 = _load_diag(x_inv, r2, m2, BC)
    d3 = _load_diag(x_inv, r3, m3, BC)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    x10, x20, x21, x30, x31, x32 = z, z, z, z, z, z
    if n > BC:  # more than one sub-chunk: blocks off the diagonal
        a10, p10 = z, z
        a20, p20, a21, p21 = z, z, z, z
        a30, p30, a31, p31, a32, p32 = z, z, z, z, z, z
        for kb in range(K // BK):
            dk = kb * BK + tl.arange(0, BK)
            gn1 = tl.load(gcum + ((t0 + BC) * H + h) * K + dk)
            q1, k1 = _qk_rows(q, k, gcum, r1, m1, dk, gn1, K, DT)
            a10, p10 = _cross(q1, k1, k, gcum, r0, m0, dk, gn1, a10, p10, K, DT)
            if NC >= 3:  # noqa: SIM102 (a constexpr test, then a runtime one)
                if n > 2 * BC:
                    gn2 = tl.load(gcum + ((t0 + 2 * BC) * H + h) * K + dk)
                    q2, k2 = _qk_rows(q, k, gcum, r2, m2, dk, gn2, K, DT)
                    a20, p20 = _cross(q2, k2, k, gcum, r0, m0, dk, gn2, a20, p20, K, DT)
                    a21, p21 = _cross(q2, k2, k, gcum, r1, m1, dk, gn2, a21, p21, K, DT)
            if NC >= 4:  # noqa: SIM102
                if n > 3 * BC:
                    gn3 = tl.load(gcum + ((t0 + 3 * BC) * H + h) * K + dk)
                    q3, k3 = _qk_rows(q, k, gcum, r3, m3, dk, gn3, K, DT)
                    a30, p30 = _cross(q3, k3, k, gcum, r0, m0, dk, gn3, a30, p30, K, DT)
                    a31, p31 = _cross(q3, k3, k, gcum, r1, m1, dk, gn3, a31, p31, K, DT)
                    a32, p32 = _cross(q3, k3, k, gcum, r2, m2, dk, gn3, a32, p32, K, DT)
        # Norms and β: A_ij ·= β_i·nk_i·nk_jᵀ, P_ij ·= nq_i·nk_jᵀ (nq carries the scale).
        _store_blk(p, r1, m1, 0, p10 * nq1[:, None] * nk0[None, :], BT, BC)
        x10 = -_mm(d1, _mm(a10 * bk1[:, None] * nk0[None, :], d0))
        if NC >= 3:  # noqa: SIM102
            if n > 2 * BC:
                a20 = a20 * bk2[:, None] * nk0[None, :]
                a21 = a21 * bk2[:, None] * nk1[None, :]
                _store_blk(p, r2, m2, 0, p20 * nq2[:, None] * nk0[None, :], BT, BC)
                _store_blk(p, r2, m2, BC, p21 * nq2[:, None] * nk1[None, :], BT, BC)
                x21 = -_mm(d2, _mm(a21, d1))
                x20 = -_mm(d2, _mm(a20, d0) + _mm(a21, x10))
                if NC >= 4:  # noqa: SIM102
                    if n > 3 * BC:
                        a30 = a30 * bk3[:, None] * nk0[None, :]
                        a31 = a31 * bk3[:, None] * nk1[None, :]
                        a32 = a32 * bk3[:, None] * nk2[None, :]
                        _store_blk(p, r3, m3, 0, p30 * nq3[:, None] * nk0[None, :], BT, BC)
                        _store_blk(p, r3, m3, BC, p31 * nq3[:, None] * nk1[None, :], BT, BC)
                        _store_blk(p, r3, m3, 2 * BC, p32 * nq3[:, None] * nk2[None, :], BT, BC)
                        x32 = -_mm(d3, _mm(a32, d2))
                        x31 = -_mm(d3, _mm(a31, d1) + _mm(a32, x21))
                        x30 = -_mm(d3, _mm(a30, d0) + _mm(a31, x10) + _mm(a32, x20))
    # W = X·Diag(β·nk)·(k ⊙ e^{Γ}) and U = X·Diag(β)·V; X's blocks and the slices in WU_DT, fp32 sums.
    d0, d1, d2, d3 = d0.to(WU_DT), d1.to(WU_DT), d2.to(WU_DT), d3.to(WU_DT)
    x10, x20, x21 = x10.to(WU_DT), x20.to(WU_DT), x21.to(WU_DT)
    x30, x31, x32 = x30.to(WU_DT), x31.to(WU_DT), x32.to(WU_DT)
    _apply_x(k, gcum, w, bk0, bk1, bk2, bk3, r0, r1, r2, r3, m0, m1, m2, m3,
             d0, d1, d2, d3, x10, x20, x21, x30, x31, x32, K, BN, NC, True, WU_DT)  # fmt: skip
    b0, b1, b2, b3 = _beta(b, r0, m0), _beta(b, r1, m1), _beta(b, r2, m2), _beta(b, r3, m3)
    _apply_x(v, gcum, u, b0, b1, b2, b3, r0, r1, r2, r3, m0, m1, m2, m3,
             d0, d1, d2, d3, x10, x20, x21, x30, x31, x32, V, BN, NC, False, WU_DT)  # fmt: skip
