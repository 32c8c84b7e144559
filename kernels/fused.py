"""Triton kernels for the decoder's glue around the GEMMs and the KDA core, one launch where eager torch
launches many (docs/KDA.md, "Decode step"): a projection kernel for decode-sized inputs, alone or with
glue folded into its epilogue (the residual add and the next RMSNorm but its 1/rms after the projection
that produces a residual branch; that 1/rms, and SiLU-and-multiply, after the one that reads the norm),
and the step's end (last add, final norm, fp32 LM head) as one such launch; RMSNorm with the residual add
and SiLU-and-multiply alone; the KDA short convolution of a decode step with the two gate projections; RoPE
with the paged K/V write; the selector's key pooling and top-k group selection; the selected-rows
attention. On sm_90 they launch with programmatic dependent launch.

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------ programmatic dependent launch

# On sm_90 and later the kernels here launch with programmatic dependent launch (PDL): a kernel's programs
# may be scheduled while the kernel before it in the stream is finishing, and each one waits
# (griddepcontrol.wait) for that kernel's completion and memory before it reads or writes anything a step
# produces. Only weights, which no kernel of a step writes, are touched before the wait: a projection pulls
# its first weight lines into L2 there. Each kernel lets the next one launch
# (griddepcontrol.launch_dependents) once past its own wait: after the main loop in a projection, at the
# start elsewhere. A kernel launched without the attribute, or after one that never signals, waits for its
# predecessor's end as before, so the kernels of other libraries in between keep the stream's order.
# Captured CUDA graphs keep the attribute as a programmatic edge. A module switch, not an environment
# variable: bench/graphs.py times the step with and without it in one process.
PDL = True
_CAPABILITY: dict[int, tuple[int, int]] = {}


def pdl_enabled(t: Tensor) -> bool:
    """Whether a launch on t's device uses PDL: the switch is on and the device is sm_90 or later."""
    if not (PDL and t.is_cuda):
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return cap[0] >= 9


def _pdl_launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _pdl_enter(PDL: tl.constexpr, RELEASE: tl.constexpr):
    """Wait for the previous kernel (a no-op without PDL); with RELEASE, let the next one launch."""
    if PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Pull the 128-byte lines at ptrs into L2: no register is written and no fault is raised."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


# ------------------------------------------------------------------ skinny linear (decode-sized M)

# Rows up to which linear_small may serve a projection (a decode or verify step's tokens); larger M goes
# to cuBLAS. Which weight shapes it serves, and with which launch shape (BN, BK, warps, stages, split),
# comes from bench/linear.py's sweep on the H200 (bench/results/linear-h200-2026-12-01.json): the shapes
# where it beat cuBLAS at both 1 and 32 rows, and MLP gate_up, where it read the weights at 0.97-0.98x
# cuBLAS's rate but serving it computes the SwiGLU activation (and the post-attention norm's 1/rms) in
# its epilogue, one launch of about 2 us fewer per layer. qkv's 5120 rows make 1.2 waves of 32-row tiles
# on 132 SMs (0.81x) and stay with cuBLAS until a split launch shape is measured faster. Fixed constants,
# not an autotuner, so that a process's numerics never depend on which config won a timing race.
SMALL_M = 32
SMALL_SHAPES: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (4096, 8192): (32, 256, 4, 4, 1),  # 1.13x / 1.10x cuBLAS at 1 / 32 rows (MLP down)
    (4096, 4096): (32, 256, 4, 3, 1),  # 1.29x / 1.09x (KDA out_proj, attention o_proj)
    (12576, 4096): (32, 128, 4, 4, 1),  # 1.06x / 1.03x (KDA in_proj)
    (16384, 4096): (32, 128, 4, 4, 1),  # 0.98x / 0.97x alone; served for its epilogue (MLP gate_up)
}
_BN, _BK, _WARPS, _STAGES, _SPLIT = 32, 256, 4, 4, 1  # any other shape asked for directly (tests, sweeps)
# A launch shape for one kind of launch (_KERNELS' names) of one weight shape, where what it folds in after
# the weight loop wants another than SMALL_SHAPES gives the plain projection: bench/linear.py --fold-sweep
# times each fold at every shape of the sweep and names the fastest (fastest_folded); every other kind and
# weight shape gets the plain projection's shape. Empty: on an H100 (2026-12-06; no H200 was lent that
# day) linear_add_norm of 4096 x 4096 (KDA out_proj and attention o_proj, 8 launches of the step) alone
# took 10.00 us at 1 row with 64-column tiles and K split in 4 against 12.45 at the plain projection's
# shape (bench/results/linear-h100-2026-12-06-add-norm-fold-sweep.json), and in a second sweep 9.81 / 12.81
# us at 1 / 32 rows against 12.09 / 15.18 (MLP down at that shape: 30.81 against 28.83 us at 32 rows). In
# the one-request step, timed beside the same step without the entry in interleaved rounds, it was 0.6%
# slower: 1047.7 against 1041.7 us (bench/results/graphs-h100-2026-12-06-kind-shapes.json,
# kind_shapes_step_batch_1), so what one launch alone gains does not survive its neighbours under PDL.
# (The second sweep's file named the commit before the change it timed and is not kept.)
KIND_SHAPES: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {}
# linear_add_norm's epilogue with its residual and norm weight loaded before the weight loop (after the PDL
# wait) and each row's sum of squares over the column tile taken from registers by a fixed tree of pairwise
# adds (_square_sums), instead of storing the sum, a barrier and reading it back: two round trips fewer at the
# end of every program. Its bits do not depend on BM by construction (elementwise adds only). Why: on the
# H200 (2026-12-05) the 15 add-and-norm launches of the one-request step read their weights at 2.96 TB/s
# against 3.84-3.87 for the other folds (bench/results/graphs-h200-2026-12-05.json, no PDL). On by measure
# in the step: on an H100 (2026-12-06, eef4c13, bench/results/graphs-h100-2026-12-06-fused-prefill.json,
# steps_beside_batch_1, 7 interleaved rounds) the one-request step replayed in 1028.0 us with it against
# 1039.0 without (1.011x); bench/graphs.py times the other setting beside the default in every run.
ADD_SQ_IN_REGS = True
# Split-K's per-tile arrival counters: one int32 per column tile, zero between launches (the last program
# of a tile resets its own), allocated once per device and never moved (captured graphs hold the address).
_COUNTER_SLOTS = 4096
_COUNTERS: dict[torch.device, Tensor] = {}

# The LM head's launch shape (any vocabulary, K = hidden): 16-column tiles, K split in 4, so that a
# 260-row head reads its weights with 68 programs rather than 17.
HEAD_SHAPE = (16, 256, 4, 3, 4)

