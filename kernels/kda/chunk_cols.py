"""A and P of each (chunk, head) by column blocks (KDA.md §4): every cross block under column block j in
one BT-row product, split at Γ of block j's last row (both factors ≤ 1), so no 16×16 block is held."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kda.chunk_solve import _chunk_bounds


@triton.jit
def _cols(x, t0, n, h, rows, dk, H: tl.constexpr, K: tl.constexpr):
    """x[rows, dk] as fp32 (0 on rows past the chunk), the row mask and the offsets."""
    m = rows < n
    off = ((t0 + rows) * H + h)[:, None] * K + dk[None, :]
    return tl.load(x + off, mask=m[:, None], other=0.0).to(tl.float32), m, off


@triton.jit
def _inv_norm(x, t0, n, h, rows, H: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr):
    """1 / sqrt(‖row‖² + 1e-6), accumulated over BKC-wide column blocks."""
    ss = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for kb in tl.static_range(K // BKC):
        xb, _, _ = _cols(x, t0, n, h, rows, kb * BKC + tl.arange(0, BKC), H, K)
        ss += tl.sum(xb * xb, axis=1)
    return 1.0 / tl.sqrt(ss + 1e-6)


@triton.jit
def ap_columns_kernel(
    q,
    k,
    b,
    gcum,
    q_tilde,
    k_bar,
    p,
    a_out,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BKC: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    DT: tl.constexpr,
):
    """Per (chunk, head): Q̃, K̄, P (zeros above the diagonal) and A (β applied; only its lower blocks
    are written) into a_out's BT columns per token row, for intra_kernel's solve stage. K is walked in
    BKC-wide blocks so every operand stays small."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    if DEVICE_COUNT:
        n_chunks = tl.load(n_chunks_ptr)
    if c >= n_chunks:
        return
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, BT)
    last = tl.maximum(n - 1, 0)
    r = tl.arange(0, BT)
    col = tl.arange(0, BC)
    mr = r < n
    rk = _inv_norm(k, t0, n, h, r, H, K, BKC)
    rq = _inv_norm(q, t0, n, h, r, H, K, BKC) * scale
    for kb in tl.static_range(K // BKC):
        dk = kb * BKC + tl.arange(0, BKC)
        kb_, _, off = _cols(k, t0, n, h, r, dk, H, K)
        qb, _, _ = _cols(q, t0, n, h, r, dk, H, K)
        gb, _, _ = _cols(gcum, t0, n, h, r, dk, H, K)
        g_end = tl.load(gcum + ((t0 + last) * H + h) * K + dk)
        tl.store(
            q_tilde + off, (qb * rq[:, None] * tl.exp(gb)).to(q_tilde.dtype.element_ty), mask=mr[:, None]
        )
        kbar = kb_ * rk[:, None] * tl.exp(g_end[None, :] - gb)
        tl.store(k_bar + off, kbar.to(k_bar.dtype.element_ty), mask=mr[:, None])
    beta = tl.where(mr, tl.sigmoid(tl.load(b + (t0 + r) * H + h, mask=mr, other=0.0).to(tl.float32)), 0.0)
    row_ptr = ((t0 + r) * H + h)[:, None] * BT
    for j in tl.static_range(BT // BC):
        cols = (j * BC + col)[None, :]
        rows = j * BC + col
        if j < BT // BC - 1:
            # Cross blocks under column block j, split at Γ of block j's last row.
            ref_row = t0 + tl.minimum((j + 1) * BC - 1, last)
            below = (r > (j + 1) * BC - 1) & mr
            rkj = _inv_norm(k, t0, n, h, rows, H, K, BKC)
            ak = tl.zeros([BT, BC], dtype=tl.float32)
            pq = tl.zeros([BT, BC], dtype=tl.float32)
            for kb in tl.static_range(K // BKC):
                dk = kb * BKC + tl.arange(0, BKC)
                g_ref = tl.load(gcum + (ref_row * H + h) * K + dk)
                kj, mj, _ = _cols(k, t0, n, h, rows, dk, H, K)
                gj, _, _ = _cols(gcum, t0, n, h, rows, dk, H, K)
                kc = kj * rkj[:, None] * tl.exp(tl.where(mj[:, None], g_ref[None, :] - gj, float("-inf")))
                kc = tl.trans(kc.to(DT))
                gb, _, _ = _cols(gcum, t0, n, h, r, dk, H, K)
                fl = tl.exp(tl.where(below[:, None], gb - g_ref[None, :], float("-inf")))
                kb_, _, _ = _cols(k, t0, n, h, r, dk, H, K)
                ak += tl.dot((kb_ * rk[:, None] * fl).to(DT), kc)
                qb, _, _ = _cols(q, t0, n, h, r, dk, H, K)
                pq += tl.dot((qb * rq[:, None] * fl).to(DT), kc)
            tl.store(a_out + row_ptr + cols, ak * beta[:, None], mask=below[:, None])
            keep = below | ((r < j * BC) & mr)
            tl.store(p + row_ptr + cols, tl.where(below[:, None], pq, 0.0).to(p.dtype.element_ty),
                     mask=keep[:, None])  # fmt: skip
        else:
            zero = tl.zeros([BT, BC], dtype=tl.float32).to(p.dtype.element_ty)
            tl.store(p + row_ptr + cols, zero, mask=((r < j * BC) & mr)[:, None])
        # Diagonal block (j, j): reference row in the middle of the sub-chunk.
        mi = rows < n
        rki = _inv_norm(k, t0, n, h, rows, H, K, BKC)
        rqi = _inv_norm(q, t0, n, h, rows, H, K, BKC) * scale
        mid_row = t0 + tl.minimum(j * BC + BC // 2, last)
        ad = tl.zeros([BC, BC], dtype=tl.float32)
        pd = tl.zeros([BC, BC], dtype=tl.float32)
        for kb in tl.static_range(K // BKC):
            dk = kb * BKC + tl.arange(0, BKC)
            gm = tl.load(gcum + (mid_row * H + h) * K + dk)
            ki, _, _ = _cols(k, t0, n, h, rows, dk, H, K)
            qi, _, _ = _cols(q, t0, n, h, rows, dk, H, K)
            gi, _, _ = _cols(gcum, t0, n, h, rows, dk, H, K)
            rf = tl.exp(tl.where(mi[:, None], gi - gm[None, :], float("-inf")))
            kc = tl.trans(
                (ki * rki[:, None] * tl.exp(tl.where(mi[:, None], gm[None, :] - gi, float("-inf")))).to(DT)
            )
            ad += tl.dot((ki * rki[:, None] * rf).to(DT), kc)
            pd += tl.dot((qi * rqi[:, None] * rf).to(DT), kc)
        bi = tl.where(
            mi, tl.sigmoid(tl.load(b + (t0 + rows) * H + h, mask=mi, other=0.0).to(tl.float32)), 0.0
        )
        ad = tl.where(col[None, :] < col[:, None], ad, 0.0) * bi[:, None]
        pd = tl.where(col[None, :] <= col[:, None], pd, 0.0)
        dptr = ((t0 + rows) * H + h)[:, None] * BT + (j * BC + col)[None, :]
        tl.store(a_out + dptr, ad, mask=mi[:, None])
        tl.store(p + dptr, pd.to(p.dtype.element_ty), mask=mi[:, None])
