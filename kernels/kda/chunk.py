"""Varlen chunked KDA prefill in Triton (docs/KDA.md, chunked prefill): the gate, the intra-chunk launches of
chunk_intra.py, the sequential state pass with the output and the gated norm; the host-side chunk metadata."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_intra import (
    _chunk_bounds,
    _exp,
    diag_kernel,
    inter_solve_kernel,
    merge_kernel,
    wu_kernel,
)
from kernels.kda.chunk_ref import chunk_reference

__all__ = ["build_chunk_metadata", "chunk_reference", "prefill", "prefill_scratch_specs"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_SUB = 16  # sub-chunk: the span over which one exp factor may grow (≤ e^{5·8} with the middle reference)
# Launch shapes and operand types, measured best on an H200 (module constants so a tuning run can
# override them): bf16 operands for the A/P and W/U products (fp32 accumulation; fp32 A/P operands run as
# tf32 and made the prefill 1.5x slower). The interpreter uses fp32.
# The gate in 64-channel blocks (128 contiguous bytes of a, 256 of Γ per row) at 4 warps: the prefill ran
# 0.870 / 0.814 / 3.391 ms (streamed) against 0.881 / 0.825 / 3.444 with 32-channel blocks, and whole
# 128-channel rows at 8 warps 0.887 / 0.831 / 3.447 (H200, 2026-12-05, a7fbe7c, 1x8192 / 8x1024 / 1x32768).
_GATE_BK, _GATE_WARPS, _STATE_WARPS = 64, 4, 4
# W/U at 8 warps: 0.90 / 0.99 / 3.52 ms against 0.92 / 1.01 / 3.61 at 4 (H200, 2026-12-01, the shapes below).
_WU_WARPS, _WU_DT, _AP_DT = 8, tl.bfloat16, tl.bfloat16
# The state pass's V-block: None picks 32 when (sequences x heads x V/32) programs fit on the SMs at once,
# else 64. Each V-block program rereads the chunk's W, Q̃, K̄ and P, and the chunk loop's pipelined loads
# leave shared memory for one program per SM (188 KB at 32, 208 KB at 64: bench/sm90.py), so a second
# wave costs a whole pass: on the H200 (2026-12-03, bench/kda_prefill.py's shapes) 64 ran 8x1024 in
# 0.85 ms against 0.98 at 32 and 1x8192 at H = 64 in 1.60 against 1.82, and 32 ran 1x8192 (H = 32) in
# 0.88 against 0.92. An int forces that width.
_STATE_BV: int | None = None
# The state pass's grid order: True launches the V-blocks of one (sequence, head) side by side, so the
# programs that read the same chunk's W, Q̃, K̄ and P run at the same time (1-2% faster at 8x1024 and at
# H = 64 than the sequence-first order on the H200, 2026-12-04, in d5705b1's run).
_STATE_VB_FIRST = True
# The intra-chunk factors in two launches (kernels/kda/chunk_intra.py): a diagonal pass per 16-row
# sub-chunk, then the off-diagonal blocks and the merged inverse per chunk in INTER_BK-wide K slices. On
# the H200 (2026-12-01, graph-timed, H=32, K=V=128, 1x8192 / 8x1024 / 1x32768) the prefill ran 0.89 /
# 0.88 / 3.53 ms this way against 1.17 / 1.14 / 4.57 with the earlier one-program-per-(chunk, head)
# kernel (255 registers and a 648-byte stack per thread on sm_90). At 4 warps instead of 2 the diagonal
# pass cost 0.03 ms more at 1x8192, the off-diagonal 0.06 more; 32- and 128-wide slices ran within 2% of 64.
# A state-only sequential pass followed by a parallel output pass (fla's chunk_fwd_h / chunk_fwd_o split)
# ran 1.00 / 1.00 / 3.96 ms in the same run and was removed.
# Folding the gate into the diagonal pass (each sub-chunk's program computing the chunk's gate for its
# offsets) and W/U into the off-diagonal pass (X applied from its 16x16 blocks) was measured and removed:
# on the H200 (2026-12-04, d5705b1, bench/results/kda-prefill-h200-2026-12-04-rejected-fused-gate-wu.json)
# the two passes took 693 and 549 µs at 1x8192 against 74 + 216 and 199 + 122 for the four launches here;
# the diagonal pass computed every gate four times (2.7 times the MUFU instructions) and the
# off-diagonal one spilled (740 bytes per thread at 2 warps, ptxas through bench/sm90.py). In 16-wide K
# slices, or at 4 warps in 32-wide ones, the prefill ran 8% and 14% slower at 1x8192 (2026-12-04, 8a7ccd3).
_DIAG_WARPS, _INTER_WARPS, _INTER_BK = 2, 2, 64
# The state pass loads Γ at the next chunk's last row a chunk ahead (see _state_kernel), off the S-to-S
# chain: the prefill ran 0.869 / 0.800 / 3.398 ms (streamed) against 0.881 / 0.825 / 3.444 without it
# (H200, 2026-12-05, a7fbe7c, 1x8192 / 8x1024 / 1x32768), 140 registers against 128 on sm_90.
_STATE_PREFETCH_G = True
# Kept from the variants timed on 2026-12-05 (bench/results/kda-prefill-h100-2026-12-05-variants.json: one
# run, an H100, d7be29d; µs per pass at 1x8192, H = 32, from the profiler breakdown):
# _TRIL_LOADS (the same bits): the passes that read P and X (the state pass, W/U) take each row on and left
# of its diagonal only, so the diagonal pass writes no zeros right of it (at 1x8192, H = 32, 38 MB fewer
# writes there and about 33 MB fewer reads in W/U; the state pass loads P's rows whole and zeroes what lies
# right of the diagonal). Diagonal 227 -> 213 µs, W/U 165 -> 158, state 230 -> 178; the prefill 1.215 ->
# 1.299x fla+norm at 1x8192, 1.357 -> 1.386 at 8x1024, 1.201 -> 1.288 at 1x32768, 1.274 -> 1.311 at H = 64.
_TRIL_LOADS = True
# _OFFDIAG_IN_DIAG: the blocks of A and P left of the diagonal computed by the diagonal pass, each sub-chunk's
# program its own row block (one K-slice loop over the earlier sub-chunks, after its diagonal work), and a
# small per-(chunk, head) launch (merge_kernel) turning them into X's blocks, in place of the off-diagonal
# pass (one program per chunk at 255 registers and 2 warps: four programs, 8 warps, per SM; Nsight Compute
# on the H100 found it issuing an instruction every 3.6 cycles per scheduler, bound by latency). The same
# arithmetic per block (the same bits on the interpreter); the norms of earlier sub-chunks' keys are
# recomputed by the program that needs them. On an H100 (2026-12-05, 49c7d5b, one run,
# bench/results/kda-prefill-h100-2026-12-05-offdiag.json, graph-timed against fla+norm, the variant
# ours_offdiag_in_diag: these settings) the prefill ran 0.9068 / 0.8978 / 3.6606 / 1.6977 ms at 1x8192 /
# 8x1024 / 1x32768 (H = 32) / 1x8192 (H = 64) against 0.9233 / 0.9139 / 3.6500 / 1.7389 with the
# off-diagonal pass (1.324 / 1.389 / 1.284 / 1.333x fla+norm against 1.300 / 1.365 / 1.288 / 1.302): the
# diagonal pass took 362 us at 1x8192 against 216, the merge 49, the off-diagonal pass it replaced 218. In a
# second run (868b1b8, -offdiag-default.json, ours_merge_2_warps) 1.329 / 1.389 / 1.286x against 1.303 /
# 1.362 / 1.286. At 4 warps (1 stage, 155 registers) the diagonal pass took 464 us.
_OFFDIAG_IN_DIAG = True
# The merge at 2 warps (208 registers): at 1 warp it spills on sm_90 (bench/sm90.py) and ran within 0.1% of
# 2 warps (868b1b8's run, below).
_MERGE_WARPS = 2
# The merge's 16x16 products: "ieee" (fp32 on the FMA units: 208 registers at 2 warps, four programs per SM)
# or "tf32x3" (tensor cores, three tf32 products per fp32 one: 163 registers at 1 warp, twelve per SM;
# bench/sm90.py). tf32x3 at 1 warp ran the prefill 0.9021 ms at 1x8192 against 0.9055 for the default
# (H100, 2026-12-05, 6e3bb89, one run of that shape alone:
# bench/results/kda-prefill-h100-2026-12-05-merge-tf32x3.json), 0.4%, at less than fp32's precision: the
# default stays; bench/kda_prefill.py times it as a variant.
_MERGE_PRECISION = "ieee"
# Measured and removed (H100, 2026-12-05, 868b1b8, one run:
# bench/results/kda-prefill-h100-2026-12-05-offdiag-default.json): the W/U pass making X's off-diagonal
# blocks itself before its products, no merge launch (126 registers there against 79, two programs per SM
# instead of three): W/U 214 us at 1x8192 against 163 + the merge's 47, the prefill 0.9036 / 0.8906 /
# 3.6320 ms against 0.9003 / 0.8878 / 3.6107 (the merge at 1 warp; at 2 warps 0.9005 / 0.8891 / 3.6172).
# Software-pipelining depth of the diagonal pass: its only loop is _OFFDIAG_IN_DIAG's K-slice loop (two
# iterations). With it, at 2 warps on sm_90 (bench/sm90.py): 3 stages 168 registers and 35 KB of shared
# memory, 2 stages 168 and 21 KB, 1 stage 217 and 8 KB; at 4 warps 1 stage 155 and 8 KB. Without it every
# depth compiles alike (162 registers, 8 KB).
_DIAG_STAGES = 2
# The diagonal pass's norms of the earlier sub-chunks' keys (_OFFDIAG_IN_DIAG): True, from the squares of the
# slices its K-slice loop loads anyway (no second load of 16 x K keys per earlier sub-chunk; the same norms
# summed in another order, so the output is the whole-row norms' to a bf16 rounding); False, from their
# whole rows loaded again after that loop. With True the pass takes 190 registers uncapped, five programs of
# 2 warps per SM; ptxas's cap (Triton's maxnreg) at 168 keeps six, without spilling (bench/sm90.py).
# Measured with _EXP_FTZ below (H100, 2026-12-06, bbc0e43, one run,
# bench/results/kda-prefill-h100-2026-12-06-variants.json, with Γ in log2 units as well): the prefill ran
# 0.8488 / 0.8459 / 3.4260 / 1.6050 ms at 1x8192 / 8x1024 / 1x32768 (H = 32) / 1x8192 (H = 64) against
# 0.8716 / 0.8718 / 3.5141 / 1.6586 with whole-row norms and no cap, 2.5-3.2% faster. In the second run
# named below (Γ in natural units there) whole-row norms ran 0.9-1.5% slower, and the norms from the slices
# without the cap (five programs per SM) 3.5-6.6% slower: 0.9107 / 0.8937 / 3.6775 / 1.7205 ms against
# 0.8590 / 0.8348 / 3.4909 / 1.6141 with it.
_OFFDIAG_NORMS_FROM_SLICES = True
_DIAG_MAXNREG: int | None = 168
# The diagonal pass's forward substitution for (I + A_ii)^{-1}: False, each of its 14 dependent steps loads
# row s of A_ii back from x, whole (stored just before with its zeros from column s on); True, the row from
# the registers by a masked sum over the tile's rows (the same values exactly, so the same bits), and A_ii
# is not stored at all. Beside the defaults of 2026-12-06 it spills 4 bytes on sm_90 (bench/sm90.py):
# not timed.
_DIAG_ROWS_IN_REGS = False
# The diagonal pass's grid order: False, (chunk, sub-chunk, head), the programs of one sub-chunk index of
# every chunk side by side; True, (sub-chunk, chunk, head), a chunk's sub-chunks side by side, so the keys
# and Γ of the earlier sub-chunks that each program's off-diagonal blocks read again were read moments
# before by its neighbours. In the chunk-first order a re-read comes one to three sweeps over every chunk
# later: a sweep is 512 programs at 1x32768 (some 10-15 MB of their reads; the H100's L2 holds 50 MB), 128
# at 1x8192, and there the pass took 11% more time per token at 1x32768 than at 1x8192 (H100, 2026-12-06,
# bench/results/kda-prefill-h100-2026-12-06-default.json: 1344 against 303 us). The same arithmetic in
# another order of programs: the same bits (a CPU test, and variants_vs_default on the GPU). Sub-chunks
# first, the prefill took 0.8337 / 0.8198 / 3.2491 / 1.5849 ms against 0.8448 / 0.8315 / 3.4459 / 1.6029
# chunk-first at 1x8192 / 8x1024 / 1x32768 (H = 32) / 1x8192 (H = 64), 1.3-5.7% less, most at 1x32768
# (H100, 2026-12-06, bench/results/kda-prefill-h100-2026-12-06-sub-first.json, one run). Used where the
# chunk count fits the grid's second dimension (65535 chunks); beyond it the chunk-first order.
_DIAG_SUB_FIRST = True
# The exponentials of the diagonal pass, W/U and the sequential pass: True, `ex2.approx.ftz`
# (chunk_intra._exp), results below fp32's normal range flushed to zero, every other result the same value;
# False, tl.exp (sm_90's `ex2.approx` keeps denormal results: a compare and two predicated multiplies around
# each MUFU.EX2). On sm_90 (bench/sm90.py) the diagonal pass is 3312 static instructions against 3888 (its
# K-slice loop 671 against 863) at the same registers, W/U 816 against 912. In the run named above the
# prefill gave the same bits as tl.exp at every shape and ran 0.8697 / 0.8697 / 3.5003 / 1.6523 ms against
# 0.9043 / 0.9061 / 3.5792 / 1.7163 (1.378 / 1.447 / 1.310 / 1.385x fla+norm against 1.325 / 1.389 / 1.281 /
# 1.333). Compiled code only: the interpreter runs tl.exp either way.
_EXP_FTZ = True
# Γ in log2 units: the gate pass stores Γ·log2(e) (the cumulative sum of g·log2(e)), and every decay factor
# is 2^(Γ_r − Γ_j) (chunk_intra._exp's "2" modes), one multiply fewer per exponential in the diagonal pass,
# W/U and the state pass (the diagonal pass 3128 static instructions with _EXP_FTZ). With _EXP_FTZ the gate
# pass's sigmoid is also two MUFU operations (_gate_kernel's "2_ftz": 960 static instructions against 1216).
# Not the same bits (Γ rounds in other units: the output within 0.016-0.031 of natural units' where its
# largest entry is 4.2-4.6); the same tolerances against the oracle. In the run named above, with the key
# norms from whole rows, it ran 0.2-0.4% slower than _EXP_FTZ alone (0.8716 / 0.8718 / 3.5141 / 1.6586 ms);
# with the norms from the K slices (ours_exp2_ftz_norms_from_slices there) it was the fastest of that run,
# 1.412 / 1.488 / 1.339 / 1.426x fla+norm. A second run (H100, 2026-12-06, dad8687,
# bench/results/kda-prefill-h100-2026-12-06-defaults.json), against these other settings as the default,
# timed it 1.0-1.6% faster at every shape: 0.8504 / 0.8250 / 3.4640 / 1.5919 ms against 0.8590 / 0.8348 /
# 3.4909 / 1.6141 (1.409 / 1.481 / 1.342 / 1.422x fla+norm against 1.395 / 1.464 / 1.331 / 1.403).
_GCUM_LOG2 = True


def _exp_mode() -> str:
    """chunk_intra._exp's mode for this launch, from _GCUM_LOG2 and _EXP_FTZ (ftz in compiled code only)."""
    return ("2" if _GCUM_LOG2 else "e") + ("_ftz" if _EXP_FTZ and not _INTERPRET else "")


