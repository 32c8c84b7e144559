"""The intra-chunk half of the KDA prefill (docs/KDA.md, chunked prefill). By default
(kernels.kda.chunk._OFFDIAG_IN_DIAG) in two launches: a diagonal pass with one program per 16-row sub-chunk
(its diagonal blocks of A and P, Q̃, K̄, the row norms, the sub-chunk's own (I + A_ii)^{-1}, then its row
block's blocks of A and P left of the diagonal, K in BK-wide slices), and a merge with one program per
chunk (the inverse X = (I + A)^{-1} from those blocks); a third launch applies X, W = X·Diag(β)·K̃ and
U = X·Diag(β)·V, as whole-chunk products. Without it, fla's split: the diagonal pass stops after its own
blocks and one program per chunk (inter_solve_kernel) makes the blocks left of the diagonal and X.

Norms factor out of every product: A_rj = β_r·n_r·n_j·Σ_d k_r[d]·k_j[d]·e^{Γ_r[d]−Γ_j[d]} with n the
inverse L2 norm of the raw key row, so the blocks left of the diagonal are products of raw q and k, their
16×16 results scaled by the norms; no K-wide normalised tile is held for them.

Scratch rows are token rows (the chunk's rows only: rows past the chunk's end belong to the next one):
p [total, H, BT] gets P (bf16), x [total, H, BT] gets X (fp32; wu_kernel applies it), each on and left of
its diagonal only, rn [total, H, 2] the inverse norms of k and q (q's with the scale), which the later
passes read instead of normalising again. Under kernels.kda.chunk._TRIL_LOADS (the default) nothing right
of the diagonal block is written and every reader takes only the lower triangle; without it the diagonal
pass writes zeros there and the readers load whole rows.
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
def _exp(x, EXP: tl.constexpr):
    """The decay factor of a difference x of cumulative gates Γ, by how the gate pass stored Γ (EXP):
    "e": Γ in natural units, e^x by tl.exp (a multiply by log2(e), then sm_90's `ex2.approx`, which keeps
    denormal results with a compare and two predicated multiplies around MUFU.EX2); "e_ftz": the same
    multiply, then `ex2.approx.ftz` (results below fp32's normal range flushed to zero, every other one the
    same value, two instructions against five); "2": Γ stored in log2 units, 2^x by tl.exp2; "2_ftz": 2^x
    by `ex2.approx.ftz`, one instruction. The "_ftz" modes are for compiled code (the interpreter has no
    PTX). log2(e) is declared here, not as a module global: a constexpr global read by a helper entered its
    callers' Triton keys only for callers asked for after it (tests/kernels/test_cache_keys.py)."""
    LOG2E: tl.constexpr = 1.4426950408889634  # in fp32 0x3FB8AA3B: the multiply tl.exp lowers to
    if EXP == "e_ftz" or EXP == "2_ftz":
        if EXP == "e_ftz":
            x = x * LOG2E
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif EXP == "2":
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _beta(b, rows, m):
    """β = sigmoid(b) for the given token rows, zero where m is false."""
    return tl.where(m, tl.sigmoid(tl.load(b + rows, mask=m, other=0.0).to(tl.float32)), 0.0)


