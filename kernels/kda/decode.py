"""Triton KDA decode / speculative verify over a pooled V-first state, with the gated RMSNorm (KDA.md §2-3).

One program owns (request, head, V-block): it loads the entering state tile once, runs the request's T tokens
in registers and stores every post-token state to its slot. With the whole V row in one program the gated
RMSNorm is applied in-kernel. With a split V row each program publishes its tile's sum of squares as a
partial word; at T = 1 on a grid the SMs hold at once the programs wait for their row's other words and
normalize in the same launch, elsewhere a second small kernel sums the same words and normalizes in place.

On sm_90 both launch with programmatic dependent launch, as the step's other kernels do (kernels.fused's
PDL switch and its reasons): each reads only weights (A_log, dt_bias, the norm's weight) and, the decode
kernel, the step's host-staged metadata (_METADATA_BEFORE_WAIT), or nothing, before its
griddepcontrol.wait, and lets the next kernel launch right after it. Between the two launches
of the split path this hides the norm kernel's launch behind the decode kernel's tail. Only launches of
at most PDL_MAX_PROGRAMS programs (one wave of one-warp programs on an H200) do: past that PDL cost time.
"""

from __future__ import annotations

import ctypes
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused import _pdl_enter, _pdl_launch, pdl_enabled

L2_EPS = 1e-6
# The largest decode grid launched with PDL. On the H200 (2026-12-05, a7fbe7c, bench/kda.py, H = 32, V = 128
# in 8-row blocks: 512 programs per request) PDL ran batch 1 in 5.35 us against 5.62 and batch 8 (4096
# programs, one wave at 32 per SM) in 9.63 against 9.86, but batch 64 in 72.8 against 72.6, 256 in 276.1
# against 272.5 and 1024 in 1088.8 against 1070.5, and verify (T = 4) at 256 in 742.9 against 723.9.
PDL_MAX_PROGRAMS = 4096

