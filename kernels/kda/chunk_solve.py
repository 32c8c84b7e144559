"""Per-chunk KDA prefill kernel (KDA.md §4): A and P by 16-row blocks, the blockwise (I + A)^{-1} solve,
W = T·K̃, U = T·V, and the chunk's Q̃ and K̄ — one program per (chunk, head)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_bounds(chunk_indices, cu_seqlens, c, BT: tl.constexpr):
    seq = tl.load(chunk_indices + 2 * c)
    cc = tl.load(chunk_indices + 2 * c + 1)
    bos = tl.load(cu_seqlens + seq)
    eos = tl.load(cu_seqlens + seq + 1)
    t0 = bos + cc * BT
    return t0, tl.minimum(BT, eos - t0)


@triton.jit
def _load_k(k, gcum, t0, n, h, i: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """Sub-chunk i: rows, row mask, L2-normalised k̂ (fp32) and Γ (0 on rows past the chunk)."""
    rb = i * BC + tl.arange(0, BC)
    mb = rb < n
    off = ((t0 + rb) * H + h)[:, None] * K + tl.arange(0, K)[None, :]
    kb = tl.load(k + off, mask=mb[:, None], other=0.0).to(tl.float32)
    kb = kb / tl.sqrt(tl.sum(kb * kb, axis=1) + 1e-6)[:, None]
    gb = tl.load(gcum + off, mask=mb[:, None], other=0.0)
    return rb, mb, off, kb, gb


@triton.jit
def _beta(b, t0, n, h, i: tl.constexpr, H: tl.constexpr, BC: tl.constexpr):
    rb = i * BC + tl.arange(0, BC)
    mb = rb < n
    return tl.where(mb, tl.sigmoid(tl.load(b + (t0 + rb) * H + h, mask=mb, other=0.0).to(tl.float32)), 0.0)


@triton.jit
def _g_row(gcum, t0, h, row, H: tl.constexpr, K: tl.constexpr):
    return tl.load(gcum + ((t0 + row) * H + h) * K + tl.arange(0, K))


@triton.jit
def _cross(
    kr,
    qr,
    k,
    gcum,
    p,
    t0,
    n,
    h,
    g_bnd,
    rb_i,
    mb_i,
    beta_i,
    j: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """A_ij and P_ij for sub-chunks j < i, split at Γ of the row before sub-chunk i (both factors ≤ 1);
    P_ij is stored here, A_ij returned."""
    rb_j, mb_j, off_j, kj, gj = _load_k(k, gcum, t0, n, h, j, H, K, BC)
    kc = (kj * tl.exp(tl.where(mb_j[:, None], g_bnd[None, :] - gj, float("-inf")))).to(kr.dtype)
    a = tl.dot(kr, tl.trans(kc)) * beta_i[:, None]
    pq = tl.dot(qr, tl.trans(kc))
    tl.store(
        p + ((t0 + rb_i) * H + h)[:, None] * BT + rb_j[None, :],
        pq.to(p.dtype.element_ty),
        mask=mb_i[:, None] & (rb_j < BT)[None, :],
    )
    return a


@triton.jit
def _row_block(
    q,
    k,
    b,
    gcum,
    q_tilde,
    k_bar,
    p,
    t0,
    n,
    h,
    g_end,
    scale,
    i: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
):
    """Row sub-chunk i: stores Q̃_i, K̄_i and the P row blocks (zeros right of the diagonal block);
    returns the diagonal A_ii and the normalised, boundary-scaled k̂_i, q̂_i used for the cross blocks."""
    rb, mb, off, ki, gi = _load_k(k, gcum, t0, n, h, i, H, K, BC)
    qi = tl.load(q + off, mask=mb[:, None], other=0.0).to(tl.float32)
    qi = qi * (scale / tl.sqrt(tl.sum(qi * qi, axis=1) + 1e-6))[:, None]
    tl.store(q_tilde + off, (qi * tl.exp(gi)).to(q_tilde.dtype.element_ty), mask=mb[:, None])
    tl.store(k_bar + off, (ki * tl.exp(g_end[None, :] - gi)).to(k_bar.dtype.element_ty), mask=mb[:, None])
    beta_i = _beta(b, t0, n, h, i, H, BC)
    # Diagonal block: reference point in the middle of the sub-chunk (each factor within e^{±|L|·BC/2}).
    g_mid = _g_row(gcum, t0, h, tl.minimum(i * BC + BC // 2, tl.maximum(n - 1, 0)), H, K)
    rf = tl.exp(tl.where(mb[:, None], gi - g_mid[None, :], float("-inf")))
    cf = tl.exp(tl.where(mb[:, None], g_mid[None, :] - gi, float("-inf")))
    kc = (ki * cf).to(DT)
    a = tl.dot((ki * rf).to(DT), tl.trans(kc))
    pq = tl.dot((qi * rf).to(DT), tl.trans(kc))
    c = tl.arange(0, BC)
    a = tl.where(c[None, :] < c[:, None], a, 0.0) * beta_i[:, None]
    pq = tl.where(c[None, :] <= c[:, None], pq, 0.0)
    prow = p + ((t0 + rb) * H + h)[:, None] * BT
    tl.store(prow + rb[None, :], pq.to(p.dtype.element_ty), mask=mb[:, None] & (rb < BT)[None, :])
    zero = tl.zeros([BC, BC], dtype=p.dtype.element_ty)
    for j in tl.static_range(i + 1, BT // BC):
        tl.store(prow + (j * BC + c)[None, :], zero, mask=mb[:, None])
    # Cross blocks: split at Γ of the last row before this sub-chunk.
    g_bnd = _g_row(gcum, t0, h, tl.minimum(tl.maximum(i * BC - 1, 0), tl.maximum(n - 1, 0)), H, K)
    rf = tl.exp(tl.where(mb[:, None], gi - g_bnd[None, :], float("-inf")))
    return a, (ki * rf).to(DT), (qi * rf).to(DT), rb, mb, beta_i, g_bnd


@triton.jit
def _substitute_row(s, A0, A1, A2, A3, X0, X1, X2, X3, BC: tl.constexpr):
    # Row s of each inverse is e_s − Σ_{m<s} A[s, m]·X[m, :]; rows ≥ s of X are still identity rows.
    c = tl.arange(0, BC)
    sel = (c == s)[:, None]
    e_s = tl.where(c == s, 1.0, 0.0)
    a0 = tl.sum(tl.where(sel, A0, 0.0), axis=0)
    a1 = tl.sum(tl.where(sel, A1, 0.0), axis=0)
    a2 = tl.sum(tl.where(sel, A2, 0.0), axis=0)
    a3 = tl.sum(tl.where(sel, A3, 0.0), axis=0)
    X0 = tl.where(sel, (e_s - tl.sum(a0[:, None] * X0, axis=0))[None, :], X0)
    X1 = tl.where(sel, (e_s - tl.sum(a1[:, None] * X1, axis=0))[None, :], X1)
    X2 = tl.where(sel, (e_s - tl.sum(a2[:, None] * X2, axis=0))[None, :], X2)
    X3 = tl.where(sel, (e_s - tl.sum(a3[:, None] * X3, axis=0))[None, :], X3)
    return X0, X1, X2, X3


@triton.jit
def _inv_unit_lower(A0, A1, A2, A3, BC: tl.constexpr, UNROLL: tl.constexpr):
    """(I + A_ii)^{-1} for four strictly lower BC×BC blocks at once, by forward substitution (the four
    independent chains interleave)."""
    c = tl.arange(0, BC)
    eye = tl.where(c[:, None] == c[None, :], 1.0, 0.0)
    X0, X1, X2, X3 = eye, eye, eye, eye
    if UNROLL:
        for s in tl.static_range(1, BC):
            X0, X1, X2, X3 = _substitute_row(s, A0, A1, A2, A3, X0, X1, X2, X3, BC)
    else:
        for s in range(1, BC):
            X0, X1, X2, X3 = _substitute_row(s, A0, A1, A2, A3, X0, X1, X2, X3, BC)
    return X0, X1, X2, X3


@triton.jit
def _inv_by_doubling(A, BC: tl.constexpr):
    """(I + A)^{-1} for a strictly lower BC×BC block (BC = 16) without a serial loop: with M = −A,
    nilpotent (M^16 = 0), the inverse is Σ_k M^k = (I + M)(I + M²)(I + M⁴)(I + M⁸): six fp32 products."""
    c = tl.arange(0, BC)
    eye = tl.where(c[:, None] == c[None, :], 1.0, 0.0)
    m1 = -A
    m2 = _mm(m1, m1)
    m4 = _mm(m2, m2)
    m8 = _mm(m4, m4)
    x = _mm(eye + m1, eye + m2)
    x = _mm(x, eye + m4)
    return _mm(x, eye + m8)


@triton.jit
def _mm(x, y):
    # The solve's 16×16 products stay full fp32: their errors would be amplified through the inverse.
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _store_wu(
    k,
    v,
    b,
    gcum,
    w,
    u,
    t0,
    n,
    h,
    off_i,
    mb_i,
    X0,
    X1,
    X2,
    X3,
    i: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BC: tl.constexpr,
):
    """W_i = Σ_{j≤i} X_ij·(β_j·K̃_j) and U_i = Σ_{j≤i} X_ij·(β_j·V_j); X0..X3 are row block i of X."""
    acc_w = tl.zeros([BC, K], dtype=tl.float32)
    acc_u = tl.zeros([BC, V], dtype=tl.float32)
    for j in tl.static_range(0, i + 1):
        if j == 0:
            x = X0
        elif j == 1:
            x = X1
        elif j == 2:
            x = X2
        else:
            x = X3
        rb_j, mb_j, off_j, kj, gj = _load_k(k, gcum, t0, n, h, j, H, K, BC)
        beta_j = _beta(b, t0, n, h, j, H, BC)
        acc_w += tl.dot(x, kj * tl.exp(gj) * beta_j[:, None])
        offv = ((t0 + rb_j) * H + h)[:, None] * V + tl.arange(0, V)[None, :]
        vj = tl.load(v + offv, mask=mb_j[:, None], other=0.0).to(tl.float32) * beta_j[:, None]
        acc_u += tl.dot(x, vj)
    tl.store(w + off_i, acc_w.to(w.dtype.element_ty), mask=mb_i[:, None])
    rb_i = i * BC + tl.arange(0, BC)
    offu = ((t0 + rb_i) * H + h)[:, None] * V + tl.arange(0, V)[None, :]
    tl.store(u + offu, acc_u.to(u.dtype.element_ty), mask=mb_i[:, None])


@triton.jit
def intra_kernel(
    q,
    k,
    v,
    b,
    gcum,
    q_tilde,
    k_bar,
    w,
    u,
    p,
    x_inv,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    SOLVE_UNROLL: tl.constexpr,
    SOLVE_DOUBLING: tl.constexpr,
    SPLIT_WU: tl.constexpr,
    AP_DT: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Per (chunk, head), in four BC-row sub-chunks (those past BT, or past the chunk's end, are all-zero
    and solve to the identity): A, P, Q̃, K̄; X = (I + A)^{-1} blockwise from the diagonal inverses;
    W = X·Diag(β)·K̃, U = X·Diag(β)·V. STAGE 0 does it all; STAGE 1 stops after A (stored to x_inv) and
    STAGE 2 starts from it, so neither holds A's ten blocks beside the K-wide operands (fewer registers)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    if DEVICE_COUNT:
        n_chunks = tl.load(n_chunks_ptr)
    if c >= n_chunks:
        return
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, BT)
    if STAGE == 2:
        A00, A11 = _get(x_inv, t0, h, n, 0, 0, H, BT, BC), _get(x_inv, t0, h, n, 1, 1, H, BT, BC)
        A22, A33 = _get(x_inv, t0, h, n, 2, 2, H, BT, BC), _get(x_inv, t0, h, n, 3, 3, H, BT, BC)
        A10, A20 = _get(x_inv, t0, h, n, 1, 0, H, BT, BC), _get(x_inv, t0, h, n, 2, 0, H, BT, BC)
        A21, A30 = _get(x_inv, t0, h, n, 2, 1, H, BT, BC), _get(x_inv, t0, h, n, 3, 0, H, BT, BC)
        A31, A32 = _get(x_inv, t0, h, n, 3, 1, H, BT, BC), _get(x_inv, t0, h, n, 3, 2, H, BT, BC)
    else:
        g_end = _g_row(gcum, t0, h, n - 1, H, K)
        # Row sub-chunk 0.
        A00, kr, qr, rb, mb, beta, g_bnd = _row_block(
            q, k, b, gcum, q_tilde, k_bar, p, t0, n, h, g_end, scale, 0, H, K, BT, BC, AP_DT
        )
        if STAGE == 1:
            _put(x_inv, t0, h, n, 0, 0, A00, H, BT, BC)
        # Row sub-chunk 1.
        A11, kr, qr, rb, mb, beta, g_bnd = _row_block(
            q, k, b, gcum, q_tilde, k_bar, p, t0, n, h, g_end, scale, 1, H, K, BT, BC, AP_DT
        )
        if STAGE == 1:
            _put(x_inv, t0, h, n, 1, 1, A11, H, BT, BC)
        A10 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 0, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 1, 0, A10, H, BT, BC)
        # Row sub-chunk 2.
        A22, kr, qr, rb, mb, beta, g_bnd = _row_block(
            q, k, b, gcum, q_tilde, k_bar, p, t0, n, h, g_end, scale, 2, H, K, BT, BC, AP_DT
        )
        if STAGE == 1:
            _put(x_inv, t0, h, n, 2, 2, A22, H, BT, BC)
        A20 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 0, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 2, 0, A20, H, BT, BC)
        A21 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 1, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 2, 1, A21, H, BT, BC)
        # Row sub-chunk 3.
        A33, kr, qr, rb, mb, beta, g_bnd = _row_block(
            q, k, b, gcum, q_tilde, k_bar, p, t0, n, h, g_end, scale, 3, H, K, BT, BC, AP_DT
        )
        if STAGE == 1:
            _put(x_inv, t0, h, n, 3, 3, A33, H, BT, BC)
        A30 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 0, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 3, 0, A30, H, BT, BC)
        A31 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 1, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 3, 1, A31, H, BT, BC)
        A32 = _cross(kr, qr, k, gcum, p, t0, n, h, g_bnd, rb, mb, beta, 2, H, K, BT, BC)
        if STAGE == 1:
            _put(x_inv, t0, h, n, 3, 2, A32, H, BT, BC)
    if STAGE == 1:
        return
    d = tl.arange(0, K)
    rc = tl.arange(0, BC)
    mb0, mb1, mb2, mb3 = rc < n, BC + rc < n, 2 * BC + rc < n, 3 * BC + rc < n
    off0 = ((t0 + rc) * H + h)[:, None] * K + d[None, :]
    off1 = ((t0 + BC + rc) * H + h)[:, None] * K + d[None, :]
    off2 = ((t0 + 2 * BC + rc) * H + h)[:, None] * K + d[None, :]
    off3 = ((t0 + 3 * BC + rc) * H + h)[:, None] * K + d[None, :]
    # X = (I + A)^{-1}: diagonal blocks by substitution, then X_ij = −D_i·Σ_{j≤m<i} A_im·X_mj.
    if SOLVE_DOUBLING:
        D0 = _inv_by_doubling(A00, BC)
        D1 = _inv_by_doubling(A11, BC)
        D2 = _inv_by_doubling(A22, BC)
        D3 = _inv_by_doubling(A33, BC)
    else:
        D0, D1, D2, D3 = _inv_unit_lower(A00, A11, A22, A33, BC, SOLVE_UNROLL)
    X10 = -_mm(D1, _mm(A10, D0))
    X21 = -_mm(D2, _mm(A21, D1))
    X20 = -_mm(D2, _mm(A20, D0) + _mm(A21, X10))
    X32 = -_mm(D3, _mm(A32, D2))
    X31 = -_mm(D3, _mm(A31, D1) + _mm(A32, X21))
    X30 = -_mm(D3, _mm(A30, D0) + _mm(A31, X10) + _mm(A32, X20))
    if SPLIT_WU:
        # X goes to scratch; wu_kernel applies it with full-chunk (BT-wide) products.
        _store_x_row(x_inv, t0, h, mb0, 0, D0, D0, D0, D0, H, BT, BC)
        _store_x_row(x_inv, t0, h, mb1, 1, X10, D1, D1, D1, H, BT, BC)
        _store_x_row(x_inv, t0, h, mb2, 2, X20, X21, D2, D2, H, BT, BC)
        _store_x_row(x_inv, t0, h, mb3, 3, X30, X31, X32, D3, H, BT, BC)
    else:
        _store_wu(k, v, b, gcum, w, u, t0, n, h, off0, mb0, D0, D0, D0, D0, 0, H, K, V, BC)
        _store_wu(k, v, b, gcum, w, u, t0, n, h, off1, mb1, X10, D1, D1, D1, 1, H, K, V, BC)
        _store_wu(k, v, b, gcum, w, u, t0, n, h, off2, mb2, X20, X21, D2, D2, 2, H, K, V, BC)
        _store_wu(k, v, b, gcum, w, u, t0, n, h, off3, mb3, X30, X31, X32, D3, 3, H, K, V, BC)


@triton.jit
def _put(x_inv, t0, h, n, i: tl.constexpr, j: tl.constexpr, blk, H: tl.constexpr, BT: tl.constexpr,
         BC: tl.constexpr):  # fmt: skip
    """Block (i, j) of a chunk's BT×BT matrix into the token-row scratch (rows past the chunk untouched)."""
    c = tl.arange(0, BC)
    if j * BC < BT:
        ptr = x_inv + ((t0 + i * BC + c) * H + h)[:, None] * BT + (j * BC + c)[None, :]
        tl.store(ptr, blk, mask=(i * BC + c < n)[:, None])


