"""Folded decode-context-parallel attention equals plain attention; selector rows equal brute force."""

from __future__ import annotations

import pytest
import torch

from qualify.engine.model.attention import DcpGeometry, folded_attention
from qualify.engine.model.selector import pool_keys, rows_to_key_mask, select_rows


def plain_attention(q, qpos, k, v, seq_len, allowed=None):
    """q [Tq, Hq, D]; k, v [Lc, kvh, D] at positions 0..Lc-1; allowed [Tq, Lc] or None."""
    Tq, Hq, D = q.shape
    kvh = k.shape[1]
    kk = k.repeat_interleave(Hq // kvh, dim=1).float()
    vv = v.repeat_interleave(Hq // kvh, dim=1).float()
    s = torch.einsum("thd,lhd->thl", q.float(), kk) * D**-0.5
    pos = torch.arange(k.shape[0])
    mask = (pos[None] <= qpos[:, None]) & (pos[None] < seq_len)
    if allowed is not None:
        mask &= allowed
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(s, -1), vv)


def paged(geom: DcpGeometry, k, v, table, num_blocks):
    """Store contiguous k, v [Lc, kvh, D] into a paged cache and gather it back in shard order."""
    kvh, D = k.shape[1:]
    kcache = torch.zeros(num_blocks * geom.span, kvh, D)
    vcache = torch.zeros_like(kcache)
    col, off = geom.locate(torch.arange(k.shape[0]))
    flat = table[col] * geom.span + off
    kcache[flat], vcache[flat] = k, v
    kpos, kcol, koff = geom.context_tables(torch.device("cpu"))
    g = table[kcol] * geom.span + koff
    return kcache[g][None], vcache[g][None], kpos


@pytest.mark.parametrize("block,dcp,interleave", [(4, 3, 2), (8, 4, 1), (6, 1, 3), (2, 2, 1)])
def test_folded_dcp_attention_equals_plain_attention(block, dcp, interleave):
    torch.manual_seed(block * 10 + dcp)
    geom = DcpGeometry(block, dcp, interleave, max_model_len=40, max_blocks=-(-40 // (block * dcp)))
    Lc, Hq, kvh, D = 37, 4, 2, 8
    k, v = torch.randn(Lc, kvh, D), torch.randn(Lc, kvh, D)
    table = torch.randperm(geom.max_blocks + 2)[: geom.max_blocks] + 1
    kc, vc, kpos = paged(geom, k, v, table, geom.max_blocks + 3)
    # Every shard holds an interleaved share: the shards' positions partition the context exactly.
    held = sorted(int(p) for p in kpos.flatten() if p < Lc)
    assert held == list(range(Lc))
    qpos = torch.tensor([0, 5, 17, 36])
    q = torch.randn(len(qpos), Hq, D)
    out = folded_attention(q[None], qpos[None], kc, vc, kpos, torch.tensor([Lc]), None)[0]
    torch.testing.assert_close(out, plain_attention(q, qpos, k, v, Lc), rtol=1e-5, atol=1e-5)


def test_padding_rows_with_no_visible_key_return_zeros():
    geom = DcpGeometry(4, 2, 1, max_model_len=16, max_blocks=2)
    kpos, _, _ = geom.context_tables(torch.device("cpu"))
    kc = torch.randn(1, *kpos.shape, 1, 4)
    out = folded_attention(torch.randn(1, 1, 2, 4), torch.zeros(1, 1), kc, kc, kpos, torch.tensor([0]), None)
    assert torch.equal(out, torch.zeros_like(out))


def brute_force_selection(q, qpos, k, pool, topk):
    """Per query: its own group plus the top-(topk-1) earlier complete groups by pooled score."""
    Hq, D = q.shape[1:]
    kvh = k.shape[1]
    picks = []
    for t in range(q.shape[0]):
        own = int(qpos[t]) // pool
        scores = []
        for g in range(own):
            pooled = k[g * pool : (g + 1) * pool].float().mean(0)  # [kvh, D]
            sc = sum(float(q[t, h].float() @ pooled[h // (Hq // kvh)]) for h in range(Hq)) * D**-0.5
            scores.append((sc, g))
        best = [g for _, g in sorted(scores, reverse=True)[: topk - 1]]
        picks.append({own, *best})
    return picks


@pytest.mark.parametrize("pool,topk", [(4, 3), (3, 2), (5, 16), (1, 4)])
def test_selector_rows_equal_brute_force_selection(pool, topk):
    torch.manual_seed(pool * 100 + topk)
    geom = DcpGeometry(4, 3, 1, max_model_len=48, max_blocks=4)
    Lc, Hq, kvh, D = 45, 4, 2, 8
    k, v = torch.randn(Lc, kvh, D), torch.randn(Lc, kvh, D)
    kc, vc, kpos = paged(geom, k, v, torch.arange(1, 5), 6)
    qpos = torch.tensor([0, 3, 4, 11, 20, 33, 44])
    q = torch.randn(len(qpos), Hq, D)
    num_groups = -(-48 // pool)
    pooled = pool_keys(kc, kpos, torch.tensor([Lc]), pool, num_groups)
    rows = torch.full((len(qpos), topk), 7, dtype=torch.int32)
    select_rows(q[None], qpos[None], pooled, pool, topk, rows)
    got = [{int(r) for r in row if r >= 0} for row in rows]
    assert got == brute_force_selection(q, qpos, k, pool, topk)
    # Attention through the selected rows equals plain attention restricted to the selected groups.
    mask = rows_to_key_mask(rows, kpos, pool, num_groups, 1, len(qpos))
    out = folded_attention(q[None], qpos[None], kc, vc, kpos, torch.tensor([Lc]), mask)[0]
    allowed = torch.tensor([[(p // pool) in sel for p in range(Lc)] for sel in got])
    torch.testing.assert_close(out, plain_attention(q, qpos, k, v, Lc, allowed), rtol=1e-5, atol=1e-5)


def test_selector_is_dense_while_the_context_is_short():
    geom = DcpGeometry(4, 2, 1, max_model_len=32, max_blocks=4)
    k = torch.randn(10, 1, 4)
    kc, _, kpos = paged(geom, k, k, torch.arange(1, 5), 6)
    pooled = pool_keys(kc, kpos, torch.tensor([10]), 2, 16)
    rows = torch.empty(1, 8, dtype=torch.int32)
    select_rows(torch.randn(1, 1, 2, 4), torch.tensor([[9]]), pooled, 2, 8, rows)
    assert sorted(int(r) for r in rows[0] if r >= 0) == [0, 1, 2, 3, 4]