# Measured in the same run and removed (µs at 1x8192, H = 32, against the old default's): the diagonal
# pass in K slices of 64 / 32 / 16 (251 / 224 / 255 against 227: fewer registers did not make it faster);
# two exponentials per element there (228); the state held V-first with transposed products (276 against
# 230); [W; Q̃]·S as one stacked product (175 alone, but 195 with the lower-triangle loads, against their
# 178); the state pass at 8 warps (247). The diagonal inverse from its two 8-row halves side by side (6
# dependent steps instead of 14, then a block merge) ran 217 alone, but with the lower-triangle loads 218
# against their 213, the prefill 0.934 ms against 0.926 at 1x8192 (H100, 2026-12-05, a second run, 2a6a010:
# bench/results/kda-prefill-h100-2026-12-05-tril-halves.json).


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
    max_tokens: int, H: int, K: int, V: int, chunk_size: int = 64
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Scratch the prefill needs for up to `max_tokens` packed tokens: name -> (shape, dtype).

    Every entry is indexed by token row, so it serves any varlen split of the same token capacity.
    """
    return {
        "gcum": ((max_tokens, H, K), torch.float32),  # Γ, within-chunk cumulative log decay
        "q_tilde": ((max_tokens, H, K), torch.bfloat16),  # q̂·exp(Γ)
        "k_bar": ((max_tokens, H, K), torch.bfloat16),  # k̂·exp(Γ_C − Γ)
        "w": ((max_tokens, H, K), torch.bfloat16),  # T·K̃
        "u": ((max_tokens, H, V), torch.bfloat16),  # T·V
        "p": ((max_tokens, H, chunk_size), torch.bfloat16),  # row r of P for the chunk holding r
        "x": ((max_tokens, H, chunk_size), torch.float32),  # row r of (I + A)^{-1} for its chunk
        "rn": ((max_tokens, H, 2), torch.float32),  # inverse L2 norms of k and q (q's times the scale)
    }


@triton.jit
def _rcp_ftz(x):
    """1/x by `rcp.approx.ftz` (one MUFU.RCP; 1/inf = 0)."""
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _gate_kernel(
    a,
    A_log,
    dt_bias,
    gcum,
    cu_seqlens,
    chunk_indices,
    n_chunks_ptr,
    n_chunks,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    DEVICE_COUNT: tl.constexpr,
    EXP: tl.constexpr = "e",
):
    """Per (chunk, head, K-block): bounded gate and Γ = its within-chunk cumsum (channels are independent),
    in the units its readers' mode EXP takes (chunk_intra._exp): in log2 units for "2" and "2_ftz", the cumsum
    of g·log2(e) (_GCUM_LOG2); for "2_ftz" (compiled code only) the sigmoid as
    lower_bound·log2(e) / (1 + 2^(−A·log2(e)·x)) by `ex2.approx.ftz` and `rcp.approx.ftz`, two MUFU
    operations and three fp32 ones where tl.sigmoid divides at full range."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kb = tl.program_id(2)
    t0, n = _chunk_bounds(chunk_indices, cu_seqlens, c, n_chunks_ptr, n_chunks, BT, DEVICE_COUNT)
    if n <= 0:
        return
    r = tl.arange(0, BT)
    d = kb * BK + tl.arange(0, BK)
    m = (r < n)[:, None]
    off = ((t0 + r) * H + h)[:, None] * K + d[None, :]
    x = (
        tl.load(a + off, mask=m, other=0.0).to(tl.float32)
        + tl.load(dt_bias + h * K + d).to(tl.float32)[None, :]
    )
    A = tl.exp(tl.load(A_log + h).to(tl.float32))
    LOG2E: tl.constexpr = 1.4426950408889634  # log2(e), declared in each @jit function that reads it (_exp)
    if EXP == "2_ftz":
        g = (lower_bound * LOG2E) * _rcp_ftz(1.0 + _exp(x * (-A * LOG2E), EXP))
    else:
        g = lower_bound * tl.sigmoid(A * x)
        if EXP == "2":
            g = g * LOG2E
    tl.store(gcum + off, tl.cumsum(tl.where(m, g, 0.0), axis=0), mask=m)