@triton.jit
def _get(x_inv, t0, h, n, i: tl.constexpr, j: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
         BC: tl.constexpr):  # fmt: skip
    """Block (i, j) as _put left it; zero on rows past the chunk (or past BT)."""
    c = tl.arange(0, BC)
    if j * BC < BT:
        ptr = x_inv + ((t0 + i * BC + c) * H + h)[:, None] * BT + (j * BC + c)[None, :]
        return tl.load(ptr, mask=(i * BC + c < n)[:, None], other=0.0)
    else:
        return tl.zeros([BC, BC], dtype=tl.float32)


@triton.jit
def _store_x_row(
    x_inv, t0, h, mb, i: tl.constexpr, X0, X1, X2, X3, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):
    """Row sub-chunk i of X: blocks X_i0..X_ii, zeros right of the diagonal (only columns < BT exist)."""
    c = tl.arange(0, BC)
    row = x_inv + ((t0 + i * BC + c) * H + h)[:, None] * BT
    for j in tl.static_range(0, BT // BC):
        if j == 0:
            x = X0
        elif j == 1:
            x = X1
        elif j == 2:
            x = X2
        else:
            x = X3
        if j > i:
            x = tl.zeros([BC, BC], dtype=tl.float32)
        tl.store(row + (j * BC + c)[None, :], x, mask=mb[:, None])


@triton.jit
def wu_kernel(
    k,
    v,
    b,
    gcum,
    x_inv,
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
):
    """Per (chunk, head): W = X·(Diag(β)·K̃) and U = X·(Diag(β)·V) as whole-chunk products."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    if DEVICE_COUNT:
        n_chunks = tl.load(n_chunks_ptr)
    if c >= n_chunks:
        return
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, BT)
    r = tl.arange(0, BT)
    mr = (r < n)[:, None]
    rows = (t0 + r) * H + h
    x = tl.load(x_inv + rows[:, None] * BT + r[None, :], mask=mr & (r < n)[None, :], other=0.0).to(DT)
    beta = tl.where(r < n, tl.sigmoid(tl.load(b + rows, mask=r < n, other=0.0).to(tl.float32)), 0.0)
    offk = rows[:, None] * K + tl.arange(0, K)[None, :]
    kk = tl.load(k + offk, mask=mr, other=0.0).to(tl.float32)
    kk = kk / tl.sqrt(tl.sum(kk * kk, axis=1) + 1e-6)[:, None]
    kt = kk * tl.exp(tl.load(gcum + offk, mask=mr, other=0.0)) * beta[:, None]
    tl.store(w + offk, tl.dot(x, kt.to(DT)).to(w.dtype.element_ty), mask=mr)
    offv = rows[:, None] * V + tl.arange(0, V)[None, :]
    vv = tl.load(v + offv, mask=mr, other=0.0).to(tl.float32) * beta[:, None]
    tl.store(u + offv, tl.dot(x, vv.to(DT)).to(u.dtype.element_ty), mask=mr)
