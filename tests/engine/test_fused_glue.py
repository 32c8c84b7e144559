"""kernels/fused.py: each decode-step glue kernel equals the model's torch ops (Triton interpreter on CPU),
and a tiny engine decodes the same tokens with and without them (plain and speculative)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import fused as fused_mod
from kernels.fused import (
    attention_decode,
    column_tiles,
    conv_decode,
    conv_decode_reference,
    conv_gates_decode,
    conv_gates_decode_reference,
    linear_add_norm,
    linear_add_norm_reference,
    linear_small,
    norm_head,
    norm_head_reference,
    norm_linear,
    pool_keys_paged,
    rmsnorm,
    rmsnorm_reference,
    rope_write_kv,
    select_groups,
    silu_mul,
    silu_mul_reference,
    swiglu_linear,
    swiglu_linear_reference,
)
from qualify.engine.model.attention import DcpGeometry, folded_attention
from qualify.engine.model.norm import apply_rope, rope_tables
from qualify.engine.model.selector import pool_keys, rows_to_key_mask, select_rows

from .conftest import make_engine, prefill_row
from .fused_numerics import check_linear_add_norm, check_norm_linear, check_swiglu_linear, exact_norm, rms_err

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests; the GPU path is covered by test_gpu_fused.py",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_residual_add_equal_the_models_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 100, generator=gen).to(dtype)
    x = wide[:, 10:58]  # strided rows, as a slice of a wider projection is
    res = torch.randn(5, 48, generator=gen).to(dtype)
    w = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5), **tol)
    s, y = rmsnorm(x, w, 1e-5, res)
    s_ref, y_ref = rmsnorm_reference(x, w, 1e-5, res)
    if dtype == torch.float32:
        assert torch.equal(s, s_ref)
    else:  # the interpreter's fp32 -> bf16 cast may land one bf16 step from torch's round-to-nearest
        torch.testing.assert_close(s, s_ref, atol=0, rtol=2**-7)
    torch.testing.assert_close(y, y_ref, **tol)


def test_rmsnorm_fails_when_the_weight_is_ignored():
    x, w = torch.randn(3, 32), torch.full((32,), 2.0)
    assert not torch.allclose(rmsnorm(x, w, 1e-5), rmsnorm_reference(x, torch.ones(32), 1e-5))


def test_silu_mul_equals_silu_of_gate_times_up():
    gu = torch.randn(3, 2 * 1500)
    torch.testing.assert_close(silu_mul(gu), silu_mul_reference(gu), atol=1e-6, rtol=1e-5)
    # gate and up are not interchangeable: a kernel that swapped them would fail here
    assert not torch.allclose(silu_mul(gu), silu_mul_reference(torch.cat(gu.chunk(2, -1)[::-1], -1)))


@pytest.mark.parametrize("M,N,K", [(1, 48, 256), (3, 40, 100), (20, 32, 512)])
def test_linear_small_equals_the_fp32_product_rounded_once(M, N, K):
    # fp16 here: the interpreter's tl.dot misreads bf16 operands (the same kernel is right in fp16 and
    # fp32); bf16, the engine's dtype, is checked on the GPU (test_gpu_fused.py)
    dtype = torch.float16
    gen = torch.Generator().manual_seed(M * N)
    w = torch.randn(N, K, generator=gen).to(dtype)
    x = torch.randn(M, K + 8, generator=gen).to(dtype)[:, 8:]  # strided rows
    ref = torch.nn.functional.linear(x.float(), w.float())
    got = linear_small(x, w, (16, 64, 4, 2))
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=2**-7)
    assert not torch.allclose(linear_small(x, w[:, torch.randperm(K, generator=gen)]).float(), ref, atol=0.05)


# fp16 for the projections here, as above: the interpreter's tl.dot misreads bf16 operands
_F16 = torch.float16

# (M, N, K, config) of the folded projections here: a 1-row step, a masked last column tile with a K that
# is no multiple of BK and split-K in 3, and 20 rows (the 32-row tile) split in 4
_FOLD_CASES = [
    (1, 48, 256, (16, 64, 4, 2)),
    (3, 40, 100, (16, 32, 4, 2, 3)),
    (20, 72, 512, (32, 64, 4, 2, 4)),
]


def _add_norm_inputs(M, N, K, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 8, generator=gen).to(_F16)[:, 8:]  # strided rows
    w = (torch.randn(N, K, generator=gen) * K**-0.5).to(_F16)
    res = torch.randn(M, N, generator=gen).to(_F16)
    g = (torch.rand(N, generator=gen) + 0.5).to(_F16)
    return x, w, res, g, gen


@pytest.mark.parametrize("M,N,K,config", _FOLD_CASES)
def test_linear_add_norm_writes_the_sum_the_scaled_row_and_each_tiles_sums_of_squares(M, N, K, config):
    x, w, res, g, _ = _add_norm_inputs(M, N, K, M + K)
    s, u, sq = linear_add_norm(x, w, res, g, config)
    check_linear_add_norm(s, u, sq, x, w, res, g, column_tiles(N, K, config))
    s_ref, u_ref, sq_ref = linear_add_norm_reference(x, w, res, g)
    torch.testing.assert_close(s, s_ref, atol=1e-2, rtol=2**-9)
    torch.testing.assert_close(sq.sum(0, keepdim=True), sq_ref, rtol=1e-3, atol=1e-2)
    assert not torch.allclose(s.float(), (s_ref - res).float(), atol=0.5)  # the residual is added
    assert not fused_mod._COUNTERS.get(x.device, torch.zeros(1)).any()  # each split tile reset its count


@pytest.mark.parametrize("M,N,K,config", _FOLD_CASES)
def test_the_sums_of_squares_from_registers_give_the_same_sum_and_row_and_their_own_exact_sums(
    M, N, K, config, monkeypatch
):
    """ADD_SQ_IN_REGS: the residual and the norm weight loaded before the weight loop and each tile's sums
    of squares taken from registers by a fixed tree of pairwise adds, not read back: s and u the same bits
    as the read-back path's, sq each row's squares of s over its tile's columns summed in that tree (its
    first level an fma, one rounding on the GPU; the interpreter's fma rounds the product, as torch here)."""
    x, w, res, g, _ = _add_norm_inputs(M, N, K, 11)
    s0, u0, sq0 = linear_add_norm(x, w, res, g, config)
    monkeypatch.setattr(fused_mod, "ADD_SQ_IN_REGS", True)
    s, u, sq = linear_add_norm(x, w, res, g, config)
    assert torch.equal(s, s0) and torch.equal(u, u0)
    check_linear_add_norm(s, u, sq, x, w, res, g, column_tiles(N, K, config))
    BN = fused_mod.launch_shape(N, K, config, "add_norm")[0]
    sf = torch.zeros(M, sq.shape[0] * BN)
    sf[:, :N] = s.float() ** 2
    v = sf.view(M, sq.shape[0], BN)
    while v.shape[-1] > 1:  # columns 2i and 2i + 1, then pairs of those, ...
        v = v[..., 0::2] + v[..., 1::2]
    assert torch.equal(sq, v[..., 0].T.contiguous())
    torch.testing.assert_close(sq, sq0, rtol=1e-6, atol=1e-6)


