"""Triton kernels for the decoder's glue around the GEMMs and the KDA core, one launch where eager torch
launches many (docs/KDA.md, "Decode step"): RMSNorm with the residual add, SiLU-and-multiply, the KDA
short convolution of a decode step, RoPE with the paged K/V write, the selector's key pooling and top-k
group selection, the selected-rows attention, and a projection kernel for decode-sized inputs.

Each kernel has a torch reference: the `*_reference` functions here are the ops an engine without the
fused glue runs (qualify/engine/model calls them), the others are checked against the model's own torch
path. tests/engine/test_fused_glue.py holds them equal under the interpreter together with a tiny
engine's greedy tokens, and tests/engine/test_gpu_fused.py does so on a GPU at the proxy preset's shapes.
Only CUDA engines use the kernels (HybridModel.set_fused); the engine's describe() says which glue ran.
Nothing here reads or sets the process environment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------ skinny linear (decode-sized M)

# Rows up to which linear_small may serve a projection (a decode or verify step's tokens); larger M goes
# to cuBLAS. Which weight shapes it serves, and with which launch shape (BN, BK, warps, stages), comes from
# bench/linear.py's sweep on the H200 (bench/results/linear-h200-2026-12-01.json): only the shapes where
# it beat cuBLAS at both 1 and 32 rows. Elsewhere cuBLAS is faster (qkv's 5120 rows make 1.2 waves of
# 32-row tiles on 132 SMs: 0.81x; gate_up: 0.97x), so those stay with cuBLAS. Fixed constants, not an
# autotuner, so that a process's numerics never depend on which config won a timing race.
SMALL_M = 32
SMALL_SHAPES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (4096, 8192): (32, 256, 4, 4),  # 1.13x / 1.10x cuBLAS at 1 / 32 rows (MLP down)
    (4096, 4096): (32, 256, 4, 3),  # 1.29x / 1.09x (KDA out_proj, attention o_proj)
    (12576, 4096): (32, 128, 4, 4),  # 1.06x / 1.03x (KDA in_proj)
}
_BN, _BK, _WARPS, _STAGES = 32, 256, 4, 4  # any other shape asked for directly (tests, the sweep's default)


@triton.jit
def _linear_small_kernel(
    x,
    w,
    y,
    M,
    N,
    stride_x,
    stride_w,
    stride_y,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptr = x + m[:, None] * stride_x + kk[None, :]
    w_ptr = w + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    for k0 in range(0, K, BK):
        if EVEN:  # N % BN == 0 and K % BK == 0: only the rows of x past M are masked
            xv = tl.load(x_ptr + k0, mask=m[:, None] < M, other=0.0)
            wv = tl.load(w_ptr + k0)
        else:
            kin = (k0 + kk) < K
            xv = tl.load(x_ptr + k0, mask=(m[:, None] < M) & kin[None, :], other=0.0)
            wv = tl.load(w_ptr + k0, mask=(n[:, None] < N) & kin[None, :], other=0.0)
        acc += tl.dot(xv, tl.trans(wv), out_dtype=tl.float32)
    tl.store(
        y + m[:, None] * stride_y + n[None, :],
        acc.to(y.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def linear_small(x: Tensor, weight: Tensor, config: tuple[int, int, int, int] | None = None) -> Tensor:
    """y = x @ weight.T for a few rows (M <= SMALL_M): every weight byte read once, one program per BN
    output columns sweeping all of K, fp32 accumulation on the tensor cores; 16-bit dtypes.

    x [M, K] (rows may be strided); weight [N, K] contiguous. config: (BN, BK, warps, stages) to
    override the module's launch shape (the sweep)."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    M, K = x2.shape
    N = weight.shape[0]
    assert M <= SMALL_M and weight.stride(1) == 1 and weight.shape[1] == K
    BN, BK, warps, stages = config or SMALL_SHAPES.get((N, K), (_BN, _BK, _WARPS, _STAGES))
    BK = min(BK, max(16, _next_pow2(K)))
    BM = 16 if M <= 16 else 32
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _linear_small_kernel[(triton.cdiv(N, BN),)](
        x2,
        weight,
        y,
        M,
        N,
        x2.stride(0),
        weight.stride(0),
        N,
        K,
        BM,
        BN,
        BK,
        N % BN == 0 and K % BK == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return y.view(*x.shape[:-1], N)


# ------------------------------------------------------------------ RMSNorm (+ residual add)


@triton.jit
def _rmsnorm_kernel(
    x, res, w, y, s, stride_x, stride_r, stride_y, stride_s, D, eps, HAS_RES: tl.constexpr, BD: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    xv = tl.load(x + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        xv = xv + tl.load(res + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        xr = xv.to(s.dtype.element_ty)  # the sum is rounded to the activation dtype, as torch's add is
        tl.store(s + row * stride_s + cols, xr, mask=m)
        xv = xr.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + eps)
    wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + cols, (xv * rstd * wv).to(y.dtype.element_ty), mask=m)


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """y = RMSNorm(x) * weight, or with `residual`: (s, RMSNorm(s) * weight) where s = x + residual.

    x, residual [N, D] (rows may be strided, the last dim must not be); fp32 statistics, outputs in x's
    dtype."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    N, D = x2.shape
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    BD = _next_pow2(D)
    warps = 8 if BD >= 4096 else 4
    if residual is None:
        _rmsnorm_kernel[(N,)](x2, x2, weight, y, y, x2.stride(0), 0, D, D, D, eps, False, BD, num_warps=warps)
        return y.view(x.shape)
    r2 = _rows(residual.reshape(-1, D))
    s = torch.empty_like(y)
    _rmsnorm_kernel[(N,)](
        x2, r2, weight, y, s, x2.stride(0), r2.stride(0), D, D, D, eps, True, BD, num_warps=warps
    )
    return s.view(x.shape), y.view(x.shape)


def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """RMSNorm in torch, as unfused engines run it (qualify/engine/model/norm.py), and the residual add."""

    def norm(t: Tensor) -> Tensor:
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(t.dtype)

    if residual is None:
        return norm(x)
    s = x + residual
    return s, norm(s)


# ------------------------------------------------------------------ SwiGLU activation


@triton.jit
def _silu_mul_kernel(gu, out, stride_g, stride_o, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inner
    g = tl.load(gu + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + row * stride_g + inner + cols, mask=m, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)  # F.silu rounds its output
    tl.store(out + row * stride_o + cols, (act * u).to(out.dtype.element_ty), mask=m)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [N, 2I] = [gate | up]; returns [N, I]."""
    g2 = _rows(gate_up)
    N, two_i = g2.shape
    inner = two_i // 2
    out = torch.empty(N, inner, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(inner, BLOCK))](g2, out, g2.stride(0), inner, inner, BLOCK, num_warps=4)
    return out


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """silu(gate) * up in torch, as unfused engines run it (qualify/engine/model/mlp.py)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------ KDA short convolution, decode


@triton.jit
def _conv_decode_kernel(
    x,  # [n*T, >= C + H] rows: q k v channels (C), then b (H)
    stride_x,
    conv_state,  # [slots, C, W-1]
    stride_s0,
    stride_s1,
    stride_s2,
    weight,  # [C, W]
    stride_w,
    slots,  # [n, T]
    stride_slots,
    num_accepted,  # [n]
    out,  # [n*T, C]: SiLU(conv)
    stride_o,
    b_out,  # [n*T, H]
    stride_b,
    C,
    H,
    T: tl.constexpr,
    W: tl.constexpr,
    BC: tl.constexpr,
    BWIN: tl.constexpr,
    BH: tl.constexpr,
):
    r = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cm = c < C
    j = tl.arange(0, BWIN)  # window column: W-1 state columns, then the T new tokens
    src_col = tl.minimum(tl.maximum(tl.load(num_accepted + r) - 1, 0), T - 1)
    src = tl.load(slots + r * stride_slots + src_col).to(tl.int64)
    from_state = j < W - 1
    st_ptr = conv_state + src * stride_s0 + c[:, None] * stride_s1 + j[None, :] * stride_s2
    win = tl.load(st_ptr, mask=cm[:, None] & from_state[None, :], other=0.0).to(tl.float32)
    t_of = j - (W - 1)
    from_x = (j >= W - 1) & (t_of < T)
    x_ptr = x + (r * T + t_of[None, :]).to(tl.int64) * stride_x + c[:, None]
    win += tl.load(x_ptr, mask=cm[:, None] & from_x[None, :], other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        # token t's output: window columns t .. t+W-1 against the W taps
        tap = j - t
        in_taps = (tap >= 0) & (tap < W)
        w_mask = cm[:, None] & in_taps[None, :]
        wv = tl.load(weight + c[:, None] * stride_w + tap[None, :], mask=w_mask, other=0.0)
        acc = tl.sum(win * wv.to(tl.float32), axis=1)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out + (r * T + t) * stride_o + c, y.to(out.dtype.element_ty), mask=cm)
        # the state after token t: window columns t+1 .. t+W-1, kept per position in slot slots[r, t];
        # the null slot 0 is never written, so it stays zero
        dst = tl.load(slots + r * stride_slots + t).to(tl.int64)
        keep = (j >= t + 1) & (j < t + W)
        d_ptr = conv_state + dst * stride_s0 + c[:, None] * stride_s1 + (j[None, :] - t - 1) * stride_s2
        tl.store(d_ptr, win.to(conv_state.dtype.element_ty), mask=cm[:, None] & keep[None, :] & (dst != 0))
        if cb == 0:
            h = tl.arange(0, BH)
            bv = tl.load(x + (r * T + t) * stride_x + C + h, mask=h < H)
            tl.store(b_out + (r * T + t) * stride_b + h, bv, mask=h < H)


def conv_decode(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    slots: Tensor,
    num_accepted: Tensor,
    out: Tensor,
    b_out: Tensor,
    T: int,
) -> None:
    """One decode/verify step of the depthwise causal conv + SiLU for n requests of T tokens.

    x [n*T, P] holds each token's C = conv_state.shape[1] conv channels and then its H = b_out.shape[1]
    β logits (the in-projection's leading columns); conv_state [slots, C, W-1]; weight [C, W]; slots
    [n, T]; num_accepted [n]. Writes SiLU(conv) to out [n*T, C] and the β logits to b_out [n*T, H]; reads
    the conv state of column num_accepted-1 and stores the state after token t in slot slots[:, t]."""
    rows, C, W = x.shape[0], conv_state.shape[1], weight.shape[1]
    n, H = rows // T, b_out.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and b_out.stride(1) == 1 and weight.stride(1) == 1
    assert slots.stride(1) == 1 and slots.shape[1] >= T
    BC = 128
    _conv_decode_kernel[(n, triton.cdiv(C, BC))](
        x,
        x.stride(0),
        conv_state,
        *conv_state.stride(),
        weight,
        weight.stride(0),
        slots,
        slots.stride(0),
        num_accepted,
        out,
        out.stride(0),
        b_out,
        b_out.stride(0),
        C,
        H,
        T,
        W,
        BC,
        _next_pow2(W - 1 + T),
        _next_pow2(H),
        num_warps=4,
    )


def conv_decode_reference(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    slots: Tensor,
    num_accepted: Tensor,
    out: Tensor,
    b_out: Tensor,
    T: int,
) -> None:
    """The decode conv in torch, as unfused engines run it (qualify/engine/model/kda_layer.py): reads the
    conv state of column num_accepted-1, writes column j after token j (per-position states, like the
    recurrent state) and keeps the null slot 0 zero."""
    rows, C, W = x.shape[0], conv_state.shape[1], weight.shape[1]
    n, H = rows // T, b_out.shape[1]
    xs = x[:, :C].reshape(n, T, C)
    sl = slots[:, :T].long()
    src = sl.gather(1, (num_accepted.long() - 1).clamp(0, T - 1)[:, None]).squeeze(1)
    window = torch.cat([conv_state[src].float(), xs.transpose(1, 2).float()], dim=2)
    conv = (window.unfold(2, W, 1) * weight.float()[None, :, None, :]).sum(-1)
    for j in range(T):
        conv_state[sl[:, j]] = window[:, :, j + 1 : j + W].to(conv_state.dtype)
    conv_state[0].zero_()
    out.copy_(F.silu(conv.transpose(1, 2)).reshape(rows, C))
    b_out.copy_(x[:, C : C + H])


# ------------------------------------------------------------------ RoPE + paged K/V write


@triton.jit
def _paged_offset(p, span, interleave, shards, block_size):
    """Position -> (block column, offset in a folded block's storage): DcpGeometry.locate with rank None."""
    col = p // span
    o = p % span
    shard = (o // interleave) % shards
    local = (o // (interleave * shards)) * interleave + o % interleave
    return col, shard * block_size + local


@triton.jit
def _rope_kv_kernel(
    qkv,
    stride_t,
    positions,
    cos,
    sin,
    block_tables,
    stride_bt,
    k_cache,
    v_cache,
    q_out,
    HQ,
    KVH,
    T,
    span,
    interleave,
    shards,
    block_size,
    D: tl.constexpr,
):
    tok = tl.program_id(0)
    h = tl.program_id(1)  # 0..HQ-1: a query head; HQ..HQ+KVH-1: a key/value head
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    p = tl.load(positions + tok).to(tl.int64)
    c = tl.load(cos + p * HALF + i)
    s = tl.load(sin + p * HALF + i)
    base = qkv + tok.to(tl.int64) * stride_t + h * D
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    if h < HQ:
        dst = q_out + (tok.to(tl.int64) * HQ + h) * D
        tl.store(dst + i, r1.to(q_out.dtype.element_ty))
        tl.store(dst + HALF + i, r2.to(q_out.dtype.element_ty))
    else:
        kh = h - HQ
        col, off = _paged_offset(p, span, interleave, shards, block_size)
        blk = tl.load(block_tables + (tok // T) * stride_bt + col).to(tl.int64)
        slot = blk * (shards * block_size) + off
        kdst = k_cache + (slot * KVH + kh) * D
        tl.store(kdst + i, r1.to(k_cache.dtype.element_ty))
        tl.store(kdst + HALF + i, r2.to(k_cache.dtype.element_ty))
        vsrc = qkv + tok.to(tl.int64) * stride_t + (HQ + KVH + kh) * D
        vdst = v_cache + (slot * KVH + kh) * D
        tl.store(vdst + i, tl.load(vsrc + i).to(v_cache.dtype.element_ty))
        tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i).to(v_cache.dtype.element_ty))


def rope_write_kv(
    qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    block_tables: Tensor,
    T: int,
    k_cache: Tensor,
    v_cache: Tensor,
    geometry,
    hq: int,
) -> Tensor:
    """Rotate q and k of every token (neox halves, fp32), store k and v at each token's paged slot (folded
    DCP geometry: every shard in this process) and return q [N, hq, D].

    qkv [N, (hq + 2*kvh) * D]; token i belongs to request i // T of block_tables [n, max_blocks];
    k_cache, v_cache [blocks, shards, block_size, kvh, D] contiguous."""
    assert geometry.rank is None, "the fused K/V write is for the folded DCP geometry"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(1) == 1
    N = qkv.shape[0]
    kvh, D = k_cache.shape[-2], k_cache.shape[-1]
    q = torch.empty(N, hq, D, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(N, hq + kvh)](
        qkv,
        qkv.stride(0),
        positions,
        cos,
        sin,
        block_tables,
        block_tables.stride(0),
        k_cache,
        v_cache,
        q,
        hq,
        kvh,
        T,
        geometry.span,
        geometry.interleave,
        geometry.dcp,
        geometry.block_size,
        D,
        num_warps=1,
    )
    return q


# ------------------------------------------------------------------ selector pooling + attention, decode


@triton.jit
def _pool_kernel(
    k_cache,
    block_tables,
    stride_bt,
    seq_lens,
    pooled,  # [R, G, KVH, D] fp32
    G,
    KVH,
    max_len,
    pool,
    span,
    interleave,
    shards,
    block_size,
    D: tl.constexpr,
    BP: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    kh = tl.program_id(2)
    d = tl.arange(0, D)
    n = tl.minimum(tl.load(seq_lens + r).to(tl.int64), max_len)
    lo = g.to(tl.int64) * pool
    hi = tl.minimum(n - lo, pool)  # this group's valid keys: positions lo .. lo+hi-1 (none when hi <= 0)
    acc = tl.zeros([D], dtype=tl.float32)
    a = 0
    while a < hi:  # a while loop: the interpreter cannot bound a range by a loaded scalar
        i = a + tl.arange(0, BP)
        valid = i < hi
        col, off = _paged_offset(lo + i, span, interleave, shards, block_size)
        blk = tl.load(block_tables + r * stride_bt + col, mask=valid, other=0).to(tl.int64)
        slot = blk * (shards * block_size) + off
        kv = tl.load(k_cache + (slot[:, None] * KVH + kh) * D + d[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(kv.to(tl.float32), axis=0)
        a += BP
    cnt = tl.maximum(hi, 1).to(tl.float32)
    tl.store(pooled + ((r * G + g) * KVH + kh) * D + d, acc / cnt)


def pool_keys_paged(k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, geometry, pool: int, G: int):
    """The selector's pooled keys [R, G, kvh, D] fp32 read straight from the paged cache: the mean of the
    valid keys (position < seq_len) of each group of `pool` positions (selector.pool_keys, folded)."""
    assert geometry.rank is None and k_cache.is_contiguous()
    R = block_tables.shape[0]
    kvh, D = k_cache.shape[-2], k_cache.shape[-1]
    pooled = torch.empty(R, G, kvh, D, dtype=torch.float32, device=k_cache.device)
    BP = min(64, _next_pow2(pool))
    _pool_kernel[(R, G, kvh)](
        k_cache,
        block_tables,
        block_tables.stride(0),
        seq_lens,
        pooled,
        G,
        kvh,
        geometry.max_model_len,
        pool,
        geometry.span,
        geometry.interleave,
        geometry.dcp,
        geometry.block_size,
        D,
        BP,
        num_warps=4,
    )
    return pooled


@triton.jit
def _select_kernel(
    q,  # [R*Tq, HQ, D]
    positions,
    pooled,  # [R, G, KVH, D] fp32
    rows,  # [R*Tq, TOPK] out
    stride_rows,
    HQ,
    Tq,
    G,
    pool,
    scale,
    KVH: tl.constexpr,
    TOPK: tl.constexpr,
    K: tl.constexpr,  # min(TOPK, G)
    GQ: tl.constexpr,
    D: tl.constexpr,
    BGR: tl.constexpr,
):
    tok = tl.program_id(0)
    r = tok // Tq
    d = tl.arange(0, D)
    gi = tl.arange(0, BGR)
    gm = gi < G
    score = tl.zeros([BGR], dtype=tl.float32)
    for kh in tl.static_range(KVH):
        # Σ over the kv head's query heads of q·pooled = (Σ q)·pooled
        qh = tl.zeros([D], dtype=tl.float32)
        for j in tl.static_range(GQ):
            qh += tl.load(q + (tok.to(tl.int64) * HQ + kh * GQ + j) * D + d).to(tl.float32)
        p_ptr = pooled + ((r * G + gi[:, None]) * KVH + kh) * D + d[None, :]
        pk = tl.load(p_ptr, mask=gm[:, None], other=0.0)
        score += tl.sum(pk * qh[None, :], axis=1)
    score = score * scale
    own = tl.load(positions + tok) // pool
    score = tl.where(gi < own, score, float("-inf"))
    score = tl.where(gi == own, float("inf"), score)
    score = tl.where(gm, score, float("-inf"))
    for i in tl.static_range(K):  # top-k by repeated arg-max, largest first (ties: the lower group)
        best = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == best, gi, BGR), axis=0)
        pick = tl.where(best > float("-inf"), idx, -1)
        tl.store(rows + tok * stride_rows + i, pick.to(rows.dtype.element_ty))
        score = tl.where(gi == idx, float("-inf"), score)
    for i in tl.static_range(K, TOPK):
        tl.store(rows + tok * stride_rows + i, tl.full([], -1, rows.dtype.element_ty))


def select_groups(q: Tensor, positions: Tensor, pooled: Tensor, pool: int, out_rows: Tensor) -> None:
    """selector.select_rows in one launch: each query's own group first, then the top (topk-1) earlier
    groups by Σ_heads q·pooled/√D, -1 where none; writes out_rows [R*Tq, topk] in place."""
    N, HQ, D = q.shape
    R, G, kvh = pooled.shape[:3]
    topk = out_rows.shape[1]
    assert out_rows.stride(1) == 1
    _select_kernel[(N,)](
        q.contiguous(),
        positions,
        pooled,
        out_rows,
        out_rows.stride(0),
        HQ,
        N // R,
        G,
        pool,
        D**-0.5,
        kvh,
        topk,
        min(topk, G),
        HQ // kvh,
        D,
        _next_pow2(G),
        num_warps=4,
    )


@triton.jit
def _attn_decode_kernel(
    q,  # [R*Tq, HQ, D]
    positions,  # [R*Tq]
    k_cache,
    v_cache,
    block_tables,
    stride_bt,
    seq_lens,
    rows,  # [R*Tq, TOPK] selected group ids, -1 none
    out,  # [R*Tq, HQ, D]
    HQ,
    KVH,
    Tq,
    TOPK,
    pool,
    G,
    max_len,
    span,
    interleave,
    shards,
    block_size,
    scale,
    GQ: tl.constexpr,  # query heads per kv head
    BG: tl.constexpr,
    D: tl.constexpr,
    BL: tl.constexpr,
    BT: tl.constexpr,
    FP32: tl.constexpr,
):
    tok = tl.program_id(0)
    kh = tl.program_id(1)
    r = tok // Tq
    d = tl.arange(0, D)
    gq = tl.arange(0, BG)
    gm = gq < GQ
    q_ptr = q + (tok.to(tl.int64) * HQ + kh * GQ + gq[:, None]) * D + d[None, :]
    qv = tl.load(q_ptr, mask=gm[:, None], other=0.0)
    qpos = tl.load(positions + tok).to(tl.int64)
    n = tl.minimum(tl.load(seq_lens + r).to(tl.int64), max_len)
    ti = tl.arange(0, BT)
    sel = tl.load(rows + tok * TOPK + ti, mask=ti < TOPK, other=-1)
    m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, D], dtype=tl.float32)
    hi = tl.minimum(n, qpos + 1)  # visible keys: position < seq_len and <= the query's position
    a = 0
    while a < hi:
        p = a + tl.arange(0, BL)
        gid = tl.minimum(p // pool, G - 1)
        chosen = tl.sum((gid[:, None] == sel[None, :]).to(tl.int32), axis=1) > 0
        valid = (p < hi) & chosen
        if tl.sum(valid.to(tl.int32), axis=0) > 0:
            col, off = _paged_offset(p, span, interleave, shards, block_size)
            blk = tl.load(block_tables + r * stride_bt + col, mask=valid, other=0).to(tl.int64)
            slot = blk * (shards * block_size) + off
            kp = (slot[:, None] * KVH + kh) * D + d[None, :]
            kv = tl.load(k_cache + kp, mask=valid[:, None], other=0.0)
            vv = tl.load(v_cache + kp, mask=valid[:, None], other=0.0).to(tl.float32)
            # q·k on the tensor cores in the cache dtype: products of 16-bit values are exact in the fp32
            # accumulator; p·v in tf32 (v is exact there, p keeps 10 mantissa bits)
            if FP32:
                s = tl.dot(qv, tl.trans(kv), input_precision="ieee") * scale
            else:
                s = tl.dot(qv, tl.trans(kv), out_dtype=tl.float32) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pr, vv, input_precision="tf32")
            m_i = m_new
        a += BL
    o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(
        out + (tok.to(tl.int64) * HQ + kh * GQ + gq[:, None]) * D + d[None, :],
        o.to(out.dtype.element_ty),
        mask=gm[:, None],
    )


def attention_decode(
    q: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    rows: Tensor,
    geometry,
    pool: int,
    G: int,
) -> Tensor:
    """Causal attention of q [R*Tq, hq, D] over each request's paged context, restricted to the selected
    groups rows [R*Tq, topk] (-1: none) and to positions < seq_len: one online softmax over every shard's
    keys (equal to attention.folded_attention's per-shard partials merged by log-sum-exp). A query with
    no visible key gets zeros. Returns [R*Tq, hq, D] in q's dtype."""
    assert geometry.rank is None and k_cache.is_contiguous() and v_cache.is_contiguous()
    N, HQ, D = q.shape
    R = block_tables.shape[0]
    kvh = k_cache.shape[-2]
    TOPK = rows.shape[1]
    out = torch.empty_like(q)
    gq = HQ // kvh
    _attn_decode_kernel[(N, kvh)](
        q.contiguous(),
        positions,
        k_cache,
        v_cache,
        block_tables,
        block_tables.stride(0),
        seq_lens,
        rows.contiguous(),
        out,
        HQ,
        kvh,
        N // R,
        TOPK,
        pool,
        G,
        geometry.max_model_len,
        geometry.span,
        geometry.interleave,
        geometry.dcp,
        geometry.block_size,
        D**-0.5,
        gq,
        max(16, _next_pow2(gq)),
        D,
        64,
        _next_pow2(TOPK),
        q.dtype == torch.float32,
        num_warps=4,
    )
    return out