@triton.jit
def diag_kernel(
    q,
    k,
    b,
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
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
    ZERO_RIGHT: tl.constexpr,
    OFFDIAG: tl.constexpr = False,
    BK: tl.constexpr = 64,
    NK_SLICES: tl.constexpr = False,
    ROWS_IN_REGS: tl.constexpr = False,
    EXP: tl.constexpr = "e",
    SUB_FIRST: tl.constexpr = False,
):
    """Per (chunk, sub-chunk i, head): inverse norms, Q̃_i and K̄_i, the diagonal blocks P_ii and A_ii
    (reference point in the middle of the sub-chunk, so each factor is within e^{±|L|·BC/2}), with
    ZERO_RIGHT zeros right of the diagonal block in p and x (without it the readers mask those columns),
    then (I + A_ii)^{-1} by forward substitution over rows read back from x. OFFDIAG: then also the row
    block's blocks left of the diagonal, P_ij into p and A_ij (scaled) into x, j < i, from BK-wide K slices
    (_offdiag_blocks); merge_kernel then turns those A_ij into X_ij in place. NK_SLICES: the earlier
    sub-chunks' key norms from the squares of the K slices that loop loads anyway, not from their whole rows
    loaded again (the same norms, summed in another order). ROWS_IN_REGS: the forward substitution takes
    each row of A_ii from the registers (a masked sum over the rows: the same values, exactly) instead of
    storing A_ii and loading it back row by row, a round trip to L2 on each of its 14 dependent steps. EXP:
    how the gate pass stored Γ and how each decay factor is exponentiated (_exp). SUB_FIRST: the grid is
    (sub-chunk, chunk, head) rather than (chunk, sub-chunk, head), so a chunk's sub-chunks are neighbouring
    programs (the earlier sub-chunks' keys and Γ an OFFDIAG program reads again were just read beside it)."""
    if SUB_FIRST:
        i = tl.program_id(0)
        c = tl.program_id(1)
    else:
        c = tl.program_id(0)
        i = tl.program_id(1)
    h = tl.program_id(2)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    if i * BC >= n:
        return  # past the chunk's end, or past the chunk count
    ci = tl.arange(0, BC)
    rb = i * BC + ci
    mb = rb < n
    rows = (t0 + rb) * H + h
    d = tl.arange(0, K)
    off = rows[:, None] * K + d[None, :]
    kk = tl.load(k + off, mask=mb[:, None], other=0.0).to(tl.float32)
    qq = tl.load(q + off, mask=mb[:, None], other=0.0).to(tl.float32)
    gi = tl.load(gcum + off, mask=mb[:, None], other=0.0)
    nk = 1.0 / tl.sqrt(tl.sum(kk * kk, axis=1) + 1e-6)
    nq = scale / tl.sqrt(tl.sum(qq * qq, axis=1) + 1e-6)
    tl.store(rn + rows * 2, nk, mask=mb)
    tl.store(rn + rows * 2 + 1, nq, mask=mb)
    kh = kk * nk[:, None]
    qh = qq * nq[:, None]
    g_end = tl.load(gcum + ((t0 + n - 1) * H + h) * K + d)
    tl.store(q_tilde + off, (qh * _exp(gi, EXP)).to(q_tilde.dtype.element_ty), mask=mb[:, None])
    k_b = kh * _exp(g_end[None, :] - gi, EXP)
    tl.store(k_bar + off, k_b.to(k_bar.dtype.element_ty), mask=mb[:, None])
    beta = _beta(b, rows, mb)
    g_mid = tl.load(gcum + ((t0 + tl.minimum(i * BC + BC // 2, n - 1)) * H + h) * K + d)
    rf = _exp(tl.where(mb[:, None], gi - g_mid[None, :], float("-inf")), EXP)
    cf = _exp(tl.where(mb[:, None], g_mid[None, :] - gi, float("-inf")), EXP)
    kc = (kh * cf).to(DT)
    a = tl.dot((kh * rf).to(DT), tl.trans(kc))
    pq = tl.dot((qh * rf).to(DT), tl.trans(kc))
    a = tl.where(ci[None, :] < ci[:, None], a, 0.0) * beta[:, None]
    pq = tl.where(ci[None, :] <= ci[:, None], pq, 0.0)
    cols = tl.arange(0, BT)
    right = mb[:, None] & (cols >= (i + 1) * BC)[None, :]
    prow = p + rows[:, None] * BT
    tl.store(prow + rb[None, :], pq.to(p.dtype.element_ty), mask=mb[:, None])
    if ZERO_RIGHT:
        tl.store(prow + cols[None, :], tl.zeros([BC, BT], dtype=p.dtype.element_ty), mask=right)
    xrow = x_inv + rows[:, None] * BT
    if not ROWS_IN_REGS:
        tl.store(xrow + rb[None, :], a, mask=mb[:, None])
    if ZERO_RIGHT:
        tl.store(xrow + cols[None, :], tl.zeros([BC, BT], dtype=tl.float32), mask=right)
    tl.debug_barrier()
    eye = tl.where(ci[:, None] == ci[None, :], 1.0, 0.0)
    # Y = (I + A_ii)^{-1} − I, row by row: Y_s = −A_s − Σ_{m<s} A_sm·Y_m (rows 0 and 1 are −A's own).
    y = -a
    for s in range(2, BC):
        if ROWS_IN_REGS:  # row s of A (zero from column s on, and past the chunk's end: a's own zeros)
            a_s = tl.sum(tl.where((ci == s)[:, None], a, 0.0), axis=0)
        else:
            # The whole row: A_ii was stored with its zeros from column s on, so no mask along it is needed
            # (one that moved with s cost a 64-bit compare per element and step); rows past the chunk's end
            # were not stored and load as zeros.
            row = x_inv + ((t0 + i * BC + s) * H + h) * BT + rb
            a_s = tl.load(row, mask=i * BC + s < n, other=0.0)
        y_s = -a_s - tl.sum(a_s[:, None] * y, axis=0)
        y = tl.where((ci == s)[:, None], y_s[None, :], y)
    x_ii = y + eye
    tl.debug_barrier()
    tl.store(xrow + rb[None, :], x_ii, mask=mb[:, None])
    if OFFDIAG:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if i > 0:
            _offdiag_blocks(
                q, k, gcum, p, x_inv, rows, mb, t0, i, h, beta * nk, nq, H, K, BT, BC, BK, DT, NK_SLICES, EXP
            )  # fmt: skip


@triton.jit
def _mm(x, y, PREC: tl.constexpr):
    # The merge's 16×16 products stay (about) full fp32: their errors would be amplified through the inverse.
    # "ieee" multiplies in fp32 on the FMA units; "tf32x3" on the tensor cores, each operand split into two
    # tf32 parts and three products summed (about fp32's precision, fewer registers).
    return tl.dot(x, y, input_precision=PREC)


@triton.jit
def _rows(t0, n, h, j: tl.constexpr, H: tl.constexpr, BC: tl.constexpr):
    r = j * BC + tl.arange(0, BC)
    return (t0 + r) * H + h, r < n


@triton.jit
def _row_blocks(t0, n, h, H: tl.constexpr, BC: tl.constexpr):
    """The token rows and masks of a chunk's four sub-chunks (rows past the chunk, or past BT below four
    sub-chunks, masked)."""
    r0, m0 = _rows(t0, n, h, 0, H, BC)
    r1, m1 = _rows(t0, n, h, 1, H, BC)
    r2, m2 = _rows(t0, n, h, 2, H, BC)
    r3, m3 = _rows(t0, n, h, 3, H, BC)
    return r0, m0, r1, m1, r2, m2, r3, m3


@triton.jit
def _ktile(k, gcum, rows, m, dk, gn, K: tl.constexpr, DT: tl.constexpr, EXP: tl.constexpr = "e"):
    """Raw key rows of an earlier sub-chunk times e^{Γ_n − Γ_j} (≤ 1), transposed for the product."""
    off = rows[:, None] * K + dk[None, :]
    kj = tl.load(k + off, mask=m[:, None], other=0.0).to(tl.float32)
    gj = tl.load(gcum + off, mask=m[:, None], other=0.0)
    return tl.trans((kj * _exp(tl.where(m[:, None], gn[None, :] - gj, float("-inf")), EXP)).to(DT))


@triton.jit
def _ktile_ss(k, gcum, rows, m, dk, gn, ss, K: tl.constexpr, DT: tl.constexpr, EXP: tl.constexpr = "e"):
    """_ktile, and the rows' sums of squares of this slice of the raw keys added to ss."""
    off = rows[:, None] * K + dk[None, :]
    kj = tl.load(k + off, mask=m[:, None], other=0.0).to(tl.float32)
    gj = tl.load(gcum + off, mask=m[:, None], other=0.0)
    kt = tl.trans((kj * _exp(tl.where(m[:, None], gn[None, :] - gj, float("-inf")), EXP)).to(DT))
    return kt, ss + tl.sum(kj * kj, axis=1)


@triton.jit
def _qk_rows(q, k, gcum, rows, m, dk, gn, K: tl.constexpr, DT: tl.constexpr, EXP: tl.constexpr = "e"):
    """Raw query and key rows of sub-chunk i times e^{Γ_r − Γ_n} (≤ 1), n its first row."""
    off = rows[:, None] * K + dk[None, :]
    gi = tl.load(gcum + off, mask=m[:, None], other=0.0)
    e = _exp(tl.where(m[:, None], gi - gn[None, :], float("-inf")), EXP)
    qi = tl.load(q + off, mask=m[:, None], other=0.0).to(tl.float32) * e
    ki = tl.load(k + off, mask=m[:, None], other=0.0).to(tl.float32) * e
    return qi.to(DT), ki.to(DT)


@triton.jit
def _cross(
    qi, ki, k, gcum, rows_j, m_j, dk, gn, a, p, K: tl.constexpr, DT: tl.constexpr, EXP: tl.constexpr = "e"
):
    """One K slice of A_ij and P_ij (unscaled) added to the accumulators a and p."""
    kt = _ktile(k, gcum, rows_j, m_j, dk, gn, K, DT, EXP)
    return tl.dot(ki, kt, a), tl.dot(qi, kt, p)


@triton.jit
def _cross_ss(qi, ki, k, gcum, rows_j, m_j, dk, gn, a, p, ss, K: tl.constexpr, DT: tl.constexpr,
              EXP: tl.constexpr = "e"):  # fmt: skip
    """_cross, and sub-chunk j's sums of squares of this K slice added to ss."""
    kt, ss = _ktile_ss(k, gcum, rows_j, m_j, dk, gn, ss, K, DT, EXP)
    return tl.dot(ki, kt, a), tl.dot(qi, kt, p), ss


@triton.jit
def _store_blk(ptr, rows, m, col0: tl.constexpr, blk, BT: tl.constexpr, BC: tl.constexpr):
    tl.store(ptr + rows[:, None] * BT + (col0 + tl.arange(0, BC))[None, :], blk.to(ptr.dtype.element_ty),
             mask=m[:, None])  # fmt: skip


@triton.jit
def _load_diag(x_inv, rows, m, j: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    ptr = x_inv + rows[:, None] * BT + (j * BC + tl.arange(0, BC))[None, :]
    return tl.load(ptr, mask=m[:, None], other=0.0)


@triton.jit
def _beta_nk(b, rn, rows, m):
    """β·nk for the rows of a sub-chunk (zero past the chunk), and nk and nq."""
    nk = tl.load(rn + rows * 2, mask=m, other=0.0)
    nq = tl.load(rn + rows * 2 + 1, mask=m, other=0.0)
    return _beta(b, rows, m) * nk, nk, nq


@triton.jit
def _offdiag_store(k, p, x_inv, rows, m, rows_j, j: tl.constexpr, a, pq, bk, nq, ss_j, K: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, NK_SLICES: tl.constexpr):  # fmt: skip
    """P_ij ·= nq_i·nk_jᵀ into p and A_ij ·= β_i·nk_i·nk_jᵀ into x, nk_j from sub-chunk j's whole key rows
    (the diagonal pass's own expression for them), or with NK_SLICES from ss_j, their sums of squares
    gathered slice by slice."""
    if NK_SLICES:
        nk_j = 1.0 / tl.sqrt(ss_j + 1e-6)
    else:
        kk = tl.load(k + rows_j[:, None] * K + tl.arange(0, K)[None, :]).to(tl.float32)
        nk_j = 1.0 / tl.sqrt(tl.sum(kk * kk, axis=1) + 1e-6)
    _store_blk(p, rows, m, j * BC, pq * nq[:, None] * nk_j[None, :], BT, BC)
    _store_blk(x_inv, rows, m, j * BC, a * bk[:, None] * nk_j[None, :], BT, BC)


@triton.jit
def _offdiag_blocks(q, k, gcum, p, x_inv, rows, m, t0, i, h, bk, nq, H: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                    NK_SLICES: tl.constexpr, EXP: tl.constexpr = "e"):  # fmt: skip
    """Sub-chunk i's blocks left of the diagonal (0 < i < 4), the off-diagonal pass's arithmetic for one
    row block: A_ij and P_ij split at Γ of the row block's first row (both factors ≤ 1), accumulated over
    BK-wide slices of K, then scaled by the norms and β (bk = β_i·nk_i) and stored (_offdiag_store). The
    earlier sub-chunks are whole (they end before row i·BC, which the chunk holds)."""
    ci = tl.arange(0, BC)
    whole = ci < BC
    r0 = (t0 + ci) * H + h
    r1 = (t0 + BC + ci) * H + h
    r2 = (t0 + 2 * BC + ci) * H + h
    z = tl.zeros([BC, BC], dtype=tl.float32)
    a0, p0, a1, p1, a2, p2 = z, z, z, z, z, z
    s0 = tl.zeros([BC], dtype=tl.float32)
    s1, s2 = s0, s0
    for kb in range(K // BK):
        dk = kb * BK + tl.arange(0, BK)
        gn = tl.load(gcum + ((t0 + i * BC) * H + h) * K + dk)
        qi, ki = _qk_rows(q, k, gcum, rows, m, dk, gn, K, DT, EXP)
        if NK_SLICES:
            a0, p0, s0 = _cross_ss(qi, ki, k, gcum, r0, whole, dk, gn, a0, p0, s0, K, DT, EXP)
            if i > 1:
                a1, p1, s1 = _cross_ss(qi, ki, k, gcum, r1, whole, dk, gn, a1, p1, s1, K, DT, EXP)
            if i > 2:
                a2, p2, s2 = _cross_ss(qi, ki, k, gcum, r2, whole, dk, gn, a2, p2, s2, K, DT, EXP)
        else:
            a0, p0 = _cross(qi, ki, k, gcum, r0, whole, dk, gn, a0, p0, K, DT, EXP)
            if i > 1:
                a1, p1 = _cross(qi, ki, k, gcum, r1, whole, dk, gn, a1, p1, K, DT, EXP)
            if i > 2:
                a2, p2 = _cross(qi, ki, k, gcum, r2, whole, dk, gn, a2, p2, K, DT, EXP)
    _offdiag_store(k, p, x_inv, rows, m, r0, 0, a0, p0, bk, nq, s0, K, BT, BC, NK_SLICES)
    if i > 1:
        _offdiag_store(k, p, x_inv, rows, m, r1, 1, a1, p1, bk, nq, s1, K, BT, BC, NK_SLICES)
    if i > 2:
        _offdiag_store(k, p, x_inv, rows, m, r2, 2, a2, p2, bk, nq, s2, K, BT, BC, NK_SLICES)


@triton.jit
def _solve_blocks(x_inv, n, r0, m0, r1, m1, r2, m2, r3, m3, a10, a20, a21, a30, a31, a32,
                  BT: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr,
                  PREC: tl.constexpr):  # fmt: skip
    """The blocks of X = (I + A)^{-1} left of the diagonal from the scaled blocks A_ij and the diagonal
    inverses D_i in x: X_ij = −D_i·Σ_{j≤m<i} A_im·X_mj, stored into x."""
    d0 = _load_diag(x_inv, r0, m0, 0, BT, BC)
    d1 = _load_diag(x_inv, r1, m1, 1, BT, BC)
    x10 = -_mm(d1, _mm(a10, d0, PREC), PREC)
    _store_blk(x_inv, r1, m1, 0, x10, BT, BC)
    if NC >= 3:  # noqa: SIM102
        if n > 2 * BC:
            d2 = _load_diag(x_inv, r2, m2, 2, BT, BC)
            x21 = -_mm(d2, _mm(a21, d1, PREC), PREC)
            x20 = -_mm(d2, _mm(a20, d0, PREC) + _mm(a21, x10, PREC), PREC)
            _store_blk(x_inv, r2, m2, 0, x20, BT, BC)
            _store_blk(x_inv, r2, m2, BC, x21, BT, BC)
            if NC >= 4:  # noqa: SIM102
                if n > 3 * BC:
                    d3 = _load_diag(x_inv, r3, m3, 3, BT, BC)
                    x32 = -_mm(d3, _mm(a32, d2, PREC), PREC)
                    x31 = -_mm(d3, _mm(a31, d1, PREC) + _mm(a32, x21, PREC), PREC)
                    s30 = _mm(a30, d0, PREC) + _mm(a31, x10, PREC) + _mm(a32, x20, PREC)
                    x30 = -_mm(d3, s30, PREC)
                    _store_blk(x_inv, r3, m3, 0, x30, BT, BC)
                    _store_blk(x_inv, r3, m3, BC, x31, BT, BC)
                    _store_blk(x_inv, r3, m3, 2 * BC, x32, BT, BC)


@triton.jit
def merge_kernel(
    x_inv,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    H: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per (chunk, head), after the diagonal pass with OFFDIAG: X's blocks left of the diagonal from the
    scaled A_ij that pass left in x (_solve_blocks, its products at input precision PREC), in place."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    NC: tl.constexpr = BT // BC
    if n <= BC:
        return  # one sub-chunk, or none (past the chunk count): nothing off the diagonal
    r0, m0, r1, m1, r2, m2, r3, m3 = _row_blocks(t0, n, h, H, BC)
    # Rows past the chunk (and, below four sub-chunks, past BT) are masked: those blocks load as zeros and
    # _solve_blocks reads them only where the chunk holds their rows.
    a10 = _load_diag(x_inv, r1, m1, 0, BT, BC)
    a20 = _load_diag(x_inv, r2, m2 & (NC >= 3), 0, BT, BC)
    a21 = _load_diag(x_inv, r2, m2 & (NC >= 3), 1, BT, BC)
    a30 = _load_diag(x_inv, r3, m3 & (NC >= 4), 0, BT, BC)
    a31 = _load_diag(x_inv, r3, m3 & (NC >= 4), 1, BT, BC)
    a32 = _load_diag(x_inv, r3, m3 & (NC >= 4), 2, BT, BC)
    _solve_blocks(
        x_inv, n, r0, m0, r1, m1, r2, m2, r3, m3, a10, a20, a21, a30, a31, a32, BT, BC, NC, PREC
    )  # fmt: skip


@triton.jit
def inter_solve_kernel(
    q,
    k,
    b,
    gcum,
    p,
    x_inv,
    rn,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
    EXP: tl.constexpr = "e",
):
    """Per (chunk, head): the off-diagonal blocks A_ij and P_ij (j < i), each row block split at Γ of its
    own first row (both factors ≤ 1), accumulated over BK-wide slices of K; P_ij to p; then the blocks of
    X left of the diagonal, X_ij = −D_i·Σ_{j≤m<i} A_im·X_mj, from the diagonal inverses D_i in x."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    NC: tl.constexpr = BT // BC
    if n <= BC:
        return  # one sub-chunk, or none (past the chunk count): nothing off the diagonal
    r0, m0, r1, m1, r2, m2, r3, m3 = _row_blocks(t0, n, h, H, BC)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    a10, p10 = z, z
    a20, p20, a21, p21 = z, z, z, z
    a30, p30, a31, p31, a32, p32 = z, z, z, z, z, z
    for kb in range(K // BK):
        dk = kb * BK + tl.arange(0, BK)
        gn1 = tl.load(gcum + ((t0 + BC) * H + h) * K + dk)
        q1, k1 = _qk_rows(q, k, gcum, r1, m1, dk, gn1, K, DT, EXP)
        a10, p10 = _cross(q1, k1, k, gcum, r0, m0, dk, gn1, a10, p10, K, DT, EXP)
        if NC >= 3:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if n > 2 * BC:
                gn2 = tl.load(gcum + ((t0 + 2 * BC) * H + h) * K + dk)
                q2, k2 = _qk_rows(q, k, gcum, r2, m2, dk, gn2, K, DT, EXP)
                a20, p20 = _cross(q2, k2, k, gcum, r0, m0, dk, gn2, a20, p20, K, DT, EXP)
                a21, p21 = _cross(q2, k2, k, gcum, r1, m1, dk, gn2, a21, p21, K, DT, EXP)
        if NC >= 4:  # noqa: SIM102
            if n > 3 * BC:
                gn3 = tl.load(gcum + ((t0 + 3 * BC) * H + h) * K + dk)
                q3, k3 = _qk_rows(q, k, gcum, r3, m3, dk, gn3, K, DT, EXP)
                a30, p30 = _cross(q3, k3, k, gcum, r0, m0, dk, gn3, a30, p30, K, DT, EXP)
                a31, p31 = _cross(q3, k3, k, gcum, r1, m1, dk, gn3, a31, p31, K, DT, EXP)
                a32, p32 = _cross(q3, k3, k, gcum, r2, m2, dk, gn3, a32, p32, K, DT, EXP)
    # Norms and β: A_ij ·= β_i·nk_i·nk_jᵀ, P_ij ·= nq_i·nk_jᵀ (nq carries the scale).
    nk0 = tl.load(rn + r0 * 2, mask=m0, other=0.0)
    bk1, nk1, nq1 = _beta_nk(b, rn, r1, m1)
    a10 = a10 * bk1[:, None] * nk0[None, :]
    _store_blk(p, r1, m1, 0, p10 * nq1[:, None] * nk0[None, :], BT, BC)
    if NC >= 3:  # noqa: SIM102
        if n > 2 * BC:
            bk2, nk2, nq2 = _beta_nk(b, rn, r2, m2)
            a20 = a20 * bk2[:, None] * nk0[None, :]
            a21 = a21 * bk2[:, None] * nk1[None, :]
            _store_blk(p, r2, m2, 0, p20 * nq2[:, None] * nk0[None, :], BT, BC)
            _store_blk(p, r2, m2, BC, p21 * nq2[:, None] * nk1[None, :], BT, BC)
            if NC >= 4:  # noqa: SIM102
                if n > 3 * BC:
                    bk3, nk3, nq3 = _beta_nk(b, rn, r3, m3)
                    a30 = a30 * bk3[:, None] * nk0[None, :]
                    a31 = a31 * bk3[:, None] * nk1[None, :]
                    a32 = a32 * bk3[:, None] * nk2[None, :]
                    _store_blk(p, r3, m3, 0, p30 * nq3[:, None] * nk0[None, :], BT, BC)
                    _store_blk(p, r3, m3, BC, p31 * nq3[:, None] * nk1[None, :], BT, BC)
                    _store_blk(p, r3, m3, 2 * BC, p32 * nq3[:, None] * nk2[None, :], BT, BC)
    _solve_blocks(
        x_inv, n, r0, m0, r1, m1, r2, m2, r3, m3, a10, a20, a21, a30, a31, a32, BT, BC, NC, "ieee"
    )  # fmt: skip


@triton.jit
def wu_kernel(
    k,
    v,
    b,
    gcum,
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
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
    TRIL: tl.constexpr,
    EXP: tl.constexpr = "e",
):
    """Per (chunk, head): W = X·(Diag(β)·K̃) and U = X·(Diag(β)·V) as whole-chunk products, k normalised by
    the inverse norms the diagonal pass stored in rn. TRIL: X is read on and left of its diagonal only."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    if n <= 0:
        return
    r = tl.arange(0, BT)
    mr = (r < n)[:, None]
    rows = (t0 + r) * H + h
    if TRIL:
        xmask = mr & (r[None, :] <= r[:, None])
    else:
        xmask = mr & (r < n)[None, :]
    x = tl.load(x_inv + rows[:, None] * BT + r[None, :], mask=xmask, other=0.0).to(DT)
    beta = _beta(b, rows, r < n)
    offk = rows[:, None] * K + tl.arange(0, K)[None, :]
    nk = tl.load(rn + rows * 2, mask=r < n, other=0.0)
    kk = tl.load(k + offk, mask=mr, other=0.0).to(tl.float32) * nk[:, None]
    kt = kk * _exp(tl.load(gcum + offk, mask=mr, other=0.0), EXP) * beta[:, None]
    tl.store(w + offk, tl.dot(x, kt.to(DT)).to(w.dtype.element_ty), mask=mr)
    offv = rows[:, None] * V + tl.arange(0, V)[None, :]
    vv = tl.load(v + offv, mask=mr, other=0.0).to(tl.float32) * beta[:, None]
    tl.store(u + offv, tl.dot(x, vv.to(DT)).to(u.dtype.element_ty), mask=mr)