def test_a_kind_shape_serves_that_kind_of_launch_alone(monkeypatch):
    """KIND_SHAPES gives one kind of launch of a weight shape its own launch shape: linear_add_norm runs
    (and sizes its sums of squares) at it, a plain projection of the same weight keeps SMALL_SHAPES'."""
    M, N, K = 3, 64, 96
    monkeypatch.setitem(fused_mod.SMALL_SHAPES, (N, K), (16, 32, 4, 2))
    monkeypatch.setitem(fused_mod.KIND_SHAPES, ("add_norm", N, K), (32, 32, 4, 2, 3))
    assert column_tiles(N, K) == 4 and column_tiles(N, K, kind="add_norm") == 2
    assert fused_mod.launch_shape(N, K, kind="norm") == (16, 32, 4, 2, 1)  # no entry of its own
    assert fused_mod.launch_shape(N, K, (8, 32, 4, 2), "add_norm") == (8, 32, 4, 2, 1)  # a config wins
    x, w, res, g, gen = _add_norm_inputs(M, N, K, 5)
    s, u, sq = linear_add_norm(x, w, res, g)
    assert sq.shape == (2, M)  # 32-column tiles, K split in 3
    check_linear_add_norm(s, u, sq, x, w, res, g, 2)
    s16, u16, sq16 = linear_add_norm(x, w, res, g, (16, 32, 4, 2))  # the plain projection's shape
    assert torch.equal(s, s16) and torch.equal(u, u16) and sq16.shape == (4, M)
    w2 = torch.randn(56, N, generator=gen).to(_F16)
    check_norm_linear(norm_linear(u, sq, 1e-5, w2), s, u, sq, g, w2, 1e-5, ratio=1.5, floor=0.01)
    want = F.linear(x.float(), w.float()).to(_F16)
    torch.testing.assert_close(linear_small(x, w), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("M,N,K,config", _FOLD_CASES)
def test_norm_linear_equals_the_norm_then_the_projection(M, N, K, config):
    x, w, res, g, gen = _add_norm_inputs(M, N, K, M + N)
    s, u, sq = linear_add_norm(x, w, res, g)
    w2 = torch.randn(56, N, generator=gen).to(_F16)  # 56 = 1.75 tiles of 32 columns
    y = norm_linear(u, sq, 1e-5, w2, config)
    assert y.dtype == _F16 and y.shape == (M, 56)
    check_norm_linear(y, s, u, sq, g, w2, 1e-5, ratio=1.5, floor=0.01)
    # what a wrong epilogue would give is far from it: the 1/rms ignored, or taken from the wrong rows
    assert not torch.allclose(y.float(), F.linear(u.float(), w2.float()), atol=0.5)
    if M > 1:
        wrong = norm_linear(u, sq.flip(1), 1e-5, w2, config)
        assert not torch.allclose(wrong.float(), y.float(), atol=0.5)


@pytest.mark.parametrize(
    "M,N,K,config",
    [(1, 48, 256, (16, 64, 4, 2)), (3, 80, 100, (8, 32, 4, 2, 3)), (17, 40, 96, (32, 64, 4, 2, 2))],
)
def test_swiglu_linear_equals_gate_up_then_silu_mul(M, N, K, config):
    # N = 2I: I = 24, 40, 20 outputs, tiles of 8, 4 and 16 (the last one partly masked)
    gen = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=gen).to(_F16)
    w = (torch.randn(N, K, generator=gen) * K**-0.5 * 2).to(_F16)
    a = swiglu_linear(x, w, None, 0.0, config)
    assert a.shape == (M, N // 2) and a.dtype == _F16
    check_swiglu_linear(a, x, w)
    torch.testing.assert_close(a, swiglu_linear_reference(x, w), atol=2e-2, rtol=2**-8)
    swapped = torch.cat(w.chunk(2, 0)[::-1], 0)  # gate and up are not interchangeable
    assert not torch.allclose(a.float(), swiglu_linear_reference(x, swapped).float(), atol=0.1)
    # after a linear_add_norm (hidden size K): the norm's 1/rms on both halves first
    res, g = torch.randn(M, K, generator=gen).to(_F16), (torch.rand(K, generator=gen) + 0.5).to(_F16)
    wp = (torch.randn(K, 64, generator=gen) * 0.125).to(_F16)
    s, u, sq = linear_add_norm(torch.randn(M, 64, generator=gen).to(_F16), wp, res, g)
    a = swiglu_linear(u, w, sq, 1e-5, config)
    check_swiglu_linear(a, u, w, sq, 1e-5)
    torch.testing.assert_close(
        a, swiglu_linear_reference(rmsnorm_reference(s, g, 1e-5), w), atol=2e-2, rtol=2**-7
    )


@pytest.mark.parametrize("K,split", [(256, 2), (256, 4), (100, 3), (512, 5)])
def test_split_k_sums_its_partials_in_order_and_leaves_the_counters_zero(K, split):
    gen = torch.Generator().manual_seed(K + split)
    M, N = 5, 72  # 72 = 4.5 tiles of 16 columns: a masked last tile
    w = torch.randn(N, K, generator=gen).to(_F16)
    x = torch.randn(M, K, generator=gen).to(_F16)
    ref = F.linear(x.float(), w.float())
    got = linear_small(x, w, (16, 32, 4, 2, split))
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=2**-7)
    assert torch.equal(linear_small(x, w, (16, 32, 4, 2, split)), got)  # the same bytes every time
    assert not fused_mod._COUNTERS[x.device].any()  # each tile's last program reset its count
    res = torch.randn(M, N, generator=gen).to(_F16)
    g = (torch.rand(N, generator=gen) + 0.5).to(_F16)
    s, u, sq = linear_add_norm(x, w, res, g, (16, 32, 4, 2, split))  # the epilogue after the sum
    s1, u1, sq1 = linear_add_norm(x, w, res, g, (16, 32, 4, 2))
    torch.testing.assert_close(s, s1, atol=1e-2, rtol=2**-9)
    torch.testing.assert_close(sq, sq1, atol=1e-2, rtol=1e-3)
    assert not fused_mod._COUNTERS[x.device].any()


