"""Varlen chunked KDA prefill in Triton (docs/KDA.md, chunked prefill): the intra-chunk launch of
chunk_intra.py, the sequential state pass with the output, the gated norm; the host-side chunk metadata."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_intra import intra_kernel
from kernels.kda.chunk_ref import chunk_reference

__all__ = ["build_chunk_metadata", "chunk_reference", "prefill", "prefill_scratch_specs"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_SUB = 16  # sub-chunk: the span over which one exp factor may grow (≤ e^{5·8} with the middle reference)
# Launch shapes and operand types (module constants so a tuning run can override them): bf16 operands for
# the A/P products and the sequential pass's products (fp32 accumulation; fp32 A/P operands run as tf32
# and made the prefill 1.5x slower on the H200, 2026-12-01). The interpreter uses fp32.
_AP_DT = tl.bfloat16
# The intra-chunk launch (chunk_intra.py): one program per (chunk, head), K in _INTRA_BK-wide slices.
_INTRA_WARPS, _INTRA_BK = 4, 32
_STATE_WARPS = 4
# The state pass's V-block: None picks 32 when (sequences x heads x V/32) programs fit on the SMs at once,
# else 64. Each V-block program rereads the chunk's β·K̃, X, Q̃, K̄ and P, and the chunk loop's pipelined
# loads leave shared memory for one program per SM (bench/sm90.py), so a second wave costs a whole pass: on
# the H200 (2026-12-03, bench/kda_prefill.py's shapes) 64 ran 8x1024 in 0.85 ms against 0.98 at 32 and
# 1x8192 at H = 64 in 1.60 against 1.82, and 32 ran 1x8192 (H = 32) in 0.88 against 0.92. An int forces
# that width.
_STATE_BV: int | None = None
# The software-pipelining depth of the state pass's chunk loop, by V-block width: the shared memory of its
# pipelined loads (bench/sm90.py) is 225 KB at 32-wide blocks and 3 stages, 246 KB at 64-wide (over the
# 227 KB a program may hold) and 164 KB at 2 stages. An int forces one depth for both.
_STATE_STAGES: int | None = None
_STATE_STAGES_BY_BV = {32: 3, 64: 2}
# The state pass's grid order: True launches the V-blocks of one (sequence, head) side by side, so the
# programs that read the same chunk's operands run at the same time (1-2% faster at 8x1024 and at H = 64
# than the sequence-first order on the H200, 2026-12-04, in d5705b1's run).
_STATE_VB_FIRST = True
# History of the layout, each step measured on the H200 in one run (docs/KDA.md has the figures): one
# program per (chunk, head) for the whole intra-chunk work with full-K tiles spilled (255 registers); fla's
# split into a gate launch, a diagonal pass per sub-chunk, an off-diagonal pass per chunk and a W/U launch
# (six launches in all, 0.877 ms at 1x8192 on 2026-12-04) wrote Γ in fp32 and W, U in bf16 between them;
# folding the gate into the per-sub-chunk diagonal pass computed every gate four times and was slower.
# Here the intra-chunk work is one launch again, in K slices (no K-wide tile is held), and W and U are
# never formed: the sequential pass applies X to (β·V − β·K̃·S) itself.


def build_chunk_metadata(
    cu_seqlens: Sequence[int],
    chunk_size: int,
    chunk_indices_out: torch.Tensor,
    chunk_offsets_out: torch.Tensor,
) -> int:
    """Write the chunk list ([n, 2] int32: sequence, chunk within it) and per-sequence chunk offsets
    (cumulative, [N + 1]) into the caller's buffers; return the number of chunks.

    Fails closed: if either buffer is too small, raise ValueError and write nothing.
    """
    seqlens = [int(b) - int(a) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    if any(s < 0 for s in seqlens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(cu_seqlens)}")
    per_seq = [(s + chunk_size - 1) // chunk_size for s in seqlens]
    num_chunks = sum(per_seq)
    if chunk_indices_out.shape[0] < num_chunks:
        raise ValueError(
            f"chunk_indices buffer holds {chunk_indices_out.shape[0]} chunks, the batch needs {num_chunks}: "
            "raise the arena's max_chunks"
        )
    if chunk_offsets_out.shape[0] < len(seqlens) + 1:
        raise ValueError(
            f"chunk_offsets buffer holds {chunk_offsets_out.shape[0]} entries but the batch needs "
            f"{len(seqlens) + 1} ({len(seqlens)} sequences + 1); raise the arena's max_seqs"
        )
    rows = [(i, c) for i, m in enumerate(per_seq) for c in range(m)]
    offsets = [0]
    for m in per_seq:
        offsets.append(offsets[-1] + m)
    if rows:
        chunk_indices_out[:num_chunks].copy_(torch.tensor(rows, dtype=torch.int32))
    chunk_offsets_out[: len(offsets)].copy_(torch.tensor(offsets, dtype=torch.int32))
    return num_chunks


def prefill_scratch_specs(
    max_tokens: int, H: int, K: int, V: int, chunk_size: int = 64, max_chunks: int | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Scratch the prefill needs for up to `max_tokens` packed tokens in up to `max_chunks` chunks (default:
    `max_tokens`, the most any split can make): name -> (shape, dtype).

    The token-row entries serve any varlen split of the same token capacity; `glast` is indexed by the
    chunk's place in the chunk list. V is accepted for the call's symmetry; nothing here depends on it.
    """
    chunks = max_tokens if max_chunks is None else max_chunks
    return {
        "q_tilde": ((max_tokens, H, K), torch.bfloat16),  # q̂·exp(Γ)
        "k_bar": ((max_tokens, H, K), torch.bfloat16),  # k̂·exp(Γ_C − Γ)
        "kt": ((max_tokens, H, K), torch.bfloat16),  # β·k̂·exp(Γ), so that W = X·kt
        "p": ((max_tokens, H, chunk_size), torch.bfloat16),  # row r of P for the chunk holding r
        "x": ((max_tokens, H, chunk_size), torch.float32),  # row r of (I + A)^{-1} for its chunk
        "glast": ((chunks, H, K), torch.float32),  # Γ_C, the chunk's total log decay per channel
    }