# What a projection's launch computes besides x @ W.T. Its weight loop is the same for every kind: x and
# the weight tiles pipelined through shared memory into the tensor cores, nothing else. Whatever is folded
# in is computed once per output element, after the loop (the epilogue):
#   linear_small        y = x @ W.T
#   linear_add_norm     s = residual + x @ W.T (the residual stream), u = s * the next norm's weight, and
#                       per column tile the rows' sums of s^2: the next RMSNorm, but for its 1/rms
#   norm_linear         y = (u @ W.T) / rms(s), the 1/rms from those partial sums (the deferred norm)
#   swiglu_linear       silu(gate) * up of [gate | up] = x @ W.T (MLP gate_up; with the 1/rms of
#                       norm_linear first where x is a linear_add_norm's u), W's gate and up rows
#                       interleaved in each program's tile so that both halves of an output are its own
# The norm's elementwise work and SiLU are not put before the dot (in the loop): there every program would
# redo them for the whole input row, each warp for its own copy of the x tile, in the loop that must keep
# the weight stream busy (on the H200, 2026-12-04, such prologues read the weights at 0.7-1 TB/s against
# linear_small's 3.5). norm_head keeps a prologue (PRO_HEAD): its normed row must round exactly as the
# norm's kernel rounds it, and its 260-row head is 2 MB.


def serves_small(weight: Tensor, rows: int) -> bool:
    """Whether the module's table gives this weight a linear_small launch shape for `rows` rows."""
    return tuple(weight.shape) in SMALL_SHAPES and rows <= SMALL_M and weight.element_size() == 2


def serves_head(weight: Tensor, rows: int) -> bool:
    """Whether norm_head serves an LM head of this weight for `rows` rows."""
    return rows <= SMALL_M and weight.element_size() == 2 and weight.stride(1) == 1


def launch_shape(N: int, K: int, config=None, kind: str = "plain") -> tuple[int, int, int, int, int]:
    """(BN, BK, warps, stages, split) for a `kind` launch (_KERNELS' names) of an N x K weight: `config`
    (4 entries: split 1), else KIND_SHAPES' for the kind, else SMALL_SHAPES' for the weight shape."""
    default = (_BN, _BK, _WARPS, _STAGES, _SPLIT)
    c = tuple(config or KIND_SHAPES.get((kind, N, K)) or SMALL_SHAPES.get((N, K), default))
    return c if len(c) == 5 else (*c, 1)  # type: ignore[return-value]