def _programs_reversed(monkeypatch) -> list[tuple[int, int, int]]:
    """The interpreter runs a launch's programs one after another, first to last, where a GPU runs them
    concurrently in any order: run them last to first instead (the i-th to run is handed program id
    n-1-i). Returns the ids handed out, in the order they ran."""
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    forward = type(b).set_grid_idx
    ran: list[tuple[int, int, int]] = []

    def reversed_idx(x, y, z):
        ran.append(tuple(d - 1 - i for d, i in zip(b.grid_dim, (x, y, z), strict=True)))
        forward(b, *ran[-1])

    monkeypatch.setattr(b, "set_grid_idx", reversed_idx)
    return ran


def test_the_folded_projections_do_not_depend_on_the_order_their_programs_run_in(monkeypatch):
    """Each output of a folded projection is written by the one program that owns its column tile, and no
    program reads what another of its launch writes but split-K's partials, summed in split order by
    whichever program arrives last: the same bytes with the programs run last to first."""
    x, w, res, g, gen = _add_norm_inputs(5, 72, 100, 7)
    wg = (torch.randn(80, 72, generator=gen) * 0.2).to(_F16)
    hidden, logits = torch.empty(5, 72, dtype=_F16), torch.empty(5, 40)
    wh = torch.randn(40, 72, generator=gen).to(_F16)

    def launches():
        outs = []
        for cfg in ((16, 32, 4, 2), (16, 32, 4, 2, 3)):
            s, u, sq = linear_add_norm(x, w, res, g, cfg)
            outs += [s, u, sq, norm_linear(u, sq, 1e-5, wg[:48], cfg), swiglu_linear(u, wg, sq, 1e-5, cfg)]
            norm_head(s, u, g, 1e-5, wh, hidden, logits, (16, 32, 4, 2, 2))
            outs += [hidden.clone(), logits.clone()]
        return outs

    first_to_last = launches()
    ran = _programs_reversed(monkeypatch)
    last_to_first = launches()
    assert ran[0][0] > ran[1][0] > ran[2][0]  # the programs did run in reverse
    for a, b in zip(first_to_last, last_to_first, strict=True):
        assert torch.equal(a, b)