# The split path's norm (the kernel's NORM): none (a benchmark's like-for-like with fla's kernel), a second
# launch that reads the tiles' partial sums of squares, or in the decode launch itself, each program
# waiting for the other tiles of its (row, head) to publish theirs. The one-launch wait needs every program
# of the grid resident at once: only T = 1 grids of at most one_launch_limit() programs take it, and never
# under the interpreter (which runs programs one after another).
NO_NORM = tl.constexpr(0)
TWO_LAUNCHES = tl.constexpr(1)
ONE_LAUNCH = tl.constexpr(2)
# Polls of the partial words before a one-launch program gives up and writes NaN (a wait that cannot end,
# e.g. a program that was never made resident, shows in the output rather than holding the GPU).
# _await_partials declares it itself: a constexpr global read by a helper enters its callers' Triton keys
# in the order processes ask for them (kernels/fused.py's RB_ROWS, tests/kernels/test_cache_keys.py).
SPIN_LIMIT = 1 << 20
# Resident programs per SM guaranteed for a one-warp program whatever its registers: at 255 registers a
# thread, a warp holds 8160 of an SM's 65536 (sm_80 to sm_90).
_RESIDENT_WARPS_PER_SM = 8
# Launch-time switches, passed to the kernel as constexprs; bench/kda.py times each flipped beside the
# default (DECODE_VARIANTS, through bench._common.with_settings) and bench/graphs.py the step with all of
# them off, so a choice rests on one run. All three were timed on an H100 on 2026-12-06 (commit cc82bc1,
# bench/results/kda-h100-2026-12-06-decode-switches.json; batch 1 streamed, µs):
# _METADATA_BEFORE_WAIT: read the step's metadata (num_live, state_indices, num_accepted) before the PDL
#   wait. The host stages it (qualify/engine/runner.py, arena.stage) and copies it in before the step's
#   graph is launched, and no kernel of a step writes it, so the state tile's load is issued as soon as the
#   wait returns, not one dependent load after it. Off: 4.62 against 4.65 on, and 4.66 against 4.74 in a
#   second run (within noise); on, for the step: with the three on it replayed 0.7-1.1% faster.
# _OUT_FROM_DECAYED: o = (S + u k^T) q taken as S q + u (k . q) on the decayed S, so the two reductions
#   over K (S k for u, S q for o) run side by side rather than one after the other. Off: 4.48 against
#   4.65 on, and verify at 1 x 4 9.18 against 10.19: off.
# _NORMS_AFTER_DOTS: q and k enter the dots raw and their L2 norms' reciprocals scale the dots' results, so
#   the norms' reductions run beside the dots' rather than before them. (Off, the scales are 1.0: x * 1.0
#   is x, so the off setting gives the bits the kernel gave before the switch.) Off (the others on): 4.52
#   against 4.65; all three off, 4.85. With _OUT_FROM_DECAYED off (2842c49, -decode-switches-out-off.json)
#   verify 1 x 4 took 9.38 on against 10.23 off; batch 1, 4.74 against 4.86 (the run-to-run spread at batch
#   1 is about 0.15). On.
# _STATE_AFTER_WAIT (the one-launch norm only): store the updated state tile after the wait for the other
#   tiles' partial words rather than before it, so the tile's 4 KB of stores do not sit between the SM and
#   L2 ahead of the poll's loads (the kernel without the norm ends on those stores anyway). On an H100
#   (2026-12-06, commit 9f44202, bench/results/kda-h100-2026-12-06-wait-switches.json) batch 1 took 4.39 µs
#   streamed with it against 4.74 without (the default launch timed again in the same run: 4.60), the
#   kernel without its norm 3.94. On. Timed beside it and rejected in that run: the partial word
#   published by a relaxed store rather than the exchange (4.77) and the next kernel released at the
#   program's end rather than after its wait (4.70).
_METADATA_BEFORE_WAIT = True
_OUT_FROM_DECAYED = False
_NORMS_AFTER_DOTS = True
_STATE_AFTER_WAIT = True
# The two-launch norm's program at launches of at least _NORM_PAIRS_FROM (row, head) pairs: _NORM_PAIRS
# pairs per program of _NORM_WARPS warps; below it one pair per one-warp program. One pair per program at
# every size made the norm's launch at 1024 requests 32768 programs of 256 bytes each, and it cost 35 us
# over the decode kernel alone on an H100 (2026-12-06, e19f609, bench/results/kda-h100-2026-12-06-state-
# after-wait.json: 1474.4 against 1439.3; b12x, its norm fused, 1462.2). In one H100 run of both shapes
# (a900d6c, kda-h100-2026-12-06-norm-pairs.json, streamed, us; ours_norm_one_pair the old shape) 8 pairs
# at 4 warps took 1477.0 against 1485.9 at 1024 requests, 374.2 against 376.1 at 256, and in verify 988
# against 996 at 256 x 4 and 252.0 against 253.7 at 64 x 4 (8192 pairs and more); 98.4 against 98.5 at
# 64 requests (2048 pairs); but 11.49 against 11.18 at 8 requests and 9.58 against 9.24 in verify at 1 x 4
# (256 and 128 pairs: fewer, longer programs where the launch is latency-bound).
_NORM_PAIRS = 8
_NORM_WARPS = 4
_NORM_PAIRS_FROM = 4096
# Each switch and the kernel's constexpr it sets.
_SWITCH_CONSTEXPRS = {
    "_METADATA_BEFORE_WAIT": "META_EARLY",
    "_OUT_FROM_DECAYED": "O_PARALLEL",
    "_NORMS_AFTER_DOTS": "NORMS_LATE",
    "_STATE_AFTER_WAIT": "STATE_LATE",
}
LAUNCH_SWITCHES = tuple(_SWITCH_CONSTEXPRS)


def switch_constexprs() -> dict[str, bool]:
    """The decode kernel's switch constexprs at the module's settings now (read at each launch, so a
    benchmark's with_settings reaches a captured graph)."""
    return {kernel: globals()[name] for name, kernel in _SWITCH_CONSTEXPRS.items()}