@triton.jit
def _chunk_step(
    S,
    cc,
    c0,
    bos,
    eos,
    h,
    d,
    e,
    r,
    q_tilde,
    k_bar,
    kt,
    x,
    v,
    b,
    p,
    glast,
    out,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    DT: tl.constexpr,
):
    """One chunk: Δ = X·(β·V − β·K̃·S) (= U − W·S), O = Q̃·S + P·Δ, S ← Diag(exp(Γ_C))·S + K̄ᵀ·Δ."""
    t0 = bos + cc * BT
    n = tl.minimum(BT, eos - t0)
    mr = (r < n)[:, None]
    rows = (t0 + r) * H + h
    offk = rows[:, None] * K + d[None, :]
    offv = rows[:, None] * V + e[None, :]
    Sb = S.to(DT)
    ktc = tl.load(kt + offk, mask=mr, other=0.0).to(DT)
    beta = tl.sigmoid(tl.load(b + rows, mask=r < n, other=0.0).to(tl.float32))
    rhs = tl.load(v + offv, mask=mr, other=0.0).to(tl.float32) * beta[:, None] - tl.dot(ktc, Sb)
    xc = tl.load(x + rows[:, None] * BT + r[None, :], mask=mr, other=0.0).to(DT)
    db = tl.dot(xc, rhs.to(DT)).to(DT)
    qc = tl.load(q_tilde + offk, mask=mr, other=0.0).to(DT)
    pc = tl.load(p + rows[:, None] * BT + r[None, :], mask=mr, other=0.0).to(DT)
    o = tl.dot(qc, Sb) + tl.dot(pc, db)
    tl.store(out + offv, o.to(out.dtype.element_ty), mask=mr)
    g_last = tl.load(glast + ((c0 + cc) * H + h) * K + d)
    kc = tl.load(k_bar + offk, mask=mr, other=0.0).to(DT)
    S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(kc), db)
    return S