def _tiled_linear(a: torch.Tensor, w: torch.Tensor, bk: int = 128) -> torch.Tensor:
    """a @ w.T in fp32 summed tile by tile over K, as the kernels' loop sums it (torch orders its sums
    otherwise: a rounded result may land a step apart, as on the GPU)."""
    acc = torch.zeros(a.shape[0], w.shape[0])
    for k in range(0, a.shape[1], bk):
        acc += F.linear(a[:, k : k + bk].float(), w[:, k : k + bk].float())
    return acc


def test_the_gpu_bounds_hold_for_the_kernels_rounding_at_the_proxy_shapes():
    """The bounds test_gpu_fused.py holds the folded projections to, met by a torch emulation of the
    kernels' rounding (and of their order of sums) at the GPU tests' shapes, scales and dtype (bf16,
    K = 4096): a bound no correct kernel meets fails here. The one the branch's first GPU run held the
    fold to, a bf16 step of the exact value, fails here for the fold and for the two-launch path alike
    (tests/engine/fused_numerics.py says why)."""
    bf, eps = torch.bfloat16, 1e-5
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(bf)

    def add_norm(M, K=4096):  # linear_add_norm at the o_proj / down shape, 32-column tiles
        x, w, res = rnd(M, K), rnd(4096, K, scale=K**-0.5), rnd(M, 4096)
        nw = (torch.rand(4096, generator=gen) + 0.5).to(bf)
        s = (_tiled_linear(x, w, 256).to(bf).float() + res.float()).to(bf)
        u = (s.float() * nw.float()).to(bf)
        sq = torch.stack([c.float().pow(2).sum(-1) for c in s.split(32, dim=-1)])
        check_linear_add_norm(s, u, sq, x, w, res, nw, 128)
        return s, u, sq, nw

    for K, M in ((4096, 1), (8192, 32)):
        add_norm(M, K)
    for N, M in ((12576, 1), (5120, 5), (12576, 32)):
        s, u, sq, nw = add_norm(M)
        w = rnd(N, 4096)
        y = (_tiled_linear(u, w) * torch.rsqrt(sq.sum(0) / 4096 + eps)[:, None]).to(bf)
        check_norm_linear(y, s, u, sq, nw, w, eps)
        exact = F.linear(exact_norm(s, nw, eps), w.float())
        two = F.linear(exact_norm(s, nw, eps).to(bf).float(), w.float()).to(bf)
        for got in (y, two):
            assert not torch.allclose(got.float(), exact, atol=0.05, rtol=2**-7), N
        assert 0.1 < rms_err(y, exact) < 0.25 and 0.1 < rms_err(two, exact) < 0.25
    w = rnd(16384, 4096, scale=0.02)  # MLP gate_up, as test_swiglu_linear_at_proxy_shapes draws it
    for M in (1, 32):
        x = rnd(M, 4096)
        check_swiglu_linear(silu_mul_reference(_tiled_linear(x, w).to(bf)), x, w)
        s, u, sq, nw = add_norm(M)
        gu = (_tiled_linear(u, w) * torch.rsqrt(sq.sum(0) / 4096 + eps)[:, None]).to(bf)
        check_swiglu_linear(silu_mul_reference(gu), u, w, sq, eps)


@pytest.mark.parametrize("dtype,M,K", [(torch.float32, 1, 256), (torch.float32, 20, 2048), (_F16, 3, 1536)])
def test_norm_head_equals_the_add_the_norm_and_the_fp32_head(dtype, M, K):
    # K 2048 and 1536: the first pass over the row in more than one chunk (1024 columns at a 16-row tile,
    # 512 at 32), the last one partly past K
    gen = torch.Generator().manual_seed(M)
    V = 40
    x, r = (torch.randn(M, K, generator=gen).to(dtype) for _ in range(2))
    g = (torch.rand(K, generator=gen) + 0.5).to(dtype)
    w = torch.randn(V, K, generator=gen).to(dtype)
    outs = []
    for fn in (norm_head, norm_head_reference):
        hidden, logits = torch.full((M, K), 7.0, dtype=dtype), torch.full((M, V), 7.0)
        fn(x, r, g, 1e-5, w, hidden, logits)
        outs.append((hidden, logits))
    (h, lg), (h_ref, lg_ref) = outs
    assert torch.equal(h, h_ref)
    # fp32: the same normed row, so the same logits up to the order of the sums; fp16: a normed entry may
    # round one step apart where the two 1/rms differ in their last bit (the sums are ordered differently)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-4)
    torch.testing.assert_close(lg, lg_ref, **tol)
    hidden, wrong = torch.empty(M, K, dtype=dtype), torch.empty(M, V)
    norm_head(x, r, torch.ones_like(g), 1e-5, w, hidden, wrong)  # the norm's weight matters
    assert not torch.allclose(wrong, lg_ref, atol=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, _F16])