@triton.jit
def _kda_decode_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    z,
    norm_weight,
    state,
    state_indices,
    num_accepted,
    num_live,
    out,
    partials,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_zt,
    stride_zh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_idx_r,
    stride_idx_c,
    scale,
    lower_bound,
    norm_eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    T: tl.constexpr,
    BV: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
    META_EARLY: tl.constexpr,
    O_PARALLEL: tl.constexpr,
    NORMS_LATE: tl.constexpr,
    STATE_LATE: tl.constexpr,
):
    # NORM (split path only): NO_NORM leaves the output unnormalized; TWO_LAUNCHES writes it rounded to
    # out's dtype and this tile's sum of squares (a partial word) for _gated_rmsnorm_kernel to finish;
    # ONE_LAUNCH writes the partial word, waits for the other tiles of its (row, head) and normalizes here.
    NV: tl.constexpr = V // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    rh = pid // NV
    r = rh // H
    h = rh % H
    r64 = r.to(tl.int64)
    h64 = h.to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    if not FUSE_NORM:
        # Weights first: no kernel of a step writes them, so they may be read before the wait. (Not in the
        # whole-row program: there, held across the wait, they made its verify launch spill on sm_90.)
        A = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h64 * K + o_k).to(tl.float32)
        if NORM == ONE_LAUNCH:
            wn = tl.load(norm_weight + o_v).to(tl.float32)
    if META_EARLY:  # _METADATA_BEFORE_WAIT
        live, src = _row_source(num_live, state_indices, num_accepted, r64, stride_idx_r, stride_idx_c, T)
    _pdl_enter(PDL, True)
    if not META_EARLY:
        live, src = _row_source(num_live, state_indices, num_accepted, r64, stride_idx_r, stride_idx_c, T)
    if (r >= live) | (src == 0):
        # Padding row or null slot: output zero, no state read or written; a zero partial word, so the
        # norm of the two-launch path leaves the row zero.
        for t in tl.static_range(T):
            row = r64 * T + t
            tl.store(
                out + row * stride_ot + h64 * stride_oh + o_v,
                tl.zeros([BV], tl.float32).to(out.dtype.element_ty),
            )
            if (not FUSE_NORM) and (NORM != NO_NORM):
                word = _words(partials, row, h64, H, NV) + i_v
                _put_partial(word, tl.load(word, volatile=True), tl.zeros([], tl.float32))
        return

    head_tile = h64 * (V * K) + o_v[:, None].to(tl.int64) * K + o_k[None, :]
    S = tl.load(state + src * stride_slot + head_tile)
    if FUSE_NORM:
        A = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h64 * K + o_k).to(tl.float32)
        w = tl.load(norm_weight + o_v).to(tl.float32)

    for t in tl.static_range(T):
        row = r64 * T + t
        if (not FUSE_NORM) and (NORM != NO_NORM):
            # this tile's partial word and (one launch) the norm's inputs, loaded with the token's
            words = _words(partials, row, h64, H, NV)
            word = words + i_v
            last = tl.load(word, volatile=True)
            if NORM == ONE_LAUNCH:
                b_z = tl.load(z + row * stride_zt + h64 * stride_zh + o_v).to(tl.float32)
        b_q = tl.load(q + row * stride_qt + h64 * stride_qh + o_k).to(tl.float32)
        b_k = tl.load(k + row * stride_kt + h64 * stride_kh + o_k).to(tl.float32)
        b_v = tl.load(v + row * stride_vt + h64 * stride_vh + o_v).to(tl.float32)
        b_a = tl.load(a + row * stride_at + h64 * stride_ah + o_k).to(tl.float32)
        b_b = tl.load(b + row * stride_bt + h64 * stride_bh).to(tl.float32)
        if NORMS_LATE:  # _NORMS_AFTER_DOTS: q, k stay raw; their 1/norms scale the dots' results
            rq = tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
            rk = tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
            k_n = b_k * rk
        else:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
            rq = 1.0
            rk = 1.0
            k_n = b_k
        g = lower_bound * tl.sigmoid(A * (b_a + bias))
        S = S * tl.exp(g)[None, :]
        u = tl.sigmoid(b_b) * (b_v - tl.sum(S * b_k[None, :], 1) * rk)
        if O_PARALLEL:  # _OUT_FROM_DECAYED
            o = tl.sum(S * b_q[None, :], 1) * rq + u * (tl.sum(k_n * b_q, 0) * rq)
            S = S + u[:, None] * k_n[None, :]
        else:
            S = S + u[:, None] * k_n[None, :]
            o = tl.sum(S * b_q[None, :], 1) * rq
        if T == 1:
            dst = src  # the same index, loaded above: no second load before the state's store
        else:
            dst = tl.load(state_indices + r64 * stride_idx_r + t * stride_idx_c).to(tl.int64)
        if FUSE_NORM:
            b_z = tl.load(z + row * stride_zt + h64 * stride_zh + o_v).to(tl.float32)
            o = _gated(o, tl.sum(o * o, 0), w, b_z, V, norm_eps)
            tl.store(out + row * stride_ot + h64 * stride_oh + o_v, o.to(out.dtype.element_ty))
        elif NORM == ONE_LAUNCH:
            # The norm's input is the core output rounded to out's dtype, as the two-launch path reads it
            # back from out: both give the same bits.
            o = o.to(out.dtype.element_ty).to(tl.float32)
            epoch = _put_partial(word, last, tl.sum(o * o, 0))
            if not STATE_LATE:  # noqa: SIM102 (a constexpr test, then a runtime one)
                if dst != 0:
                    tl.store(state + dst * stride_slot + head_tile, S)
            total = _await_partials(words, epoch, NV)
            o = _gated(o, total, wn, b_z, V, norm_eps)
            tl.store(out + row * stride_ot + h64 * stride_oh + o_v, o.to(out.dtype.element_ty))
        else:
            o = o.to(out.dtype.element_ty)
            tl.store(out + row * stride_ot + h64 * stride_oh + o_v, o)
            if NORM == TWO_LAUNCHES:
                o = o.to(tl.float32)
                _put_partial(word, last, tl.sum(o * o, 0))
        # after the output (the one-launch norm: after its wait, _STATE_AFTER_WAIT), unless stored above
        if FUSE_NORM or NORM != ONE_LAUNCH or STATE_LATE:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if dst != 0:
                tl.store(state + dst * stride_slot + head_tile, S)