@triton.jit
def _state_kernel(
    q_tilde,
    k_bar,
    kt,
    x,
    v,
    b,
    p,
    glast,
    out,
    state,
    cu_seqlens,
    chunk_offsets,
    slots,
    has_initial,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    DT: tl.constexpr,
    VB_FIRST: tl.constexpr,
):
    """Per (sequence, head, V-block), chunk after chunk (_chunk_step); the state is read from and written
    back to the pool slot."""
    if VB_FIRST:
        vb, h, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        i, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i)
    eos = tl.load(cu_seqlens + i + 1)
    if eos <= bos:
        return  # an empty (padding) sequence touches nothing
    c0 = tl.load(chunk_offsets + i)
    nc = tl.load(chunk_offsets + i + 1) - c0
    slot = tl.load(slots + i).to(tl.int64)
    d = tl.arange(0, K)
    e = vb * BV + tl.arange(0, BV)
    r = tl.arange(0, BT)
    if slot == 0:
        # The null slot (KDA.md §2), as in the decode kernel and the torch prefill: output zero (the gated
        # norm keeps zero rows zero), state neither read nor written.
        zero = tl.zeros([BT, BV], dtype=tl.float32).to(out.dtype.element_ty)
        t0 = bos
        while t0 < eos:
            rows = t0 + r
            tl.store(out + (rows[:, None] * H + h) * V + e[None, :], zero, mask=(rows < eos)[:, None])
            t0 += BT
        return
    # S is held K-first [K, BV]; the pool is V-first [V, K].
    s_ptr = state + (slot * H + h) * V * K + e[None, :] * K + d[:, None]
    S = tl.zeros([K, BV], dtype=tl.float32)
    if tl.load(has_initial + i) != 0:
        S = tl.load(s_ptr)
    if WHILE_LOOP:
        # The interpreter cannot index a range by a loaded scalar; compiled code keeps the for loop.
        cc = 0
        while cc < nc:
            S = _chunk_step(
                S, cc, c0, bos, eos, h, d, e, r, q_tilde, k_bar, kt, x, v, b, p, glast, out, H, K, V, BT, DT
            )
            cc += 1
    else:
        for cc in range(nc):
            S = _chunk_step(
                S, cc, c0, bos, eos, h, d, e, r, q_tilde, k_bar, kt, x, v, b, p, glast, out, H, K, V, BT, DT
            )
    tl.store(s_ptr, S)