@pytest.mark.parametrize("T", [1, 3])
def test_conv_gates_decode_equals_the_conv_and_the_two_gate_projections(T, dtype):
    gen = torch.Generator().manual_seed(T)
    n, C, H, W, slots_total, GK, HK = 3, 40, 5, 4, 12, 16, 80  # 80 = 1.25 blocks of 64 gate columns
    x = torch.randn(n * T, C + H + 2 * GK, generator=gen).to(dtype)
    weight = torch.randn(C, W, generator=gen).to(dtype)
    state = torch.randn(slots_total, C, W - 1, generator=gen).to(dtype)
    state[0].zero_()
    slots = torch.tensor([[2, 3, 4], [5, 6, 7], [0, 0, 0]], dtype=torch.int32)[:, :T].contiguous()
    num_accepted = torch.tensor([1, T, 1], dtype=torch.int32)
    f_b, g_b = (torch.randn(HK, GK, generator=gen).to(dtype) for _ in range(2))
    outs = []
    for fn in (conv_gates_decode, conv_gates_decode_reference):
        st = state.clone()
        out, b = torch.empty(n * T, C, dtype=dtype), torch.empty(n * T, H, dtype=dtype)
        a, z = torch.full((n * T, HK), 7.0, dtype=dtype), torch.full((n * T, HK), 7.0, dtype=dtype)
        fn(x, st, weight, slots, num_accepted, out, b, T, f_b, g_b, a, z)
        outs.append((out, b, st, a, z))
    (o, b, st, a, z), (o_ref, b_ref, st_ref, a_ref, z_ref) = outs
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2**-9)
    torch.testing.assert_close(o, o_ref, **tol)
    assert torch.equal(b, b_ref) and torch.equal(st, st_ref)
    torch.testing.assert_close(a, a_ref, **tol)
    torch.testing.assert_close(z, z_ref, **tol)
    assert not torch.allclose(a.float(), z_ref.float(), atol=0.5)  # f and g are not interchangeable


@pytest.mark.parametrize("T", [1, 3])
def test_conv_decode_equals_the_eager_conv_and_state_update(T):
    gen = torch.Generator().manual_seed(T)
    n, C, H, W, slots_total = 3, 40, 5, 4, 12
    x = torch.randn(n * T, C + H + 7, generator=gen)  # conv channels, b, then columns it must not read
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(slots_total, C, W - 1, generator=gen)
    state[0].zero_()  # the null slot
    slots = torch.tensor([[2, 3, 4], [5, 6, 7], [0, 0, 0]], dtype=torch.int32)[:, :T].contiguous()
    num_accepted = torch.tensor([1, T, 1], dtype=torch.int32)  # request 2 is padding (null slot)
    outs = []
    for fn in (conv_decode, conv_decode_reference):
        st = state.clone()
        out, b = torch.empty(n * T, C), torch.empty(n * T, H)
        fn(x, st, weight, slots, num_accepted, out, b, T)
        outs.append((out, b, st))
    (o, b, st), (o_ref, b_ref, st_ref) = outs
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(b, b_ref)
    torch.testing.assert_close(st, st_ref, atol=0, rtol=0)
    assert not torch.equal(st, state)  # the state did move