@triton.jit
def _row_source(num_live, state_indices, num_accepted, r64, stride_idx_r, stride_idx_c, T: tl.constexpr):
    """(live rows, the state slot row r64 reads): num_live and the slot its accepted column names."""
    live = tl.load(num_live)
    if T == 1:
        # A decode step reads column 0 whatever num_accepted says (the clamp below gives 0): one dependent
        # load fewer before the state tile's (batch 1 on the H200, 2026-12-04: 5.60 µs streamed against
        # 5.65 the run before, within run-to-run noise).
        src = tl.load(state_indices + r64 * stride_idx_r).to(tl.int64)
    else:
        # Clamp the read column so a dead row's stale num_accepted never indexes outside its row.
        col = tl.minimum(tl.maximum(tl.load(num_accepted + r64) - 1, 0), T - 1)
        src = tl.load(state_indices + r64 * stride_idx_r + col.to(tl.int64) * stride_idx_c).to(tl.int64)
    return live, src


@triton.jit
def _gated(o, total, w, b_z, V: tl.constexpr, norm_eps):
    """The gated RMSNorm of o given its row's sum of squares: one expression for both paths' bits."""
    return o * tl.rsqrt(total / V + norm_eps) * w * tl.sigmoid(b_z)


@triton.jit
def _partial_value(word):
    """The fp32 sum of squares held in a partial word's low 32 bits."""
    return (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _put_partial(word_ptr, last, part):
    """Publish one tile's sum of squares: the word's next epoch in its high 32 bits, the fp32 bits in its low.

    Every launch writes all NV words of a (row, head) together, so they always share one epoch: a tile's
    own word as it was (`last`, loaded early) says which epoch the others' words will carry once written.
    One relaxed 64-bit exchange carries the value and its epoch at once, so no fence (and no wait for the
    state's stores) is needed before it. (A relaxed store instead, inline PTX, measured no faster:
    _STATE_AFTER_WAIT's note.) Returns the epoch written."""
    epoch = ((last >> 32) + 1) & 0x7FFFFFFF
    bits = part.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.atomic_xchg(word_ptr, (epoch << 32) | bits, sem="relaxed")
    return epoch


@triton.jit
def _words(partials, row, h, H: tl.constexpr, NV: tl.constexpr):
    """The first of the NV partial words of (token row, head) in partials [rows, H, NV]."""
    return partials + (row * H + h) * NV


@triton.jit
def _load_words(words, NV: tl.constexpr):
    """The NV partial words of one (row, head), one vector load (one 128-byte request at NV = 16)."""
    return tl.load(words + tl.arange(0, NV), volatile=True)


@triton.jit
def _sum_words(word):
    """The sum of the partial words' values: one reduction, the same in both paths' one-warp programs."""
    return tl.sum(_partial_value(word), 0)


@triton.jit
def _await_partials(words, epoch, NV: tl.constexpr):
    """Poll until all NV words of this (row, head) carry `epoch`, then their sum (as the two-launch norm
    adds them). One request per poll per program: 16 programs poll each 128-byte line, so the last tile's
    exchange does not queue behind a crowd of loads of its line (16 scalar loads per poll ran batch 1 in
    5.27 µs against 5.32 for two launches; one vector load, 4.77-5.05 against 5.33-5.50; and four polls in
    flight, issued 64 ns apart by nanosleep, 5.28 against one poll's 4.77: H100s, 2026-12-06, bench/results/
    kda-h100-2026-12-06-*.json). Bounded: after SPIN_LIMIT polls the sum is NaN, so a wait that could not
    finish shows in the output instead of holding the GPU."""
    SPIN: tl.constexpr = 1 << 20  # SPIN_LIMIT
    word = _load_words(words, NV)
    ready = tl.min(((word >> 32) == epoch).to(tl.int32), 0)
    polls = tl.zeros([], tl.int32)
    while (ready == 0) & (polls < SPIN):
        word = _load_words(words, NV)
        ready = tl.min(((word >> 32) == epoch).to(tl.int32), 0)
        polls += 1
    return tl.where(ready == 1, _sum_words(word), float("nan"))


@triton.jit
def _gated_rmsnorm_kernel(
    out,
    z,
    norm_weight,
    partials,
    stride_ot,
    stride_oh,
    stride_zt,
    stride_zh,
    norm_eps,
    n_rh,
    H: tl.constexpr,
    V: tl.constexpr,
    NV: tl.constexpr,
    RH: tl.constexpr,
    PDL: tl.constexpr,
):
    # In-place on the core output of the split-V path, RH (row, head) pairs of the n_rh per program, their
    # sums of squares from the tiles' partial words (NV > 0), or from out itself (NV == 0: a peer's output,
    # bench/kda.py's fla+norm); zero rows stay zero. Each pair's words are summed by the one-launch wait's
    # own load and reduction (one [NV] vector each), so both paths give the same bits.
    pid = tl.program_id(0)
    o_v = tl.arange(0, V)
    w = tl.load(norm_weight + o_v).to(tl.float32)  # a weight: before the wait
    _pdl_enter(PDL, True)
    i_rh = tl.arange(0, RH)
    rh = pid * RH + i_rh
    live = (rh < n_rh)[:, None]
    row = (rh // H).to(tl.int64)[:, None]
    h = (rh % H).to(tl.int64)[:, None]
    p_o = out + row * stride_ot + h * stride_oh + o_v[None, :]
    o = tl.load(p_o, mask=live, other=0.0).to(tl.float32)
    b_z = tl.load(z + row * stride_zt + h * stride_zh + o_v[None, :], mask=live, other=0.0).to(tl.float32)
    if NV > 0:
        total = tl.zeros([RH], tl.float32)
        for i in tl.static_range(RH):
            pair = tl.minimum(pid * RH + i, n_rh - 1).to(tl.int64)  # past n_rh: a live pair's, not stored
            words = partials + pair * NV  # _words' address: pair = row * H + h, without the division
            total = tl.where(i_rh == i, _sum_words(_load_words(words, NV)), total)
    else:
        total = tl.sum(o * o, 1)
    tl.store(p_o, _gated(o, total[:, None], w[None, :], b_z, V, norm_eps).to(out.dtype.element_ty), mask=live)


# Tried and removed (H200, 2026-12-04, bench/results/kda-h200-2026-12-04-rejected-one-launch-norm.json):
# the split path applying the gated norm in-kernel, by the last V-block of each (request, head) to count
# itself done on an acq_rel counter, in one launch instead of two. It gave the same bytes at every batch,
# but ran 5.57 µs streamed at batch 1 against 5.65 for two launches, and 1115.7 against 1072.4 at 1024
# (the count and its barrier cost more than the second launch saves).
DEFAULT_LAUNCH_WHY = (
    "one size for every batch: in the H200 sweep of 2026-11-30 (bench/kda.py --sweep, contenders timed "
    "in interleaved rounds) 8-row one-warp V tiles were fastest or within 1% at every "
    "batch from 1 to 1024 (4.00 TB/s at 1024; the fused whole-row program 3.41); at batch 1 this launch, "
    "fla, fla+norm and b12x all took 13.5-13.9 us per single graph replay, which is launch latency"
)


def default_launch(num_rows: int, num_heads: int, head_v_dim: int, tokens: int = 1) -> tuple[int, int]:
    """(block_v, num_warps); why: DEFAULT_LAUNCH_WHY. block_v == V selects the fused-norm single launch."""
    return min(8, head_v_dim), 1


def describe_launch(block_v: int, num_warps: int, head_v_dim: int) -> str:
    """Which decode path a (block_v, num_warps) choice takes, in words (recorded in the plan)."""
    if block_v == head_v_dim:
        return f"fused: one program per (request, head) over the whole V row, {num_warps} warp(s), norm fused"
    tiles = head_v_dim // block_v
    return (
        f"split: {tiles} programs of {block_v} V rows per (request, head), {num_warps} warp(s); the gated "
        "norm in the same launch at T = 1 where the grid fits one_launch_limit, else a second kernel"
    )


def check_decode_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    z: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor,
    num_live: Tensor,
    out: Tensor,
) -> tuple[int, int, int, int, int]:
    """Validate one decode invocation; returns (n, T, H, K, V). Raises ValueError with a one-line message."""
    if state_indices.ndim != 2:
        raise ValueError(f"state_indices must be [n, T], got shape {tuple(state_indices.shape)}")
    n, T = state_indices.shape
    if q.ndim != 3:
        raise ValueError(f"q must be [n*T, H, K], got shape {tuple(q.shape)}")
    H, K = q.shape[1], q.shape[2]
    if v.ndim != 3:
        raise ValueError(f"v must be [n*T, H, V], got shape {tuple(v.shape)}")
    V = v.shape[2]
    rows = n * T
    want = {
        "q": (q, (rows, H, K), (torch.bfloat16, torch.float16, torch.float32)),
        "k": (k, (rows, H, K), (q.dtype,)),
        "v": (v, (rows, H, V), (q.dtype,)),
        "a": (a, (rows, H, K), (torch.bfloat16, torch.float16, torch.float32)),
        "b": (b, (rows, H), (torch.bfloat16, torch.float16, torch.float32)),
        "A_log": (A_log, (H,), (torch.float32,)),
        "dt_bias": (dt_bias, (H * K,), (torch.float32,)),
        "z": (z, (rows, H, V), (torch.bfloat16, torch.float16, torch.float32)),
        "norm_weight": (norm_weight, (V,), (torch.float32, torch.bfloat16)),
        "state": (state, (state.shape[0], H, V, K), (torch.float32,)),
        "num_accepted": (num_accepted, (n,), (torch.int32,)),
        "num_live": (num_live, (1,), (torch.int32,)),
        "out": (out, (rows, H, V), (torch.bfloat16, torch.float16, torch.float32)),
    }
    if state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32, got {state_indices.dtype}")
    for name, (t, shape, dtypes) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; put every tensor on one device"
            )
    if state_indices.device != q.device:
        raise ValueError(f"state_indices is on {state_indices.device} but q is on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("z", z), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if state.stride()[1:] != (V * K, K, 1):
        raise ValueError(f"state must be contiguous within each slot [H, V, K], got strides {state.stride()}")
    if not num_accepted.is_contiguous():
        raise ValueError("num_accepted must be contiguous")
    for name, dim in (("K", K), ("V", V)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"head {name} dim must be a power of two >= 16, got {dim}")
    if out.data_ptr() == state.data_ptr():
        raise ValueError("out must not alias the state pool")
    return n, T, H, K, V


def one_launch_limit(t: Tensor, num_warps: int) -> int:
    """The largest grid of `num_warps`-warp programs that takes the one-launch norm on t's device: the
    programs every SM holds resident whatever their registers, times the SMs this process's context may
    use (usable_sms); 0 off CUDA or under the interpreter (which runs one program after another, so none
    could wait for another)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET", "") == "1" or num_warps > _RESIDENT_WARPS_PER_SM:
        return 0
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        with torch.cuda.device(idx):
            sms = _SMS[idx] = usable_sms(
                torch.cuda.get_device_properties(idx).multi_processor_count, context_sms()
            )
    return sms * (_RESIDENT_WARPS_PER_SM // num_warps)


_SMS: dict[int, int] = {}


def usable_sms(device_sms: int, context_sms: int | None) -> int:
    """The SMs a grid's programs may be placed on: the device's, or fewer where the context is limited to
    fewer (an MPS client under an active-thread percentage, a context with an SM-count affinity). Only
    what is resident at once can wait for each other: sized by the device's count, a capped client's
    one-launch programs would wait for programs not yet placed until their bound, and write NaN."""
    return device_sms if context_sms is None else max(0, min(device_sms, context_sms))


class _ExecAffinityParam(ctypes.Structure):
    # cuda.h's CUexecAffinityParam: the affinity's type, then a union whose one member (CUexecAffinitySmCount)
    # is an unsigned int
    _fields_ = (("type", ctypes.c_int), ("sm_count", ctypes.c_uint))


_CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


def context_sms() -> int | None:
    """The SMs the current CUDA context may use, as the driver reports it (cuCtxGetExecAffinity, CUDA 11.4
    and later), or None where it does not say (no such entry point, or an error such as an affinity the
    device does not support). The caller makes its device's context current first."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuCtxGetExecAffinity
    except (OSError, AttributeError):
        return None
    get.argtypes = (ctypes.POINTER(_ExecAffinityParam), ctypes.c_int)
    get.restype = ctypes.c_int
    param = _ExecAffinityParam()
    if get(ctypes.byref(param), _CU_EXEC_AFFINITY_TYPE_SM_COUNT) != 0 or param.sm_count == 0:
        return None
    return int(param.sm_count)


def norm_in_decode_launch(q: Tensor, n: int, T: int, V: int, block_v: int, num_warps: int) -> bool:
    """Whether launch_decode, left to choose, normalizes n requests of T tokens (q [n*T, H, K]) in the
    decode launch itself: the split path (block_v < V), T = 1 and a grid of at most one_launch_limit."""
    programs = n * q.shape[1] * (V // block_v)
    return block_v < V and T == 1 and programs <= one_launch_limit(q, num_warps)


def partials_spec(rows: int, num_heads: int, head_v_dim: int, block_v: int) -> tuple[int, int, int] | None:
    """The shape of the int64 partial words a split launch of block_v rows writes (None for the whole-row
    launch, which needs none): one per (token row, head, V tile)."""
    return None if block_v >= head_v_dim else (rows, num_heads, head_v_dim // block_v)


def launch_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    z: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor,
    num_live: Tensor,
    out: Tensor,
    *,
    lower_bound: float,
    norm_eps: float,
    scale: float | None,
    block_v: int | None = None,
    num_warps: int | None = None,
    pdl: bool | None = None,
    norm: bool = True,
    partials: Tensor | None = None,
    one_launch: bool | None = None,
) -> None:
    """Launch without validation of the step's tensors (the caller has run check_decode_args). pdl: None
    launches with programmatic dependent launch where kernels.fused.pdl_enabled says so (sm_90 and later,
    the switch on) and the grid has at most PDL_MAX_PROGRAMS programs; a benchmark may force it off to time
    the difference. norm=False leaves the split path's output unnormalized, its norm kernel not launched
    (a benchmark's like-for-like with a peer that has no norm); the whole-row path refuses it.

    The split path's norm needs `partials`, int64 words of partials_spec's shape that only these launches
    write (zeroed once before the first; the caller's scratch, kept across calls). Without them it
    allocates zeroed words for this call. one_launch: None normalizes in the decode launch where the grid
    allows it (T = 1, at most one_launch_limit programs), else in a second launch; a benchmark may force
    either. Both give the same bits."""
    n, T = state_indices.shape
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    bv, nw = default_launch(n, H, V, T)
    bv, nw = block_v or bv, num_warps or nw
    fuse = bv == V
    if fuse and not norm:
        raise ValueError("the whole-row decode applies the norm in-kernel: norm=False needs block_v < V")
    programs = n * H * (V // bv)
    pdl = (programs <= PDL_MAX_PROGRAMS if pdl is None else pdl) and pdl_enabled(q)
    mode = NO_NORM
    if norm and not fuse:
        fits = norm_in_decode_launch(q, n, T, V, bv, nw)
        if one_launch and not fits:
            raise ValueError(
                f"the one-launch norm needs T = 1 and at most {one_launch_limit(q, nw)} programs resident "
                f"on this device, got T = {T} and {programs}"
            )
        mode = ONE_LAUNCH if (fits if one_launch is None else one_launch) else TWO_LAUNCHES
        shape = partials_spec(n * T, H, V, bv)
        if partials is None:
            partials = torch.zeros(shape, dtype=torch.int64, device=q.device)
        elif tuple(partials.shape) != shape or partials.dtype != torch.int64 or not partials.is_contiguous():
            got = f"{partials.dtype} {tuple(partials.shape)}"
            raise ValueError(f"partials must be a contiguous int64 {shape}, got {got}")
    _kda_decode_kernel[(programs,)](
        q, k, v, a, b, A_log, dt_bias, z, norm_weight, state, state_indices, num_accepted, num_live, out,
        out if partials is None else partials,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), z.stride(0), z.stride(1),
        out.stride(0), out.stride(1), state.stride(0), state_indices.stride(0), state_indices.stride(1),
        K**-0.5 if scale is None else float(scale), float(lower_bound), float(norm_eps),
        H=H, K=K, V=V, T=T, BV=bv, FUSE_NORM=fuse, NORM=mode, PDL=pdl, **switch_constexprs(),
        num_warps=nw, **_pdl_launch(pdl),
    )  # fmt: skip
    if mode == TWO_LAUNCHES:
        launch_gated_norm(out, z, norm_weight, norm_eps, pdl, partials)


def launch_gated_norm(
    out: Tensor, z: Tensor, norm_weight: Tensor, norm_eps: float, pdl: bool, partials: Tensor | None = None
) -> None:
    """The split path's gated RMSNorm, in place on out [rows, H, V], the sums of squares from the decode
    launch's partial words, or from out (partials None: a peer's). Its program: norm_program_shape."""
    rows, H, V = out.shape
    nv = 0 if partials is None else partials.shape[2]
    pairs, warps = norm_program_shape(rows * H)
    _gated_rmsnorm_kernel[(triton.cdiv(rows * H, pairs),)](
        out, z, norm_weight, out if partials is None else partials,
        out.stride(0), out.stride(1), z.stride(0), z.stride(1), float(norm_eps), rows * H,
        H=H, V=V, NV=nv, RH=pairs, PDL=pdl, num_warps=warps, **_pdl_launch(pdl),
    )  # fmt: skip


def norm_program_shape(pairs: int) -> tuple[int, int]:
    """((row, head) pairs per program, warps) of the two-launch norm over `pairs` pairs (_NORM_PAIRS_FROM)."""
    return (_NORM_PAIRS, _NORM_WARPS) if pairs >= _NORM_PAIRS_FROM else (1, 1)


def decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    z: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor,
    num_live: Tensor,
    out: Tensor,
    *,
    lower_bound: float = -5.0,
    norm_eps: float = 1e-5,
    scale: float | None = None,
) -> None:
    """KDA decode/verify (KDA.md §3) into `out`, updating `state` in place. See module docstring."""
    check_decode_args(
        q, k, v, a, b, A_log, dt_bias, z, norm_weight, state, state_indices, num_accepted, num_live, out
    )
    launch_decode(
        q, k, v, a, b, A_log, dt_bias, z, norm_weight, state, state_indices, num_accepted, num_live, out,
        lower_bound=lower_bound, norm_eps=norm_eps, scale=scale,
    )  # fmt: skip