@triton.jit
def _chunk_step(
    S,
    cc,
    bos,
    eos,
    h,
    d,
    e,
    r,
    gcum,
    q_tilde,
    k_bar,
    w,
    u,
    p,
    out,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    DT: tl.constexpr,
    g_pre,
    nc,
    PREFETCH_G: tl.constexpr,
    TRIL: tl.constexpr,
    EXP: tl.constexpr = "e",
):
    """One chunk of the sequential pass: its outputs, and S carried past it. Returns S and, with
    PREFETCH_G, Γ_C of the next chunk, loaded before this chunk's products (g_pre is this chunk's, loaded
    by the step before); without it g_pre is passed through unread. TRIL: P is taken on and left of its
    diagonal only (the diagonal pass then writes nothing right of it)."""
    if PREFETCH_G:
        g_next = _g_last(gcum, tl.minimum(cc + 1, nc - 1), bos, eos, h, d, H, K, BT)
    else:
        g_next = g_pre
    t0 = bos + cc * BT
    n = tl.minimum(BT, eos - t0)
    mr = (r < n)[:, None]
    rows = (t0 + r) * H + h
    offk = rows[:, None] * K + d[None, :]
    offv = rows[:, None] * V + e[None, :]
    Sb = S.to(DT)
    wc = tl.load(w + offk, mask=mr, other=0.0).to(DT)
    delta = tl.load(u + offv, mask=mr, other=0.0).to(tl.float32) - tl.dot(wc, Sb)
    db = delta.to(DT)
    qc = tl.load(q_tilde + offk, mask=mr, other=0.0).to(DT)
    pc = tl.load(p + rows[:, None] * BT + r[None, :], mask=mr, other=0.0)
    if TRIL:
        # Selected after the load, not masked in it: a mask that varies along the row took the load out
        # of the loop's software pipeline (16 KB less shared memory, 254 registers at BV = 64 on sm_90).
        pc = tl.where(r[None, :] <= r[:, None], pc, 0.0)
    pc = pc.to(DT)
    o = tl.dot(qc, Sb) + tl.dot(pc, db)
    tl.store(out + offv, o.to(out.dtype.element_ty), mask=mr)
    if PREFETCH_G:
        g_last = g_pre  # loaded a chunk ahead
    else:
        g_last = _g_last(gcum, cc, bos, eos, h, d, H, K, BT)
    kc = tl.load(k_bar + offk, mask=mr, other=0.0).to(DT)
    S = S * _exp(g_last, EXP)[:, None] + tl.dot(tl.trans(kc), db)
    return S, g_next