def _geometry_and_cache(seed=0, block=4, dcp=2, interleave=1, max_len=48, kvh=2, D=16, num_blocks=9):
    gen = torch.Generator().manual_seed(seed)
    geo = DcpGeometry(block, dcp, interleave, max_model_len=max_len, max_blocks=-(-max_len // (block * dcp)))
    kc = torch.randn(num_blocks, dcp, block, kvh, D, generator=gen)
    vc = torch.randn(num_blocks, dcp, block, kvh, D, generator=gen)
    return geo, kc, vc, gen


def test_rope_write_kv_rotates_and_stores_at_the_paged_slot():
    geo, kc, vc, gen = _geometry_and_cache()
    hq, kvh, D = 4, 2, 16
    n, T = 2, 2
    qkv = torch.randn(n * T, (hq + 2 * kvh) * D, generator=gen)
    positions = torch.tensor([5, 6, 17, 18], dtype=torch.int32)
    tables = torch.tensor([[3, 1, 4, 2, 8, 5], [7, 6, 2, 1, 4, 3]], dtype=torch.int32)
    cos, sin = rope_tables(geo.max_model_len, D, torch.device("cpu"))
    k_got, v_got = kc.clone(), vc.clone()
    q = rope_write_kv(qkv, positions, cos, sin, tables, T, k_got, v_got, geo, hq)
    qr, kr, vr = qkv.split([hq * D, kvh * D, kvh * D], dim=-1)
    torch.testing.assert_close(q, apply_rope(qr.view(-1, hq, D), positions, cos, sin), atol=1e-6, rtol=1e-6)
    col, off = geo.locate(positions)
    blk = tables.long().repeat_interleave(T, 0).gather(1, col[:, None]).squeeze(1)
    flat = blk * geo.block_storage + off
    k_ref, v_ref = kc.clone(), vc.clone()
    k_ref.view(-1, kvh, D)[flat] = apply_rope(kr.reshape(-1, kvh, D), positions, cos, sin)
    v_ref.view(-1, kvh, D)[flat] = vr.reshape(-1, kvh, D)
    torch.testing.assert_close(k_got, k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_got, v_ref)


@pytest.mark.parametrize("rank", [True, False])
@pytest.mark.parametrize("block,dcp,interleave", [(4, 2, 1), (6, 3, 2), (8, 1, 1)])
def test_pooling_and_attention_equal_the_gathered_torch_path(block, dcp, interleave, rank, monkeypatch):
    # the top-k by rank (the groups of every preset) and by repeated arg-max (more groups than
    # SELECT_RANK_MAX) select the same rows
    monkeypatch.setattr(fused_mod, "SELECT_RANK_MAX", 1 << 20 if rank else 0)
    geo, kc, vc, gen = _geometry_and_cache(seed=block, block=block, dcp=dcp, interleave=interleave)
    hq, kvh, D, pool, topk = 4, 2, 16, 5, 3
    G = -(-geo.max_model_len // pool)
    R, Tq = 3, 2
    nb = kc.shape[0]
    tables = torch.stack([torch.randperm(nb - 1, generator=gen)[: geo.max_blocks] + 1 for _ in range(R)])
    tables = tables.to(torch.int32)
    seq_lens = torch.tensor([33, 47, 0], dtype=torch.int32)  # the last request is padding
    positions = torch.tensor([31, 32, 45, 46, 0, 0], dtype=torch.int32)
    q = torch.randn(R * Tq, hq, D, generator=gen)
    # torch path (AttentionLayer._gather / _attend)
    kpos, kcol, koff = geo.context_tables(torch.device("cpu"))
    flat = tables.long()[:, kcol] * geo.block_storage + koff[None]
    kg, vg = kc.view(-1, kvh, D)[flat], vc.view(-1, kvh, D)[flat]
    pooled_ref = pool_keys(kg, kpos, seq_lens, pool, G)
    pooled = pool_keys_paged(kc, tables, seq_lens, geo, pool, G)
    torch.testing.assert_close(pooled, pooled_ref, atol=1e-5, rtol=1e-5)
    rows = torch.full((R * Tq, topk), -1, dtype=torch.int32)
    select_rows(q.view(R, Tq, hq, D), positions.view(R, Tq), pooled_ref, pool, topk, rows)
    for k in (topk, G + 2):  # G + 2: more rows than groups, the rest -1
        want = torch.full((R * Tq, k), 7, dtype=torch.int32)
        got_rows = torch.full((R * Tq, k), 7, dtype=torch.int32)
        select_rows(q.view(R, Tq, hq, D), positions.view(R, Tq), pooled_ref, pool, k, want)
        select_groups(q, positions, pooled_ref, pool, got_rows)
        assert torch.equal(got_rows, want)
    assert (rows[:, 1:] >= 0).any() and (rows == -1).any()  # choices were made and some rows are empty
    mask = rows_to_key_mask(rows, kpos, pool, G, R, Tq)
    ref = folded_attention(q.view(R, Tq, hq, D), positions.view(R, Tq), kg, vg, kpos, seq_lens, mask)
    got = attention_decode(q, positions, kc, vc, tables, seq_lens, rows, geo, pool, G)
    torch.testing.assert_close(got.view(R, Tq, hq, D), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[4:], torch.zeros_like(got[4:]))  # padding rows: zeros
    # the selection is honoured: dropping a selected group changes the output of a query that had it
    rows2 = rows.clone()
    rows2[1, 1:] = -1
    got2 = attention_decode(q, positions, kc, vc, tables, seq_lens, rows2, geo, pool, G)
    assert not torch.allclose(got2[1], got[1])


@pytest.mark.parametrize("num_spec", [0, 2])
def test_a_tiny_engine_decodes_the_same_tokens_with_the_fused_glue(num_spec):
    prompts = [[256, *b"fused glue, one launch"], [256, *b"where eager torch launches many"]]
    results = []
    for fused in (False, True):
        e = make_engine(num_spec=num_spec, kda_decode_backend="torch")
        try:
            e.model.set_fused(fused)
            assert e.describe()["backend"]["glue"] == ("triton fused" if fused else "torch")
            gens, _ = e.generate(prompts, 12, "eager")
            results.append([(g.token_ids, g.top2_gaps) for g in gens])
        finally:
            e.close()
    for (toks, gaps), (toks_f, gaps_f) in zip(*results, strict=True):
        assert toks_f == toks
        torch.testing.assert_close(torch.tensor(gaps_f), torch.tensor(gaps), atol=1e-3, rtol=1e-3)


def test_the_glue_label_names_what_runs(tiny_engine):
    m = tiny_engine.model
    assert m.glue == "torch"  # a CPU engine keeps the reference ops
    geo = tiny_engine.attn_rt.geometry
    try:
        m.set_fused(True)
        assert m.glue == "triton fused"
        geo.rank = 1  # as on a rank of a distributed DCP engine: attention decode stays in torch
        assert m.glue == "triton fused (attention decode in torch: distributed DCP)"
    finally:
        geo.rank = None
        m.set_fused(False)


# The tiny preset's projections given launch shapes as the proxy's are in kernels.fused.SMALL_SHAPES:
# every one but attention qkv [64, 64], which stays a torch projection (as the proxy's qkv stays cuBLAS), so
# both a folded norm and a norm kernel before its projection run.
_TINY_SHAPES = {
    (130, 64): (16, 32, 4, 1),  # KDA in_proj
    (64, 32): (16, 32, 4, 1, 2),  # KDA out_proj, attention o_proj (split in 2)
    (256, 64): (32, 64, 4, 1),  # MLP gate_up
    (64, 128): (16, 32, 4, 1, 2),  # MLP down
}


def _decode_step(e, prompt, calls: dict):
    """Prefill one prompt, then one decode step: its logits; `calls` counts the step's calls alone."""
    r = e.runner
    req = r.admit(prompt, 8)
    try:
        toks, gaps = r.pick(r.prefill([req]))
        r._append(req, toks[0], gaps[0])
        r.stage_decode([req], 1)
        calls.clear()
        return r.forward_decode_static(1).clone()
    finally:
        r.release(req)


def test_a_fused_decode_step_folds_each_norm_the_activation_and_the_head_into_one_launch(monkeypatch):
    import qualify.engine.model as model_mod
    import qualify.engine.model.kda_layer as kda_mod
    import qualify.engine.model.norm as norm_mod

    for shape, config in _TINY_SHAPES.items():
        monkeypatch.setitem(fused_mod.SMALL_SHAPES, shape, config)
    calls: dict[str, int] = {}

    def counted(mod, name):
        fn = getattr(mod, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)

        monkeypatch.setattr(mod, name, wrapper)

    for name in ("rmsnorm", "linear_small", "linear_add_norm", "norm_linear", "swiglu_linear", "silu_mul"):
        counted(norm_mod, name)
    counted(model_mod, "norm_head")
    counted(kda_mod, "conv_gates_decode")
    prompt = [256, *b"one launch"]
    e = make_engine(dtype="float16", kda_decode_backend="torch")  # 16-bit: linear_small's dtypes
    try:
        ref = _decode_step(e, prompt, calls)
        assert not calls  # the torch glue
        ref_tokens = e.generate([prompt], 3, "eager")[0][0].token_ids
        e.model.set_fused(True)
        got = _decode_step(e, prompt, calls)
        step = dict(calls)
        tokens = e.generate([prompt], 3, "eager")[0][0].token_ids
    finally:
        e.close()
    # KKKAKKKA: every projection that produces a residual branch (out_proj / o_proj, MLP down) does the
    # add and the next norm but its 1/rms in its launch, and the projection that reads the norm (KDA
    # in_proj, MLP gate_up) applies the 1/rms; gate_up computes the SwiGLU activation. Norm kernels: the
    # first block's input norm (no projection before it) and the attention blocks' input norms (qkv is no
    # linear_small shape here). Plain projections: the first in_proj and the last down, whose add and norm
    # the head's launch does. The conv and both gates in one launch per KDA block.
    assert step == {
        "linear_add_norm": 8 + 7,
        "norm_linear": 5,
        "swiglu_linear": 8,
        "rmsnorm": 1 + 2,
        "linear_small": 2,
        "conv_gates_decode": 6,
        "norm_head": 1,
    }, step
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)
    assert tokens == ref_tokens


def test_linear_rows_equals_the_fp32_product_and_a_rows_bits_never_follow_its_batch():
    # fp16 and fp32 here: the interpreter's tl.dot misreads bf16 operands (bf16 on the GPU: test_gpu_fused.py)
    from kernels.fused import ROWS_BM, linear_rows

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.float32):
        w = torch.randn(150, 100, generator=gen).to(dtype)  # N, K no multiple of the tiles
        x = torch.randn(ROWS_BM + 9, 108, generator=gen).to(dtype)[:, 8:]  # strided rows, two row tiles
        got = linear_rows(x, w)
        assert got.dtype == dtype and got.shape == (ROWS_BM + 9, 150)
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=2**-7)
        for lo, hi in ((0, 1), (5, 9), (ROWS_BM - 2, ROWS_BM + 3), (ROWS_BM, ROWS_BM + 9)):
            assert torch.equal(linear_rows(x[lo:hi], w), got[lo:hi])  # alone, or elsewhere in a tile
        assert linear_rows(x[:0], w).shape == (0, 150)
        assert not torch.allclose(linear_rows(x, w[:, torch.randperm(100, generator=gen)]), got)