def prefetch_lines(BK: int) -> int:
    """128-byte lines of each weight row a projection's program pulls into L2 before its PDL wait: its
    first two BK-column tiles (16-bit weights)."""
    return _next_pow2(max(1, 2 * BK // 64))


def _split_counters(device: torch.device) -> Tensor:
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "linear_small's split-K counters are allocated on first use: run a split launch once "
                "before capturing a CUDA graph"
            )
        c = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c


@triton.jit
def _head_x_tile(x, stride_x, res, stride_r, g, s_out, stride_s, rstd, m, k, mask, write_s, K: tl.constexpr):
    """norm_head's x operand, rows m, columns k: RMSNorm(x + residual) * g rounded as the norm's kernel
    rounds it (rstd known); the programs of column tile 0 store the sum."""
    dt = x.dtype.element_ty
    s = tl.load(x + m[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
    r = tl.load(res + m[:, None] * stride_r + k[None, :], mask=mask, other=0.0)
    s = (s.to(tl.float32) + r.to(tl.float32)).to(dt)  # the residual add, rounded as torch's add is
    tl.store(s_out + m[:, None] * stride_s + k[None, :], s, mask=mask & write_s)
    gv = tl.load(g + k, mask=k < K, other=0.0).to(tl.float32)
    return (s.to(tl.float32) * rstd[:, None] * gv[None, :]).to(dt)


# Rows of the reductions a projection's epilogue (and the head's first pass) computes per row: every
# launch sums a row's squares in [*, RB] or [RB, *] register tiles, one per RB rows of its tensor-core
# tile (BM = RB or 2 * RB), so that a row's bits do not depend on how many rows share the launch. Each
# @jit function that needs it declares `RB: tl.constexpr = 16` itself: a constexpr global read by a helper
# entered its callers' Triton keys only for the callers asked for after the helper (Triton 3.6 merges a
# callee's globals before computing them), so processes that first launched kernels in different orders
# disagreed on their keys, and engines missed kernels the warm step had compiled
# (tests/kernels/test_cache_keys.py).
RB_ROWS = 16


@triton.jit
def _cat_rows(lo, hi):
    """[2 * RB] from the per-row values of rows 0..RB-1 (lo) and RB..2*RB-1 (hi)."""
    RB: tl.constexpr = 16  # RB_ROWS
    return tl.reshape(tl.permute(tl.join(lo, hi), (1, 0)), [2 * RB])


@triton.jit
def _sq_partials(sq, M, T, r0: tl.constexpr, TP: tl.constexpr):
    """Rows r0..r0+RB-1's sums of their T partial sums of squares sq [T, M], in a fixed order."""
    RB: tl.constexpr = 16  # RB_ROWS
    TC: tl.constexpr = 64 if TP > 64 else TP
    mr = r0 + tl.arange(0, RB)
    tot = tl.zeros([RB], dtype=tl.float32)
    for t0 in tl.static_range(0, TP, TC):
        t = t0 + tl.arange(0, TC)
        p = tl.load(sq + t[:, None] * M + mr[None, :], mask=(t[:, None] < T) & (mr[None, :] < M), other=0.0)
        tot += tl.sum(p, axis=0)
    return tot


@triton.jit
def _sq_tile(s_out, stride_s, sq, M, N, n, tile, r0: tl.constexpr):
    """Rows r0..r0+RB-1 of this column tile's sums of squares, from the stored sum read back."""
    RB: tl.constexpr = 16  # RB_ROWS
    mr = r0 + tl.arange(0, RB)
    rmask = (mr[:, None] < M) & (n[None, :] < N)
    sr = tl.load(s_out + mr[:, None] * stride_s + n[None, :], mask=rmask, other=0.0).to(tl.float32)
    tl.store(sq + tile * M + mr, tl.sum(sr * sr, axis=1), mask=mr < M)


@triton.jit
def _head_sq(x, stride_x, res, stride_r, M, r0: tl.constexpr, K: tl.constexpr, PBK: tl.constexpr):
    """norm_head's first pass for rows r0..r0+RB-1: (x + residual) rounded as torch's add is, its squares
    summed over the row in chunks of PBK columns (a loop without a dot is not software-pipelined, so each
    chunk is a round trip)."""
    RB: tl.constexpr = 16  # RB_ROWS
    mr = r0 + tl.arange(0, RB)
    sq_h = tl.zeros([RB], dtype=tl.float32)
    for kb in range(0, K, PBK):
        k = kb + tl.arange(0, PBK)
        xmask = (mr[:, None] < M) & (k[None, :] < K)
        sx = tl.load(x + mr[:, None] * stride_x + k[None, :], mask=xmask, other=0.0).to(tl.float32)
        sr = tl.load(res + mr[:, None] * stride_r + k[None, :], mask=xmask, other=0.0).to(tl.float32)
        sf = (sx + sr).to(x.dtype.element_ty).to(tl.float32)
        sq_h += tl.sum(sf * sf, axis=1)
    return sq_h


@triton.jit
def _square_sums(v, BM: tl.constexpr, BN: tl.constexpr):
    """Each row's sum of squares of v [BM, BN] as a fixed tree of elementwise operations: columns 2i and
    2i + 1 first, as fma(v_2i, v_2i, v_2i+1²), then pairs of those by adds. No reduction whose order a
    register layout sets, and no multiply left for the compiler to fuse into an add or not depending on
    where the layout moves the operands, so a row's bits never depend on BM."""
    lo, hi = tl.split(tl.reshape(v, [BM, BN // 2, 2]))
    v = tl.fma(lo, lo, hi * hi)
    for i in tl.static_range(1, 8):  # BN <= 256
        if (BN >> i) > 1:
            lo, hi = tl.split(tl.reshape(v, [BM, (BN >> i) // 2, 2]))
            v = lo + hi
    return tl.reshape(v, [BM])


@triton.jit
def _epilogue(
    acc, x, y, stride_y, res, stride_r, g, s_out, u_out, stride_s, sq, M, N, T, eps, m, tile, r_pre, g_pre,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TP: tl.constexpr, RSTD: tl.constexpr,
    SWIGLU: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    """What a launch computes from its tile's fp32 x @ W.T (rows m, column tile `tile`), once per output.
    ADD: 1 the residual add and the next norm, 2 the same from r_pre and g_pre (ADD_SQ_IN_REGS)."""
    RB: tl.constexpr = 16  # RB_ROWS
    dt = x.dtype.element_ty
    if RSTD:  # the deferred norm: 1/rms of each row from the T partial sums of squares sq [T, M]
        rs = 1.0 / tl.sqrt(_sq_partials(sq, M, T, 0, TP) / K + eps)
        if BM > RB:
            rs = _cat_rows(rs, 1.0 / tl.sqrt(_sq_partials(sq, M, T, RB, TP) / K + eps))
        acc = acc * rs[:, None]
    if SWIGLU:  # the tile's columns are (gate, up) pairs of BN // 2 outputs
        BO: tl.constexpr = BN // 2
        gate, up = tl.split(tl.reshape(acc, [BM, BO, 2]))
        gate = gate.to(dt).to(tl.float32)  # gate_up's output, rounded as its store would round it
        up = up.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu rounds its output
        o = tile * BO + tl.arange(0, BO)
        omask = (m[:, None] < M) & (o[None, :] < N // 2)
        tl.store(y + m[:, None] * stride_y + o[None, :], (act * up).to(dt), mask=omask)
    elif ADD:  # the residual add and the next norm but its 1/rms
        n = tile * BN + tl.arange(0, BN)
        omask = (m[:, None] < M) & (n[None, :] < N)
        yv = acc.to(dt).to(tl.float32)  # the projection's output, rounded as linear_small's store rounds it
        if ADD == 2:
            r = r_pre
        else:
            r = tl.load(res + m[:, None] * stride_r + n[None, :], mask=omask, other=0.0).to(tl.float32)
        s = (yv + r).to(dt)  # the residual add, rounded as torch's add is
        tl.store(s_out + m[:, None] * stride_s + n[None, :], s, mask=omask)
        sf = s.to(tl.float32)
        if ADD == 2:
            gv = g_pre
        else:
            gv = tl.load(g + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(u_out + m[:, None] * stride_s + n[None, :], (sf * gv[None, :]).to(dt), mask=omask)
        if ADD == 2:  # rows past M are zero (masked loads), so their sums are too; not stored
            tl.store(sq + tile * M + m, _square_sums(sf, BM, BN), mask=m < M)
        else:
            # This tile's columns' sums of squares, from the stored sum read back RB rows at a time: summed
            # in the tensor-core tile's own layout, their order (and last bits) would depend on BM.
            tl.debug_barrier()  # every thread's stores of s above, before any thread reads them back
            _sq_tile(s_out, stride_s, sq, M, N, n, tile, 0)
            if BM > RB:
                _sq_tile(s_out, stride_s, sq, M, N, n, tile, RB)
    else:
        n = tile * BN + tl.arange(0, BN)
        omask = (m[:, None] < M) & (n[None, :] < N)
        tl.store(y + m[:, None] * stride_y + n[None, :], acc.to(y.dtype.element_ty), mask=omask)


@triton.jit
def _linear_body(
    x,
    w,
    y,
    res,  # ADD, PRO_HEAD: the residual added
    g,  # ADD, PRO_HEAD: the norm's weight [N] (ADD) or [K] (PRO_HEAD)
    s_out,  # ADD: x @ W.T + residual; PRO_HEAD: x + residual, written by the programs of column tile 0
    u_out,  # ADD: s_out * g
    sq,  # ADD: written, RSTD: read: [T, M] fp32 partial sums of squares of the normed rows
    part,  # SPLIT > 1: fp32 partials [SPLIT, M, tiles * BN]
    counters,  # SPLIT > 1: one arrival count per column tile, zero on entry and on exit
    M,
    N,  # weight rows
    T,  # RSTD: sq's partial sums per row
    stride_x,
    stride_w,
    stride_y,
    stride_r,
    stride_s,
    eps,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    TP: tl.constexpr,  # a power of two >= T
    PRO_HEAD: tl.constexpr,
    RSTD: tl.constexpr,
    SWIGLU: tl.constexpr,
    ADD: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    PF: tl.constexpr,
):
    RB: tl.constexpr = 16  # RB_ROWS
    pid = tl.program_id(0)
    tile = pid // SPLIT
    ks = pid % SPLIT
    KS: tl.constexpr = (K + SPLIT * BK - 1) // (SPLIT * BK) * BK  # columns per split, whole BK steps
    PBK: tl.constexpr = 16384 // RB if 16384 // RB < K else BK  # the head's first pass: columns per chunk
    j = tl.arange(0, BN)
    if SWIGLU:  # W = [gate; up], N // 2 rows each: the tile's rows alternate gate and up of one output
        o = tile * (BN // 2) + j // 2
        n = (j % 2) * (N // 2) + o
        n_ok = o < N // 2
    else:
        n = tile * BN + j
        n_ok = n < N
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    k_lo = ks * KS
    w_row = w + n[:, None].to(tl.int64) * stride_w
    if PDL:
        # weights are never written by a step: this program's first lines go to L2 before the wait
        rows = tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w
        _prefetch_l2(w + rows + tl.minimum(k_lo + tl.arange(0, PF)[None, :] * 64, K - 1))
    _pdl_enter(PDL, False)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if ADD == 2:  # the epilogue's residual and norm weight, in flight while the weight loop runs
        amask = (m[:, None] < M) & n_ok[None, :]
        r_pre = tl.load(res + m[:, None] * stride_r + n[None, :], mask=amask, other=0.0).to(tl.float32)
        g_pre = tl.load(g + n, mask=n_ok, other=0.0).to(tl.float32)
    else:
        r_pre, g_pre = acc, acc  # not read
    rstd = tl.zeros([BM], dtype=tl.float32)
    if PRO_HEAD:  # a first pass over the whole row (L2-resident) for its 1/rms, RB rows at a time
        rstd = 1.0 / tl.sqrt(_head_sq(x, stride_x, res, stride_r, M, 0, K, PBK) / K + eps)
        if BM > RB:  # rows past RB exist only in 32-row launches: narrower chunks keep those from spilling
            PB2: tl.constexpr = PBK // 2 if PBK > 16 else PBK
            rs1 = 1.0 / tl.sqrt(_head_sq(x, stride_x, res, stride_r, M, RB, K, PB2) / K + eps)
            rstd = _cat_rows(rstd, rs1)
    for kb in range(0, KS, BK):  # a constant trip count (the interpreter cannot bound a range by a tensor)
        k = k_lo + kb + kk
        xmask = (m[:, None] < M) & (k[None, :] < K)
        if EVEN:  # every tile's rows exist and K % (SPLIT * BK) == 0: only the rows of x past M are masked
            wv = tl.load(w_row + k[None, :])
        else:
            wv = tl.load(w_row + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
        if PRO_HEAD:
            xv = _head_x_tile(x, stride_x, res, stride_r, g, s_out, stride_s, rstd, m, k, xmask, tile == 0, K)
        else:
            xv = tl.load(x + m[:, None] * stride_x + k[None, :], mask=xmask, other=0.0)
        acc += tl.dot(xv, tl.trans(wv), out_dtype=tl.float32)
    if PDL:
        gdc_launch_dependents()
    if SPLIT == 1:
        _epilogue(
            acc, x, y, stride_y, res, stride_r, g, s_out, u_out, stride_s, sq, M, N, T, eps, m, tile, r_pre,
            g_pre, K, BM, BN, TP, RSTD, SWIGLU, ADD,
        )  # fmt: skip
    else:
        # Each split stores its partial; the tile's last program to arrive (an acq_rel count after a barrier
        # that orders every thread's stores before it) sums the partials in split order, so the result does
        # not depend on the arrival order, runs the epilogue and resets the count for the next launch.
        NP = tl.num_programs(0) // SPLIT * BN  # the partials' row: every tile's BN columns
        pmask = (m[:, None] < M) & (j[None, :] < BN)
        col = tile * BN + j
        tl.store(part + (ks * M + m[:, None]) * NP + col[None, :], acc, mask=pmask)
        tl.debug_barrier()
        if tl.atomic_add(counters + tile, 1, sem="acq_rel") == SPLIT - 1:
            tot = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                p = part + (i * M + m[:, None]) * NP + col[None, :]
                tot += tl.load(p, mask=pmask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counters + tile, 0, sem="relaxed")
            _epilogue(
                tot, x, y, stride_y, res, stride_r, g, s_out, u_out, stride_s, sq, M, N, T, eps, m, tile,
                r_pre, g_pre, K, BM, BN, TP, RSTD, SWIGLU, ADD,
            )  # fmt: skip


# One kernel per kind, each the same body, so that a profile of the step names what each launch does.
# (Their argument lists are the body's.)


@triton.jit(do_not_specialize=["M"])
def _linear_small_kernel(
    x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
    stride_s, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, TP: tl.constexpr, PRO_HEAD: tl.constexpr, RSTD: tl.constexpr, SWIGLU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):  # fmt: skip
    """linear_small: y = x @ W.T."""
    _linear_body(
        x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
        stride_s, eps, K, BM, BN, BK, EVEN, TP, PRO_HEAD, RSTD, SWIGLU, ADD, SPLIT, PDL, PF,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _linear_add_norm_kernel(
    x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
    stride_s, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, TP: tl.constexpr, PRO_HEAD: tl.constexpr, RSTD: tl.constexpr, SWIGLU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):  # fmt: skip
    """linear_add_norm: the residual add and the next RMSNorm but its 1/rms in the epilogue."""
    _linear_body(
        x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
        stride_s, eps, K, BM, BN, BK, EVEN, TP, PRO_HEAD, RSTD, SWIGLU, ADD, SPLIT, PDL, PF,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _norm_linear_kernel(
    x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
    stride_s, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, TP: tl.constexpr, PRO_HEAD: tl.constexpr, RSTD: tl.constexpr, SWIGLU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):  # fmt: skip
    """norm_linear: the deferred norm's 1/rms on the accumulator."""
    _linear_body(
        x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
        stride_s, eps, K, BM, BN, BK, EVEN, TP, PRO_HEAD, RSTD, SWIGLU, ADD, SPLIT, PDL, PF,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _swiglu_linear_kernel(
    x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
    stride_s, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, TP: tl.constexpr, PRO_HEAD: tl.constexpr, RSTD: tl.constexpr, SWIGLU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):  # fmt: skip
    """swiglu_linear: MLP gate_up with SiLU-and-multiply (and the deferred norm's 1/rms) in the epilogue."""
    _linear_body(
        x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
        stride_s, eps, K, BM, BN, BK, EVEN, TP, PRO_HEAD, RSTD, SWIGLU, ADD, SPLIT, PDL, PF,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _norm_head_kernel(
    x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
    stride_s, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, TP: tl.constexpr, PRO_HEAD: tl.constexpr, RSTD: tl.constexpr, SWIGLU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):  # fmt: skip
    """linear_small: the LM head's add and norm folded in, fp32 logits."""
    _linear_body(
        x, w, y, res, g, s_out, u_out, sq, part, counters, M, N, T, stride_x, stride_w, stride_y, stride_r,
        stride_s, eps, K, BM, BN, BK, EVEN, TP, PRO_HEAD, RSTD, SWIGLU, ADD, SPLIT, PDL, PF,
    )  # fmt: skip


_KERNELS = {
    "plain": _linear_small_kernel,
    "add_norm": _linear_add_norm_kernel,
    "norm": _norm_linear_kernel,
    "swiglu": _swiglu_linear_kernel,
    "head": _norm_head_kernel,
}


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def column_tiles(N: int, K: int, config=None, kind: str = "plain") -> int:
    """Programs per K split of a `kind` projection of an N x K weight: one per BN weight rows (BN // 2
    outputs of a SwiGLU's interleaved gate and up rows)."""
    BN = launch_shape(N, K, config, kind)[0]
    return triton.cdiv(N // 2, BN // 2) if kind == "swiglu" else triton.cdiv(N, BN)


def _linear_launch(
    kind: str,
    x2: Tensor,
    weight: Tensor,
    config,
    y: Tensor,
    *,
    res: Tensor | None = None,
    g: Tensor | None = None,
    s_out: Tensor | None = None,
    u_out: Tensor | None = None,
    sq: Tensor | None = None,
    eps: float = 0.0,
) -> None:
    M = x2.shape[0]
    N, K = weight.shape
    assert M <= SMALL_M and weight.stride(1) == 1 and x2.shape[1] == K and x2.stride(1) == 1
    BN, BK, warps, stages, split = launch_shape(N, K, config, kind)
    BK = min(BK, max(16, _next_pow2(K)))
    # A row's bits must not depend on how many rows share the launch, or a verify step (1 + drafts rows)
    # drifts from the decode step of plain greedy decoding: M is not specialized (Triton would compile
    # M = 1 apart), and the epilogue's sums run in tiles of RB rows, one or two per BM (in the tensor-core
    # tile's layout their order depended on BM). Measured on the H200 (2026-12-04): with BM's layout,
    # row 0 at 5 rows of norm_linear a bf16 step from the same row alone, the sums of squares at 32 rows
    # 8e-6 apart; with one 32-row tile for every M, the one-request step 955.6 us against 850.
    BM = 16 if M <= 16 else 32
    swiglu = kind == "swiglu"
    if swiglu:
        assert N % 2 == 0 and BN % 2 == 0 and y.shape == (M, N // 2)
    else:
        assert y.shape == (M, N)
    assert y.stride(1) == 1
    tiles = column_tiles(N, K, config, kind)
    even = (N // 2) % (BN // 2) == 0 if swiglu else N % BN == 0
    if split > 1:
        assert tiles <= _COUNTER_SLOTS
        part = torch.empty(split * M * tiles * BN, dtype=torch.float32, device=x2.device)
        counters = _split_counters(x2.device)
    else:
        part = counters = y  # not read
    rstd = sq is not None and kind != "add_norm"
    assert rstd or kind != "norm", "norm_linear needs the producer's partial sums of squares"
    if kind == "add_norm":
        assert sq is not None and sq.shape == (tiles, M) and s_out is not None and u_out is not None
        assert u_out.stride() == s_out.stride()
    elif rstd:
        assert sq is not None and sq.shape[1] == M and sq.dtype == torch.float32 and sq.is_contiguous()
    T = 0 if sq is None else sq.shape[0]
    pdl = pdl_enabled(x2)
    _KERNELS[kind][(tiles * split,)](
        x2,
        weight,
        y,
        x2 if res is None else res,
        x2 if g is None else g,
        y if s_out is None else s_out,
        y if u_out is None else u_out,
        part if sq is None else sq,
        part,
        counters,
        M,
        N,
        T,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        0 if res is None else res.stride(0),
        0 if s_out is None else s_out.stride(0),
        eps,
        K,
        BM,
        BN,
        BK,
        even and K % (split * BK) == 0,
        _next_pow2(max(T, 1)),
        kind == "head",
        rstd,
        swiglu,
        (2 if ADD_SQ_IN_REGS else 1) if kind == "add_norm" else 0,
        split,
        pdl,
        prefetch_lines(BK),
        num_warps=warps,
        num_stages=stages,
        **_pdl_launch(pdl),
    )


def linear_small(x: Tensor, weight: Tensor, config=None) -> Tensor:
    """y = x @ weight.T for a few rows (M <= SMALL_M): every weight byte read once, one program per BN
    output columns (and per K slice with split-K) sweeping K, fp32 accumulation on the tensor cores;
    16-bit dtypes.

    x [M, K] (rows may be strided); weight [N, K] contiguous. config: (BN, BK, warps, stages[, split]) to
    override the module's launch shape (the sweep)."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    N = weight.shape[0]
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    _linear_launch("plain", x2, weight, config, y)
    return y.view(*x.shape[:-1], N)


# linear_rows' one launch shape, for every M: a row's product must not depend on how many rows share the
# launch or where among them it sits (the prefill of a batch of prompts, tests/engine/test_fused_glue.py),
# so nothing here is chosen by M, and K is summed in BK steps in one order by the program that owns the
# tile (no split-K, no stream-K: cuBLAS chooses its kernels, and so its sums, by M).
ROWS_BM, ROWS_BN, ROWS_BK, ROWS_WARPS, ROWS_STAGES = 64, 128, 64, 4, 3


@triton.jit(do_not_specialize=["M"])
def _linear_rows_kernel(
    x, w, y, M, N, stride_x, stride_w, stride_y,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # K is a constexpr: a constant trip count (the interpreter cannot bound a range by a tensor)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    x_rows = x + m[:, None].to(tl.int64) * stride_x
    w_rows = w + n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        xv = tl.load(x_rows + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        wv = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(xv, tl.trans(wv), out_dtype=tl.float32)
    out = y + m[:, None].to(tl.int64) * stride_y + n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def linear_rows(x: Tensor, weight: Tensor) -> Tensor:
    """y = x @ weight.T for any number of rows, each row's bits independent of the others: one launch shape
    for every M (ROWS_*), fp32 accumulation over K in one order, rounded once to x's dtype. What the batched
    prefill projects with (qualify/engine/model/norm.py, rows_invariant), where cuBLAS's result for a row
    depends on how many rows share the call. x [M, K] (rows may be strided); weight [N, K], last dim
    contiguous; 16-bit dtypes (fp32 under the interpreter too)."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    N, K = weight.shape
    assert x2.shape[1] == K and weight.stride(1) == 1 and x2.dtype == weight.dtype
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, ROWS_BM), triton.cdiv(N, ROWS_BN))
        _linear_rows_kernel[grid](
            x2, weight, y, M, N, x2.stride(0), weight.stride(0), y.stride(0),
            K=K, BM=ROWS_BM, BN=ROWS_BN, BK=ROWS_BK, num_warps=ROWS_WARPS, num_stages=ROWS_STAGES,
        )  # fmt: skip
    return y.view(*x.shape[:-1], N)


def linear_add_norm(
    x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, config=None
) -> tuple[Tensor, Tensor, Tensor]:
    """A projection that feeds a residual add and the next RMSNorm, in one launch: returns (s, u, sq) with
    s = residual + x @ weight.T (the product rounded to x's dtype as linear_small stores it, then the add
    rounded as torch's add is: the residual stream), u = s * norm_weight rounded to x's dtype, and sq
    [tiles, M] fp32, each column tile's sums of s^2 per row. (u, sq) are the norm's input but for its 1/rms,
    which norm_linear or swiglu_linear apply to their fp32 accumulators. Each output is computed once, by
    the program that owns its column; no program reads what another writes.

    x [M, K] (rows may be strided), residual [M, N], norm_weight [N]; M <= SMALL_M."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    N = weight.shape[0]
    r2 = _rows(residual.reshape(-1, N))
    assert r2.shape[0] == x2.shape[0] and r2.dtype == x2.dtype and norm_weight.shape == (N,)
    M = x2.shape[0]
    s = torch.empty(M, N, dtype=x.dtype, device=x.device)
    u = torch.empty_like(s)
    tiles = column_tiles(N, x2.shape[1], config, "add_norm")
    sq = torch.empty(tiles, M, dtype=torch.float32, device=x.device)
    _linear_launch("add_norm", x2, weight, config, s, res=r2, g=norm_weight, s_out=s, u_out=u, sq=sq)
    shape = (*x.shape[:-1], N)
    return s.view(shape), u.view(shape), sq


def linear_add_norm_reference(x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor):
    """The torch ops: (s, u, sq) with the whole row's sum of squares as its one partial, sq [1, M]."""
    s = F.linear(x, weight) + residual
    sf = s.float().reshape(-1, s.shape[-1])
    return s, (s.float() * norm_weight.float()).to(s.dtype), sf.pow(2).sum(-1)[None]


def rms_scale(sq: Tensor, eps: float, K: int) -> Tensor:
    """1/rms [M, 1] of the rows whose partial sums of squares (over K columns) are sq [tiles, M]."""
    return torch.rsqrt(sq.sum(0) / K + eps)[:, None]


def norm_linear(u: Tensor, sq: Tensor, eps: float, weight: Tensor, config=None) -> Tensor:
    """RMSNorm(s) * norm_weight @ weight.T from linear_add_norm's (u, sq): u @ weight.T on the tensor
    cores, then the rows' 1/rms (fp32, from sq) on the fp32 accumulator, rounded once to u's dtype. The
    normed row is rounded once (u), as the two-launch path rounds its own (the norm's output): the same
    error from the exact value, not the same bits. u [M, K] with M <= SMALL_M."""
    x2 = _rows(u.reshape(-1, u.shape[-1]))
    N = weight.shape[0]
    y = torch.empty(x2.shape[0], N, dtype=u.dtype, device=u.device)
    _linear_launch("norm", x2, weight, config, y, sq=sq, eps=eps)
    return y.view(*u.shape[:-1], N)


def norm_linear_reference(total: Tensor, norm_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    """The norm's kernel then the projection, as two launches or torch ops compute them."""
    return F.linear(rmsnorm_reference(total, norm_weight, eps), weight)


def swiglu_linear(x: Tensor, weight: Tensor, sq: Tensor | None = None, eps: float = 0.0, config=None):
    """silu(gate) * up where [gate | up] = x @ weight.T (MLP gate_up, weight [2I, K]: gate rows then up
    rows), in one launch: gate and up rounded to x's dtype as gate_up's output is, then SiLU and the
    product rounded as silu_mul rounds them. With sq (x a linear_add_norm's u), the deferred norm's 1/rms
    is applied to both accumulators first, as in norm_linear. Returns [M, I]; M <= SMALL_M."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    inner = weight.shape[0] // 2
    y = torch.empty(x2.shape[0], inner, dtype=x.dtype, device=x.device)
    _linear_launch("swiglu", x2, weight, config, y, sq=sq, eps=eps)
    return y.view(*x.shape[:-1], inner)


def swiglu_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """gate_up's projection then silu_mul, as the two-launch path runs them."""
    return silu_mul_reference(F.linear(x, weight))


def norm_head(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    hidden_out: Tensor,
    logits_out: Tensor,
    config=None,
) -> None:
    """The end of a decode step in one launch: hidden_out = x + residual (rounded to x's dtype, as torch's
    add is) and logits_out (fp32) = RMSNorm(hidden) * norm_weight @ weight.T. The normed row is rounded to
    x's dtype exactly as the norm's kernel rounds it (its 1/rms from a first pass over the row), and the
    16-bit products of the dot are exact in its fp32 accumulator: the torch path's fp32 product of the
    upcast operands, up to the order of the sums. x, residual [M, K] with M <= SMALL_M; weight [V, K]
    16-bit; hidden_out [M, K] and logits_out [M, V] fp32 with unit column stride."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    r2 = _rows(residual.reshape(-1, x2.shape[1]))
    assert hidden_out.stride(1) == 1 and logits_out.dtype == torch.float32
    _linear_launch(
        "head", x2, weight, config or HEAD_SHAPE, logits_out, res=r2, g=norm_weight, s_out=hidden_out,
        eps=eps,
    )  # fmt: skip


def norm_head_reference(
    x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, hidden_out, logits_out
) -> None:
    """The torch path: the add, the norm, the fp32 head (HybridModel.logits), copied into the outputs."""
    s = x + residual
    hidden_out.copy_(s)
    logits_out.copy_(F.linear(rmsnorm_reference(s, norm_weight, eps).float(), weight.float()))


# ------------------------------------------------------------------ RMSNorm (+ residual add)


@triton.jit
def _rmsnorm_kernel(
    x, res, w, y, s, stride_x, stride_r, stride_y, stride_s, D, eps, HAS_RES: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    _pdl_enter(PDL, True)
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


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """y = RMSNorm(x) * weight, or with `residual`: (s, RMSNorm(s) * weight) where s = x + residual.

    x, residual [N, D] (rows may be strided, the last dim must not be); fp32 statistics, outputs in x's
    dtype."""
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    N, D = x2.shape
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    BD = _next_pow2(D)
    warps = 8 if BD >= 4096 else 4
    pdl = pdl_enabled(x2)
    if residual is None:
        _rmsnorm_kernel[(N,)](
            x2, x2, weight, y, y, x2.stride(0), 0, D, D, D, eps, False, BD, pdl, num_warps=warps,
            **_pdl_launch(pdl),
        )  # fmt: skip
        return y.view(x.shape)
    r2 = _rows(residual.reshape(-1, D))
    s = torch.empty_like(y)
    _rmsnorm_kernel[(N,)](
        x2, r2, weight, y, s, x2.stride(0), r2.stride(0), D, D, D, eps, True, BD, pdl, num_warps=warps,
        **_pdl_launch(pdl),
    )  # fmt: skip
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
def _silu_mul_kernel(gu, out, stride_g, stride_o, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _pdl_enter(PDL, True)
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
    pdl = pdl_enabled(g2)
    _silu_mul_kernel[(N, triton.cdiv(inner, BLOCK))](
        g2, out, g2.stride(0), inner, inner, BLOCK, pdl, num_warps=4, **_pdl_launch(pdl)
    )
    return out


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """silu(gate) * up in torch, as unfused engines run it (qualify/engine/model/mlp.py)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------ KDA short convolution, decode


@triton.jit
def _conv_program(
    r, cb, x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w, slots, stride_slots,
    num_accepted, out, stride_o, b_out, stride_b, C, H,
    T: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BWIN: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """Request r's conv channels cb*BC ..: the window, SiLU(conv) per token, the per-position states."""
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


@triton.jit
def _gates_program(
    j, x, stride_x, col0, f_b, g_b, a_out, z_out, stride_a, stride_z, rows, HK, GB,
    GK: tl.constexpr, BG: tl.constexpr, BMG: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    """Output columns of one gate projection for every row: j < GB: a = f_a @ f_b.T, else z = g_a @ g_b.T
    (f_a, g_a: GK columns of x from col0); fp32 accumulation, one rounding."""
    which = j // GB
    o = (j % GB) * BG + tl.arange(0, BG)
    om = o < HK
    kk = tl.arange(0, GK)
    w_off = o[:, None].to(tl.int64) * GK + kk[None, :]
    if which == 0:
        wv = tl.load(f_b + w_off, mask=om[:, None], other=0.0)
    else:
        wv = tl.load(g_b + w_off, mask=om[:, None], other=0.0)
    col = col0 + which * GK
    m = tl.arange(0, BMG)
    mb = 0
    while mb < rows:  # a while loop: the interpreter cannot bound a range by an argument tensor
        rm = mb + m
        xv = tl.load(x + rm[:, None].to(tl.int64) * stride_x + col + kk[None, :], mask=rm[:, None] < rows)
        if FP32:
            acc = tl.dot(xv, tl.trans(wv), input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(wv), out_dtype=tl.float32)
        msk = (rm[:, None] < rows) & om[None, :]
        if which == 0:
            tl.store(a_out + rm[:, None] * stride_a + o[None, :], acc.to(a_out.dtype.element_ty), mask=msk)
        else:
            tl.store(z_out + rm[:, None] * stride_z + o[None, :], acc.to(z_out.dtype.element_ty), mask=msk)
        mb += BMG


@triton.jit
def _conv_body(
    x,  # [n*T, >= C + H (+ 2 GK)] rows: q k v channels (C), then b (H), then f_a, g_a (GK each)
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
    f_b,  # GATES: [HK, GK] each
    g_b,
    a_out,  # GATES: [n*T, HK] each
    z_out,
    stride_a,
    stride_z,
    C,
    H,
    CB,  # conv programs per request
    n_conv,  # n * CB
    HK,
    GB,  # programs per gate projection
    T: tl.constexpr,
    W: tl.constexpr,
    BC: tl.constexpr,
    BWIN: tl.constexpr,
    BH: tl.constexpr,
    GATES: tl.constexpr,
    GK: tl.constexpr,
    BG: tl.constexpr,
    BMG: tl.constexpr,
    FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    _pdl_enter(PDL, True)
    if pid < n_conv:
        _conv_program(
            pid // CB, pid % CB, x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w,
            slots, stride_slots, num_accepted, out, stride_o, b_out, stride_b, C, H, T, W, BC, BWIN, BH,
        )  # fmt: skip
    elif GATES:
        _gates_program(
            pid - n_conv, x, stride_x, C + H, f_b, g_b, a_out, z_out, stride_a, stride_z, n_conv // CB * T,
            HK, GB, GK, BG, BMG, FP32,
        )  # fmt: skip


@triton.jit
def _conv_decode_kernel(
    x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w, slots, stride_slots,
    num_accepted, out, stride_o, b_out, stride_b, f_b, g_b, a_out, z_out, stride_a, stride_z, C, H, CB,
    n_conv, HK, GB, T: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BWIN: tl.constexpr,
    BH: tl.constexpr, GATES: tl.constexpr, GK: tl.constexpr, BG: tl.constexpr, BMG: tl.constexpr,
    FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The decode conv alone."""
    _conv_body(
        x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w, slots, stride_slots,
        num_accepted, out, stride_o, b_out, stride_b, f_b, g_b, a_out, z_out, stride_a, stride_z, C, H, CB,
        n_conv, HK, GB, T, W, BC, BWIN, BH, GATES, GK, BG, BMG, FP32, PDL,
    )  # fmt: skip


@triton.jit
def _conv_gates_decode_kernel(
    x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w, slots, stride_slots,
    num_accepted, out, stride_o, b_out, stride_b, f_b, g_b, a_out, z_out, stride_a, stride_z, C, H, CB,
    n_conv, HK, GB, T: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BWIN: tl.constexpr,
    BH: tl.constexpr, GATES: tl.constexpr, GK: tl.constexpr, BG: tl.constexpr, BMG: tl.constexpr,
    FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The decode conv and the two gate projections (conv_gates_decode)."""
    _conv_body(
        x, stride_x, conv_state, stride_s0, stride_s1, stride_s2, weight, stride_w, slots, stride_slots,
        num_accepted, out, stride_o, b_out, stride_b, f_b, g_b, a_out, z_out, stride_a, stride_z, C, H, CB,
        n_conv, HK, GB, T, W, BC, BWIN, BH, GATES, GK, BG, BMG, FP32, PDL,
    )  # fmt: skip


def _conv_launch(x, conv_state, weight, slots, num_accepted, out, b_out, T, gates) -> None:
    rows, C, W = x.shape[0], conv_state.shape[1], weight.shape[1]
    n, H = rows // T, b_out.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and b_out.stride(1) == 1 and weight.stride(1) == 1
    assert slots.stride(1) == 1 and slots.shape[1] >= T
    BC = 128
    CB = triton.cdiv(C, BC)
    if gates is None:
        f_b = g_b = a_out = z_out = weight  # not read
        HK, GK, GB, BG = 0, 16, 0, 16
    else:
        f_b, g_b, a_out, z_out = gates
        HK, GK = f_b.shape
        assert g_b.shape == f_b.shape and f_b.is_contiguous() and g_b.is_contiguous()
        assert a_out.shape == z_out.shape == (rows, HK) and a_out.stride(1) == 1 and z_out.stride(1) == 1
        assert x.shape[1] >= C + H + 2 * GK and _next_pow2(GK) == GK and GK >= 16
        BG = 64
        GB = triton.cdiv(HK, BG)
    pdl = pdl_enabled(x)
    kernel = _conv_decode_kernel if gates is None else _conv_gates_decode_kernel
    kernel[(n * CB + 2 * GB,)](
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
        f_b,
        g_b,
        a_out,
        z_out,
        a_out.stride(0),
        z_out.stride(0),
        C,
        H,
        CB,
        n * CB,
        HK,
        GB,
        T,
        W,
        BC,
        _next_pow2(W - 1 + T),
        _next_pow2(H),
        gates is not None,
        GK,
        BG,
        16,
        x.dtype == torch.float32,
        pdl,
        num_warps=4,
        **_pdl_launch(pdl),
    )


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
    _conv_launch(x, conv_state, weight, slots, num_accepted, out, b_out, T, None)


def conv_gates_decode(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    slots: Tensor,
    num_accepted: Tensor,
    out: Tensor,
    b_out: Tensor,
    T: int,
    f_b: Tensor,
    g_b: Tensor,
    a_out: Tensor,
    z_out: Tensor,
) -> None:
    """conv_decode and the KDA layer's two low-rank gate projections in one launch: a_out = f_a @ f_b.T
    and z_out = g_a @ g_b.T, where f_a and g_a are the GK = f_b.shape[1] columns of x after the C conv
    channels and the H β logits (fp32 accumulation, rounded once to a_out's dtype). Their programs run
    beside the conv's, each reading one BG-row block of f_b or g_b once for every row of x.
    f_b, g_b [HK, GK] contiguous; a_out, z_out [n*T, HK] with unit column stride."""
    _conv_launch(x, conv_state, weight, slots, num_accepted, out, b_out, T, (f_b, g_b, a_out, z_out))


def conv_gates_decode_reference(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    slots: Tensor,
    num_accepted: Tensor,
    out: Tensor,
    b_out: Tensor,
    T: int,
    f_b: Tensor,
    g_b: Tensor,
    a_out: Tensor,
    z_out: Tensor,
) -> None:
    """The conv's torch reference and the two gate projections as torch matmuls (the unfused engine)."""
    conv_decode_reference(x, conv_state, weight, slots, num_accepted, out, b_out, T)
    lo = conv_state.shape[1] + b_out.shape[1]
    GK = f_b.shape[1]
    torch.mm(x[:, lo : lo + GK], f_b.t(), out=a_out)
    torch.mm(x[:, lo + GK : lo + 2 * GK], g_b.t(), out=z_out)


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


@triton.jit
def _conv_prefill_kernel(
    x, stride_x, positions, cu_seqlens, slots, weight, stride_w, out, stride_o, conv_state, stride_s0,
    stride_s1, stride_s2, total, C, W: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Programs [0, total): one token's SiLU(conv) over BC channels, the taps before its prompt's first
    token zero. Programs [total, total + N): prompt i's conv state after its last token (its last W-1
    inputs, zero before its first token) into slot slots[i]."""
    pid = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    _pdl_enter(PDL, True)
    if pid < total:
        t = pid.to(tl.int64)
        p = tl.load(positions + t).to(tl.int64)  # the token's place in its prompt
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(W):  # tap j reads token t - (W - 1 - j)
            back = W - 1 - j
            xv = tl.load(x + (t - back) * stride_x + c, mask=cm & (p >= back), other=0.0).to(tl.float32)
            wv = tl.load(weight + c * stride_w + j, mask=cm, other=0.0).to(tl.float32)
            acc += xv * wv
        tl.store(out + t * stride_o + c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=cm)
    else:
        i = pid - total
        lo = tl.load(cu_seqlens + i).to(tl.int64)
        hi = tl.load(cu_seqlens + i + 1).to(tl.int64)
        dst = conv_state + tl.load(slots + i).to(tl.int64) * stride_s0 + c * stride_s1
        for k in tl.static_range(W - 1):  # state column k: token hi - (W - 1) + k
            src = hi - (W - 1) + k
            tail = tl.load(x + src * stride_x + c, mask=cm & (src >= lo), other=0.0)
            tl.store(dst + k * stride_s2, tail.to(conv_state.dtype.element_ty), mask=cm)


def conv_prefill(
    x: Tensor,
    positions: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """The depthwise causal conv + SiLU of a varlen prefill batch, each prompt from a zero history, in
    one launch: x [total, C] (unit column stride) holds every token's conv inputs, positions [total] each
    token's place in its prompt, cu_seqlens [N + 1] the prompts' bounds and slots [N] their conv-state
    slots. Returns SiLU(conv) [total, C] in out_dtype (fp32 sums, rounded once) and stores each prompt's
    state after its last token in conv_state [slots, C, W-1]. Every program reads only its own token's
    window (or its own prompt's tail), so a prompt's values never depend on the rest of the batch."""
    total, C = x.shape
    N, W = slots.shape[0], weight.shape[1]
    assert x.stride(1) == 1 and weight.shape[0] == C and conv_state.shape[1:] == (C, W - 1)
    out = torch.empty(total, C, dtype=out_dtype, device=x.device)
    BC = 128
    pdl = pdl_enabled(x)
    _conv_prefill_kernel[(total + N, triton.cdiv(C, BC))](
        x, x.stride(0), positions, cu_seqlens, slots, weight, weight.stride(0), out, out.stride(0),
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), total, C, W, BC, pdl,
        num_warps=1, **_pdl_launch(pdl),
    )  # fmt: skip
    return out


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
    PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    h = tl.program_id(1)  # 0..HQ-1: a query head; HQ..HQ+KVH-1: a key/value head
    _pdl_enter(PDL, True)
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
    pdl = pdl_enabled(qkv)
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
        pdl,
        num_warps=1,
        **_pdl_launch(pdl),
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
    PDL: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    kh = tl.program_id(2)
    _pdl_enter(PDL, True)
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
    pdl = pdl_enabled(k_cache)
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
        pdl,
        num_warps=4,
        **_pdl_launch(pdl),
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
    BT: tl.constexpr,  # next_pow2(TOPK)
    RANK: tl.constexpr,  # top-k by rank ([BGR, BGR] comparisons) rather than K rounds of arg-max
    PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    _pdl_enter(PDL, True)
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
    if RANK:
        # top-k by rank, no loop: a group's place is the number of groups ahead of it in the order (larger
        # score first, ties to the lower group); the groups placed before K are stored at their place, and
        # the places past the groups with a score (> -inf) hold -1, as the repeated arg-max below writes.
        other, mine = score[None, :], score[:, None]
        ahead = (other > mine) | ((other == mine) & (gi[None, :] < gi[:, None]))
        place = tl.sum(ahead.to(tl.int32), axis=1)
        real = score > float("-inf")
        tl.store(rows + tok * stride_rows + place, gi.to(rows.dtype.element_ty), mask=real & (place < K))
        filled = tl.minimum(tl.sum(real.to(tl.int32), axis=0), K)
        p = tl.arange(0, BT)
        none = tl.full([BT], -1, rows.dtype.element_ty)
        tl.store(rows + tok * stride_rows + p, none, mask=(p >= filled) & (p < TOPK))
    else:
        for i in tl.static_range(K):  # top-k by repeated arg-max, largest first (ties: the lower group)
            best = tl.max(score, axis=0)
            idx = tl.min(tl.where(score == best, gi, BGR), axis=0)
            pick = tl.where(best > float("-inf"), idx, -1)
            tl.store(rows + tok * stride_rows + i, pick.to(rows.dtype.element_ty))
            score = tl.where(gi == idx, float("-inf"), score)
        for i in tl.static_range(K, TOPK):
            tl.store(rows + tok * stride_rows + i, tl.full([], -1, rows.dtype.element_ty))


# Groups up to which select_groups ranks every group against every other in one step (a [G, G] compare
# and one reduction: 4096 pairs for the proxy preset's 64 groups) instead of K rounds of arg-max, each
# two reductions across the program's warps (16 rounds: about 7.7 us a launch on the H200, 2026-12-04).
SELECT_RANK_MAX = 128


def select_groups(q: Tensor, positions: Tensor, pooled: Tensor, pool: int, out_rows: Tensor) -> None:
    """selector.select_rows in one launch: each query's own group first, then the top (topk-1) earlier
    groups by Σ_heads q·pooled/√D, -1 where none; writes out_rows [R*Tq, topk] in place."""
    N, HQ, D = q.shape
    R, G, kvh = pooled.shape[:3]
    topk = out_rows.shape[1]
    assert out_rows.stride(1) == 1
    BGR = _next_pow2(G)
    pdl = pdl_enabled(q)
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
        BGR,
        _next_pow2(topk),
        BGR <= SELECT_RANK_MAX,
        pdl,
        num_warps=4,
        **_pdl_launch(pdl),
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
    PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    kh = tl.program_id(1)
    _pdl_enter(PDL, True)
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
    out: Tensor | None = None,
) -> Tensor:
    """Causal attention of q [R*Tq, hq, D] over each request's paged context, restricted to the selected
    groups rows [R*Tq, topk] (-1: none) and to positions < seq_len: one online softmax over every shard's
    keys (equal to attention.folded_attention's per-shard partials merged by log-sum-exp). A query with
    no visible key gets zeros. Returns [R*Tq, hq, D] in q's dtype, written into `out` where given (contiguous,
    of q's shape and dtype)."""
    assert geometry.rank is None and k_cache.is_contiguous() and v_cache.is_contiguous()
    N, HQ, D = q.shape
    R = block_tables.shape[0]
    kvh = k_cache.shape[-2]
    TOPK = rows.shape[1]
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    gq = HQ // kvh
    pdl = pdl_enabled(q)
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
        pdl,
        num_warps=4,
        **_pdl_launch(pdl),
    )
    return out
