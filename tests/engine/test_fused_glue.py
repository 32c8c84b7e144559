"""kernels/fused.py: each decode-step glue kernel equals the model's torch ops (Triton interpreter on CPU),
and a tiny engine decodes the same tokens with and without them (plain and speculative)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.fused import (
    attention_decode,
    conv_decode,
    conv_decode_reference,
    linear_small,
    pool_keys_paged,
    rmsnorm,
    rmsnorm_reference,
    rope_write_kv,
    select_groups,
    silu_mul,
    silu_mul_reference,
)
from qualify.engine.model.attention import DcpGeometry, folded_attention
from qualify.engine.model.norm import apply_rope, rope_tables
from qualify.engine.model.selector import pool_keys, rows_to_key_mask, select_rows

from .conftest import make_engine

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


@pytest.mark.parametrize("block,dcp,interleave", [(4, 2, 1), (6, 3, 2), (8, 1, 1)])
def test_pooling_and_attention_equal_the_gathered_torch_path(block, dcp, interleave):
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