def test_a_fused_engine_prefills_a_batch_in_one_row_invariant_forward(monkeypatch):
    """A fused engine's prefill: one forward for the whole batch, every projection through linear_rows, and
    each prompt's logits and last hidden state bit-identical alone and anywhere among fillers; the same
    batch in one plain forward (cuBLAS's products, one head over every row) moves them."""
    import kernels.fused
    from qualify.engine.model import norm as norm_mod
    from qualify.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    e = make_engine(kda_decode_backend="torch")
    try:
        e.model.set_fused(True)
        r = e.runner
        forwards, rows_calls = [], []
        real_forward, real_rows = e.model.forward_hidden, kernels.fused.linear_rows
        monkeypatch.setattr(
            e.model, "forward_hidden", lambda *a, **k: forwards.append(1) or real_forward(*a, **k)
        )
        monkeypatch.setattr(norm_mod, "linear_rows", lambda *a: rows_calls.append(1) or real_rows(*a))

        prompt = tok.encode("one prompt among fillers")
        fillers = [tok.encode(t) for t in ("a filler of another length", "f", "more filler text, longer")]
        alone, h_alone = prefill_row(r, [prompt], 0)
        moved = 0.0
        for at in (0, 2, 3):
            batch = [*fillers[:at], prompt, *fillers[at:]]
            forwards.clear()
            got, h_got = prefill_row(r, batch, at)
            assert len(forwards) == 1 and rows_calls  # one forward, its products row-invariant
            assert torch.equal(got, alone) and torch.equal(h_got, h_alone)
            plain, _ = prefill_row(r, batch, at, one_forward=True)
            moved = max(moved, float((plain - alone).abs().max()))
        assert moved > 0.0  # what the row-invariant forward removes, seen here so the equality can fail
        assert not norm_mod.ROWS.on  # off again outside the prefill
    finally:
        e.close()