@triton.jit
def _g_last(gcum, cc, bos, eos, h, d, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """Γ at the last row of chunk cc of the sequence [bos, eos)."""
    t0 = bos + cc * BT
    return tl.load(gcum + ((t0 + tl.minimum(BT, eos - t0) - 1) * H + h) * K + d)


@triton.jit
def _state_kernel(
    gcum,
    q_tilde,
    k_bar,
    w,
    u,
    p,
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
    PREFETCH_G: tl.constexpr,
    TRIL: tl.constexpr,
    EXP: tl.constexpr = "e",
):
    """Per (sequence, head, V-block), chunk after chunk: Δ = U − W·S, O = Q̃·S + P·Δ,
    S ← Diag(exp(Γ_C))·S + K̄ᵀ·Δ; the state is read from and written back to the pool slot.
    PREFETCH_G: Γ_C of the next chunk is loaded at the top of each step, so its latency is spent beside
    this chunk's products instead of before the state update (the compiler's software pipeline takes only
    the dot operands' loads: Γ_C's load sat after the output's store, on the chain from S to S)."""
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
    if PREFETCH_G:
        gl = _g_last(gcum, 0, bos, eos, h, d, H, K, BT)
    else:
        gl = tl.zeros([K], dtype=tl.float32)  # not read
    if WHILE_LOOP:
        # The interpreter cannot index a range by a loaded scalar; compiled code keeps the for loop.
        cc = 0
        while cc < nc:
            S, gl = _chunk_step(
                S, cc, bos, eos, h, d, e, r, gcum, q_tilde, k_bar, w, u, p, out, H, K, V, BT, DT,
                gl, nc, PREFETCH_G, TRIL, EXP,
            )  # fmt: skip
            cc += 1
    else:
        for cc in range(nc):
            S, gl = _chunk_step(
                S, cc, bos, eos, h, d, e, r, gcum, q_tilde, k_bar, w, u, p, out, H, K, V, BT, DT,
                gl, nc, PREFETCH_G, TRIL, EXP,
            )  # fmt: skip
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


FIXED_STATE_BV = 64  # the state pass's column tile where it must not follow the sequence count


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
    state_bv: int | None = None,
) -> None:
    """Varlen chunked KDA prefill with the bounded gate, β = sigmoid(b) and gated RMSNorm, into `out`.

    q, k, a [total, H, K]; v, z, out [total, H, V]; b [total, H]; state pool fp32 [slots, H, V, K],
    read from slots[i] when has_initial_state[i] (else zeros) and overwritten with the final state.
    `num_chunks` is a host int (grid sized exactly) or an int32 device scalar (grid sized at the
    chunk_indices capacity, surplus programs exit): the latter needs no host sync, so it captures.
    `scratch` is caller-owned (see `prefill_scratch_specs`); if None it is allocated here (eager only).
    `state_bv` fixes the state pass's column tile (else chosen by the sequence count and the device's SMs,
    `_state_bv`): a batched prefill whose sequences' results must not depend on how many share the call
    passes one (FIXED_STATE_BV). Empty sequences read and write nothing; a sequence on slot 0 (the null
    slot) gets zero output and touches no state. The core output is rounded to bf16 in `out` before the
    gated norm.
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
    specs = prefill_scratch_specs(total, H, K, V, BT)
    if scratch is None:
        scratch = {n: torch.empty(s, dtype=dt, device=q.device) for n, (s, dt) in specs.items()}
    for n, (s, dt) in specs.items():
        t = scratch[n]
        _check(
            t.dtype == dt and t.shape[1:] == s[1:] and t.shape[0] >= total and t.is_contiguous(),
            f"scratch[{n!r}] must be contiguous {dt} [≥{total}, {', '.join(map(str, s[1:]))}]",
        )
    has_init = (
        has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    )
    exp_mode = _exp_mode()  # how the gate pass stores Γ and every later pass exponentiates it
    if grid_chunks > 0:
        BK = min(K, _GATE_BK)
        _gate_kernel[(grid_chunks, H, K // BK)](
            a,
            A_log,
            dt_bias,
            scratch["gcum"],
            *chunks,
            lower_bound,
            H=H,
            K=K,
            BK=BK,
            BT=BT,
            DEVICE_COUNT=dev,
            EXP=exp_mode,
            num_warps=_GATE_WARPS,
        )
        ap_dt = tl.float32 if _INTERPRET else _AP_DT
        sub_first = _DIAG_SUB_FIRST and grid_chunks <= 65535
        grid = (BT // _SUB, grid_chunks, H) if sub_first else (grid_chunks, BT // _SUB, H)
        diag_kernel[grid](
            q,
            k,
            b,
            scratch["gcum"],
            scratch["q_tilde"],
            scratch["k_bar"],
            scratch["p"],
            scratch["x"],
            scratch["rn"],
            *chunks,
            scale,
            H=H,
            K=K,
            BT=BT,
            BC=_SUB,
            DEVICE_COUNT=dev,
            DT=ap_dt,
            ZERO_RIGHT=not _TRIL_LOADS,
            OFFDIAG=_OFFDIAG_IN_DIAG,
            BK=min(K, _INTER_BK),
            NK_SLICES=_OFFDIAG_NORMS_FROM_SLICES,
            ROWS_IN_REGS=_DIAG_ROWS_IN_REGS,
            EXP=exp_mode,
            SUB_FIRST=sub_first,
            num_warps=_DIAG_WARPS,
            num_stages=_DIAG_STAGES,
            maxnreg=_DIAG_MAXNREG,
        )
        if not _OFFDIAG_IN_DIAG:
            inter_solve_kernel[(grid_chunks, H)](
                q,
                k,
                b,
                scratch["gcum"],
                scratch["p"],
                scratch["x"],
                scratch["rn"],
                *chunks,
                H=H,
                K=K,
                BT=BT,
                BC=_SUB,
                BK=min(K, _INTER_BK),
                DEVICE_COUNT=dev,
                DT=ap_dt,
                EXP=exp_mode,
                num_warps=_INTER_WARPS,
            )
        else:
            merge_kernel[(grid_chunks, H)](
                scratch["x"], *chunks, H=H, BT=BT, BC=_SUB, DEVICE_COUNT=dev, PREC=_MERGE_PRECISION,
                num_warps=_MERGE_WARPS,
            )  # fmt: skip
        wu_kernel[(grid_chunks, H)](
            k,
            v,
            b,
            scratch["gcum"],
            scratch["x"],
            scratch["rn"],
            scratch["w"],
            scratch["u"],
            *chunks,
            H=H,
            K=K,
            V=V,
            BT=BT,
            DEVICE_COUNT=dev,
            DT=tl.float32 if _INTERPRET else _WU_DT,
            TRIL=_TRIL_LOADS,
            EXP=exp_mode,
            num_warps=_WU_WARPS,
        )
    BV = min(V, _STATE_BV or state_bv or _state_bv(N, H, V, q.device))
    if N > 0:
        grid = (V // BV, H, N) if _STATE_VB_FIRST else (N, H, V // BV)
        _state_kernel[grid](
            scratch["gcum"],
            scratch["q_tilde"],
            scratch["k_bar"],
            scratch["w"],
            scratch["u"],
            scratch["p"],
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
            DT=tl.float32 if _INTERPRET else tl.bfloat16,
            VB_FIRST=_STATE_VB_FIRST,
            PREFETCH_G=_STATE_PREFETCH_G,
            TRIL=_TRIL_LOADS,
            EXP=exp_mode,
            num_warps=_STATE_WARPS,
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