@triton.jit
def _gated_norm_kernel(
    out,
    z,
    weight,
    cu_seqlens,
    n_seqs,
    eps,
    rows_cap,
    H: tl.constexpr,
    V: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out ← RMSNorm(out)·weight·sigmoid(z), in place, for the valid token rows only."""
    pid = tl.program_id(0)
    total = tl.load(cu_seqlens + n_seqs)
    rr = pid * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, V)
    m = ((rr < rows_cap) & (rr < total * H))[:, None]
    off = rr[:, None] * V + e[None, :]
    o = tl.load(out + off, mask=m, other=0.0).to(tl.float32)
    zz = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / V + eps)
    y = o * rstd[:, None] * tl.load(weight + e).to(tl.float32)[None, :] * tl.sigmoid(zz)
    tl.store(out + off, y.to(out.dtype.element_ty), mask=m)


def _state_bv(N: int, H: int, V: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 32
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 32 if N * H * max(V // 32, 1) <= sms else 64


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"kernels.kda.prefill: {what}")


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int | torch.Tensor,
    out: torch.Tensor,
    *,
    lower_bound: float = -5.0,
    norm_eps: float = 1e-5,
    scale: float | None = None,
    chunk_size: int = 64,
    scratch: dict[str, torch.Tensor] | None = None,
) -> None:
    """Varlen chunked KDA prefill with the bounded gate, β = sigmoid(b) and gated RMSNorm, into `out`.

    q, k, a [total, H, K]; v, z, out [total, H, V]; b [total, H]; state pool fp32 [slots, H, V, K],
    read from slots[i] when has_initial_state[i] (else zeros) and overwritten with the final state.
    `num_chunks` is a host int (grid sized exactly) or an int32 device scalar (grid sized at the
    chunk_indices capacity, surplus programs exit): the latter needs no host sync, so it captures.
    `scratch` is caller-owned (see `prefill_scratch_specs`); if None it is allocated here (eager only).
    Empty sequences read and write nothing; a sequence on slot 0 (the null slot) gets zero output and
    touches no state. The core output is rounded to bf16 in `out` before the gated norm.
    """
    total, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.shape[0] - 1
    BT = chunk_size
    _check(
        k.shape == q.shape and a.shape == q.shape,
        f"q, k, a must share shape [total, H, K], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(a.shape)}",
    )
    _check(
        v.shape == (total, H, V) and z.shape == v.shape and out.shape == v.shape,
        "v, z, out must be [total, H, V]",
    )
    _check(b.shape == (total, H), f"b must be [total, H] = {(total, H)}, got {tuple(b.shape)}")
    _check(
        state.dtype == torch.float32 and state.shape[1:] == (H, V, K), "state must be fp32 [slots, H, V, K]"
    )
    _check(BT in (16, 32, 64) and BT % _SUB == 0, f"chunk_size must be 16, 32 or 64, got {BT}")
    _check(
        K & (K - 1) == 0 and V & (V - 1) == 0 and K >= 16 and V >= 16, "K and V must be powers of two ≥ 16"
    )
    _check(
        slots.shape[0] >= N and has_initial_state.shape[0] >= N, "slots and has_initial_state need N entries"
    )
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("a", a),
        ("b", b),
        ("z", z),
        ("out", out),
        ("state", state),
    ):
        _check(t.is_contiguous(), f"{name} must be contiguous")
    if scale is None:
        scale = K**-0.5
    if isinstance(num_chunks, torch.Tensor):
        grid_chunks, n_ptr, n_host, dev = chunk_indices.shape[0], num_chunks, 0, True
    else:
        grid_chunks, n_ptr, n_host, dev = int(num_chunks), cu_seqlens, int(num_chunks), False
    chunks = (cu_seqlens, chunk_indices, n_ptr, n_host)  # which chunk each program of a chunk grid serves
    specs = prefill_scratch_specs(total, H, K, V, BT, max_chunks=max(grid_chunks, 1))
    if scratch is None:
        scratch = {n: torch.empty(s, dtype=dt, device=q.device) for n, (s, dt) in specs.items()}
    for n, (s, dt) in specs.items():
        t = scratch[n]
        _check(
            t.dtype == dt and t.shape[1:] == s[1:] and t.shape[0] >= s[0] and t.is_contiguous(),
            f"scratch[{n!r}] must be contiguous {dt} [≥{s[0]}, {', '.join(map(str, s[1:]))}]",
        )
    has_init = (
        has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    )
    dt = tl.float32 if _INTERPRET else _AP_DT
    if grid_chunks > 0:
        intra_kernel[(grid_chunks, H)](
            q,
            k,
            a,
            b,
            A_log,
            dt_bias,
            scratch["q_tilde"],
            scratch["k_bar"],
            scratch["kt"],
            scratch["p"],
            scratch["x"],
            scratch["glast"],
            *chunks,
            scale,
            lower_bound,
            H=H,
            K=K,
            BT=BT,
            BC=_SUB,
            BK=min(K, _INTRA_BK),
            DEVICE_COUNT=dev,
            DT=dt,
            num_warps=_INTRA_WARPS,
        )
    BV = min(V, _STATE_BV or _state_bv(N, H, V, q.device))
    if N > 0:
        grid = (V // BV, H, N) if _STATE_VB_FIRST else (N, H, V // BV)
        _state_kernel[grid](
            scratch["q_tilde"],
            scratch["k_bar"],
            scratch["kt"],
            scratch["x"],
            v,
            b,
            scratch["p"],
            scratch["glast"],
            out,
            state,
            cu_seqlens,
            chunk_offsets,
            slots,
            has_init,
            H=H,
            K=K,
            V=V,
            BT=BT,
            BV=BV,
            WHILE_LOOP=_INTERPRET,
            DT=dt,
            VB_FIRST=_STATE_VB_FIRST,
            num_warps=_STATE_WARPS,
            num_stages=_STATE_STAGES or _STATE_STAGES_BY_BV.get(BV, 2),
        )
    rows = 16
    _gated_norm_kernel[(triton.cdiv(total * H, rows),)](
        out,
        z,
        norm_weight,
        cu_seqlens,
        N,
        norm_eps,
        total * H,
        H=H,
        V=V,
        ROWS=rows,
    )