def test_fused_prefill_attention_equals_the_torch_loop_and_never_follows_its_batch(monkeypatch):
    """A fused engine's prefill attention: every prompt token through the decode kernels as its own row
    (pooled keys, selection, attention at its position) selects the groups the torch path's per-prompt loop
    selects and gives its output; a prompt's logits are bit-identical alone and among fillers however the
    rows are split into launches."""
    from qualify.engine.model import attention as attn_mod
    from qualify.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    # pool 4, top 2: prompts past 8 tokens select among earlier groups (the default pool of 64 never would)
    e = make_engine(kda_decode_backend="torch", selector_pool=4, selector_topk=2, max_model_len=64)
    real = attn_mod.AttentionLayer.forward_prefill
    seen = []

    def both(self, x, ctx):
        got = real(self, x, ctx)
        rows_got = ctx.selector_rows.clone()
        self.fused = False
        try:
            ref = real(self, x, ctx)
        finally:
            self.fused = True
        seen.append((got, ref, rows_got, ctx.selector_rows.clone()))
        return got

    launches = []
    real_attend = attn_mod.attention_decode

    def attend(*a, **k):
        launches.append(1)
        return real_attend(*a, **k)

    monkeypatch.setattr(attn_mod, "attention_decode", attend)
    try:
        e.model.set_fused(True)
        r = e.runner
        prompt = tok.encode("a prompt whose later tokens choose among groups")
        fillers = [tok.encode(t) for t in ("another prompt, of another length", "f")]
        monkeypatch.setattr(attn_mod.AttentionLayer, "forward_prefill", both)
        prefill_row(r, [*fillers, prompt], 2)
        assert len(seen) == 2 and len(launches) == 2  # both attention layers of KKKAKKKA, one launch each
        for got, ref, rows_got, rows_ref in seen:
            assert torch.equal(rows_got, rows_ref)
            assert (rows_got[:, 1] >= 0).any() and (rows_got[:, 1] == -1).any()  # choices were made
            torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
        monkeypatch.setattr(attn_mod.AttentionLayer, "forward_prefill", real)
        alone, h_alone = prefill_row(r, [prompt], 0)
        monkeypatch.setattr(attn_mod, "PREFILL_FUSED_ROWS", 7)  # prompts split across launches
        for at in (0, 2):
            got, h_got = prefill_row(r, [*fillers[:at], prompt, *fillers[at:]], at)
            assert torch.equal(got, alone) and torch.equal(h_got, h_alone)
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_equals_the_torch_loop_and_never_follows_its_batch(dtype):
    """kernels.fused.conv_prefill: each prompt's SiLU(conv) from a zero history and its conv state after
    its last token equal KdaLayer._conv_prefill's per-prompt loop (prompts shorter than the window
    included), and a prompt's values are the same alone and among others."""
    from kernels.fused import conv_prefill
    from qualify.engine.model.kda_layer import KdaLayer

    gen = torch.Generator().manual_seed(5)
    C, W, slots = 200, 4, 9  # C past one 128-channel block
    lens = [1, 7, 2, 3, 12]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    wide = torch.randn(total, C + 30, generator=gen).to(dtype)
    x = wide[:, 5 : 5 + C]  # a slice of the in-projection's row, as in the layer
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens])
    slot_ids = torch.tensor([3, 1, 8, 2, 6], dtype=torch.int32)
    weight = torch.randn(C, W, generator=gen)

    ref_state = torch.randn(slots, C, W - 1, generator=gen).to(dtype)
    got_state = ref_state.clone()
    layer = KdaLayer.__new__(KdaLayer)  # only _conv_prefill's attributes
    nn_module_init = torch.nn.Module.__init__
    nn_module_init(layer)
    layer.W, layer.conv_dim, layer.conv_state = W, C, ref_state
    layer.conv_weight = weight
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    ref = layer._conv_prefill(x, bounds, slot_ids.tolist()).to(dtype)
    got = conv_prefill(x, positions, cu, slot_ids, weight, got_state, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, ref, **tol)
    assert torch.equal(got_state, ref_state)  # inputs copied, zeros before a prompt's start
    untouched = [s for s in range(slots) if s not in slot_ids.tolist()]
    assert torch.equal(got_state[untouched], ref_state[untouched])
    # the last prompt alone: the same values and state
    alone_state = torch.zeros_like(got_state)
    lo = int(cu[-2])
    alone = conv_prefill(
        x[lo:], positions[lo:], torch.tensor([0, total - lo], dtype=torch.int32), slot_ids[-1:], weight,
        alone_state, dtype,
    )  # fmt: skip
    assert torch.equal(alone, got[lo:]) and torch.equal(alone_state[6], got_state[6])
