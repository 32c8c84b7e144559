"""GQA attention over the paged KV cache with decode-context-parallel sharding: each of `dcp` shards holds
an interleaved share of the tokens, attends on its own (out, lse), and the partials are merged by
log-sum-exp. Folded (one process holds every shard) or distributed (one rank per shard: each rank computes
its partial and the ranks all-gather (out, lse) before the same merge; see qualify/engine/dcp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels.fused import attention_decode, pool_keys_paged, rope_write_kv, select_groups

from ..layout import group_span
from .norm import Linear, Prenormed, apply_rope
from .selector import pool_keys, rows_to_key_mask, select_rows

# Token rows per launch of the fused prefill attention (AttentionLayer._prefill_fused).
PREFILL_FUSED_ROWS = 256


@dataclass
class DcpGeometry:
    """Where a token lives: block column, shard, and slot within the shard's part of the block.

    A block covers span = block_size * dcp positions; positions are dealt to shards `interleave` at a time.
    The context tables list, per shard, every local slot a request may hold, in local order.
    """

    block_size: int
    dcp: int
    interleave: int
    max_model_len: int
    max_blocks: int
    # The shard this process holds when DCP is distributed (one rank per shard); None: every shard (folded).
    rank: int | None = None

    @property
    def span(self) -> int:
        return group_span("attention", self.block_size, self.dcp)

    @property
    def local_shards(self) -> int:
        """Shards whose tokens this process stores: all of them folded, one per rank distributed."""
        return self.dcp if self.rank is None else 1

    @property
    def block_storage(self) -> int:
        """Token slots one block has in this process's storage."""
        return self.local_shards * self.block_size

    def locate(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(block column, offset within this process's block storage) of each position. Distributed, a
        position held by another rank gets offset -1: its K/V is not stored here."""
        p = positions.long()
        col, o = p // self.span, p % self.span
        i, s = self.interleave, self.dcp
        shard = (o // i) % s
        local = (o // (i * s)) * i + o % i
        if self.rank is None:
            return col, shard * self.block_size + local
        return col, torch.where(shard == self.rank, local, torch.full_like(local, -1))

    def context_tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """kpos, kcol, koff [local shards, L]: global position, block column, in-block offset of local slot
        j of each shard this process holds."""
        bs, s, i = self.block_size, self.dcp, self.interleave
        j = torch.arange(self.max_blocks * bs, device=device)
        col, l = j // bs, j % bs
        shard = torch.arange(s, device=device)[:, None]
        pos = col[None] * self.span + (l[None] // i) * (i * s) + shard * i + l[None] % i
        L = int((pos < self.max_model_len).sum(1).max())
        pos = pos[:, :L]
        kcol = col[None, :L].expand(s, L)
        koff = shard * bs + l[None, :L]
        if self.rank is not None:  # this rank's shard only, stored from offset 0 of each block
            r = self.rank
            return (
                pos[r : r + 1].contiguous(),
                kcol[r : r + 1].contiguous(),
                (koff[r : r + 1] - r * bs).contiguous(),
            )
        return pos.contiguous(), kcol.contiguous(), koff.contiguous()


def folded_attention(
    q: Tensor,
    qpos: Tensor,
    kc: Tensor,
    vc: Tensor,
    kpos: Tensor,
    seq_lens: Tensor,
    key_mask: Tensor | None,
    gather: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> Tensor:
    """q [R, Tq, Hq, D]; kc, vc [R, S, L, kvh, D]; kpos [S, L]; seq_lens [R]; key_mask [R, Tq, S, L] or None.

    Causal (key position <= query position) and bounded by seq_lens. Returns [R, Tq, Hq, D] in q's dtype;
    a query with no visible key returns zeros (padding rows). `gather` (distributed DCP) turns this rank's
    partials (o [..., S, D], lse [..., S]) into every rank's, in shard order, before the one merge.
    """
    R, Tq, Hq, D = q.shape
    kvh = kc.shape[3]
    qg = q.float().view(R, Tq, kvh, Hq // kvh, D)
    s = torch.einsum("rtkgd,rslkd->rtkgsl", qg, kc.float()) * D**-0.5
    mask = (kpos[None, None] <= qpos[..., None, None]) & (kpos[None, None] < seq_lens[:, None, None, None])
    if key_mask is not None:
        mask = mask & key_mask
    s = s.masked_fill(~mask[:, :, None, None], float("-inf"))
    m = s.amax(-1)  # per shard: [R, Tq, kvh, G, S]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe[..., None])
    l = p.sum(-1)
    o = torch.einsum("rtkgsl,rslkd->rtkgsd", p, vc.float()) / l.clamp(min=1e-30)[..., None]
    lse = torch.where(l > 0, m_safe + torch.log(l.clamp(min=1e-30)), torch.full_like(l, float("-inf")))
    if gather is not None:
        o, lse = gather(o, lse)
    return merge_partials(o, lse).reshape(R, Tq, Hq, D).to(q.dtype)


def merge_partials(o: Tensor, lse: Tensor) -> Tensor:
    """Merge per-shard partial outputs o [..., S, D] with their log-sum-exps lse [..., S]."""
    total = torch.logsumexp(lse, dim=-1, keepdim=True)
    w = torch.where(torch.isfinite(total), torch.exp(lse - total), torch.zeros_like(lse))
    w = torch.nan_to_num(w, nan=0.0)
    return (w[..., None] * o).sum(-2)


def _apply(proj: Linear, x: Tensor) -> Tensor:
    return proj(x)


class AttentionLayer(nn.Module):
    def __init__(self, shape, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.hq, self.kvh, self.d = shape.attn_q_heads, shape.attn_kv_heads, shape.attn_head_dim
        self.qkv_proj = Linear(shape.hidden, (self.hq + 2 * self.kvh) * self.d, dtype=dtype, device=device)
        self.o_proj = Linear(self.hq * self.d, shape.hidden, dtype=dtype, device=device)
        self.rt = None  # AttentionRuntime, attached once the KV allocation exists
        self.fused = False  # decode through kernels.fused (set by HybridModel.set_fused); folded DCP only
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def attach(self, rt, k_cache: Tensor, v_cache: Tensor) -> None:
        self.rt, self.k_cache, self.v_cache = rt, k_cache, v_cache

    def _project(self, x: Tensor | Prenormed, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv = self.qkv_proj(x)  # x may be a Prenormed input (a fused engine's decode step)
        n = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = apply_rope(q.view(n, self.hq, self.d), positions, self.rt.cos, self.rt.sin)
        k = apply_rope(k.view(n, self.kvh, self.d), positions, self.rt.cos, self.rt.sin)
        return q, k, v.view(n, self.kvh, self.d)

    def _write_kv(self, k: Tensor, v: Tensor, positions: Tensor, block_rows: Tensor) -> None:
        """Store each token's K/V at its paged location; block_rows [N, max_blocks] is its request's table.
        A token another DCP rank holds is written into the null block (block 0, never read as context), so
        the step keeps one fixed shape for capture."""
        col, off = self.rt.geometry.locate(positions)
        blk = block_rows.long().gather(1, col[:, None]).squeeze(1)
        storage = self.rt.geometry.block_storage
        mine = off >= 0
        flat = torch.where(mine, blk * storage + off, (positions.long() % storage))
        self.k_cache.view(-1, self.kvh, self.d).index_copy_(0, flat, k.to(self.k_cache.dtype))
        self.v_cache.view(-1, self.kvh, self.d).index_copy_(0, flat, v.to(self.v_cache.dtype))

    def _gather(self, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """Every request's context in shard-local order: [R, S, L, kvh, D], a fixed shape."""
        rt = self.rt
        blk = block_tables.long()[:, rt.kcol]  # [R, S, L]
        flat = blk * rt.geometry.block_storage + rt.koff[None]
        kc = self.k_cache.view(-1, self.kvh, self.d)[flat]
        vc = self.v_cache.view(-1, self.kvh, self.d)[flat]
        return kc, vc

    def _attend(self, q, qpos, block_tables, seq_lens, rows_out: Tensor) -> Tensor:
        """q [R, Tq, Hq, D] against each request's cached context, through the selector."""
        rt = self.rt
        R, Tq = q.shape[:2]
        kc, vc = self._gather(block_tables)
        pooled = pool_keys(kc, rt.kpos, seq_lens, rt.pool, rt.num_groups, rt.reduce_sum)
        select_rows(q, qpos, pooled, rt.pool, rt.topk, rows_out)
        key_mask = rows_to_key_mask(rows_out, rt.kpos, rt.pool, rt.num_groups, R, Tq)
        return folded_attention(q, qpos, kc, vc, rt.kpos, seq_lens, key_mask, rt.gather_partials)

    def _decode_fused(self, x: Tensor | Prenormed, ctx) -> Tensor:
        """forward_decode up to o_proj's input, in four launches around the projections: RoPE + paged K/V
        write, key pooling from the paged cache, the top-k group selection, and the selected-rows
        attention."""
        rt, n, T = self.rt, ctx.n, ctx.T
        geo = rt.geometry
        q = rope_write_kv(
            self.qkv_proj(x),
            ctx.positions,
            rt.cos,
            rt.sin,
            ctx.block_tables,
            T,
            self.k_cache,
            self.v_cache,
            geo,
            self.hq,
        )
        pooled = pool_keys_paged(self.k_cache, ctx.block_tables, ctx.seq_lens, geo, rt.pool, rt.num_groups)
        select_groups(q, ctx.positions, pooled, rt.pool, ctx.selector_rows)
        o = attention_decode(
            q,
            ctx.positions,
            self.k_cache,
            self.v_cache,
            ctx.block_tables,
            ctx.seq_lens,
            ctx.selector_rows,
            geo,
            rt.pool,
            rt.num_groups,
        )
        return o.view(n * T, self.hq * self.d)

    def _prefill_fused(self, q: Tensor, positions: Tensor, rows_of_token: Tensor, rows_out: Tensor) -> Tensor:
        """Prefill attention of every prompt token through the decode kernels, each token its own row: its
        prompt's block table, seq_len = its position + 1 (the keys written before this call up to itself),
        pooled keys, selection and attention as a decode step at that position computes them. Every
        program works on one token row, so a token's output never depends on the other prompts of the
        batch or on how rows are split into launches; the launches are PREFILL_FUSED_ROWS rows at a time,
        bounding the pooled keys' scratch (fp32 [rows, groups, kv heads, D]: 128 KiB a row for the proxy
        preset). It replaces the torch path's per-prompt loop: on a GPU that was about 170 eager launches
        per prompt and attention layer, and prefill was launch-bound (2026-12-06 qualify run on an H100,
        bench/results/qualify-run-h100-2026-12-06-monitor.json: 7.9 s of prefill over 625 prompts)."""
        rt = self.rt
        geo = rt.geometry
        total = q.shape[0]
        seq_lens = positions + 1
        out = torch.empty_like(q)
        for a in range(0, total, PREFILL_FUSED_ROWS):
            b = min(total, a + PREFILL_FUSED_ROWS)
            tables = rows_of_token[a:b]
            pooled = pool_keys_paged(self.k_cache, tables, seq_lens[a:b], geo, rt.pool, rt.num_groups)
            select_groups(q[a:b], positions[a:b], pooled, rt.pool, rows_out[a:b])
            attention_decode(
                q[a:b],
                positions[a:b],
                self.k_cache,
                self.v_cache,
                tables,
                seq_lens[a:b],
                rows_out[a:b],
                geo,
                rt.pool,
                rt.num_groups,
                out=out[a:b],
            )
        return out

    def forward_decode(self, x: Tensor | Prenormed, ctx, then: Callable | None = None):
        """One decode step of the block's attention; `then(o_proj, o)`, where given, runs the output
        projection instead of o_proj(o) (Linear.add_norm: the residual add and the next norm in its
        launch)."""
        if then is None:
            then = _apply
        if self.fused and self.rt.geometry.rank is None:
            return then(self.o_proj, self._decode_fused(x, ctx))
        n, T = ctx.n, ctx.T
        q, k, v = self._project(x, ctx.positions)
        rows = ctx.block_tables[:, None, :].expand(n, T, ctx.block_tables.shape[1]).reshape(n * T, -1)
        self._write_kv(k, v, ctx.positions, rows)
        o = self._attend(
            q.view(n, T, self.hq, self.d),
            ctx.positions.view(n, T),
            ctx.block_tables,
            ctx.seq_lens,
            ctx.selector_rows,
        )
        return then(self.o_proj, o.reshape(n * T, self.hq * self.d))

    def forward_prefill(self, x: Tensor, ctx) -> Tensor:
        q, k, v = self._project(x, ctx.positions)
        # [total, max_blocks]; output_size given, so the device's repeat counts are not read back (no sync)
        rows_of_token = ctx.block_tables.repeat_interleave(ctx.seq_lens_q, dim=0, output_size=x.shape[0])
        self._write_kv(k, v, ctx.positions, rows_of_token)
        if self.fused and self.rt.geometry.rank is None:
            o = self._prefill_fused(q, ctx.positions, rows_of_token, ctx.selector_rows)
            return self.o_proj(o.reshape(x.shape[0], self.hq * self.d))
        outs = []
        for i, (lo, hi) in enumerate(ctx.bounds):
            # Query chunks bound the [Tq, S, L] score tensor of long prompts (eager path only).
            for a in range(lo, hi, self.rt.prefill_query_chunk):
                b = min(hi, a + self.rt.prefill_query_chunk)
                o = self._attend(
                    q[a:b][None],
                    ctx.positions[a:b][None],
                    ctx.block_tables[i : i + 1],
                    ctx.seq_lens[i : i + 1],
                    ctx.selector_rows[a:b],
                )
                outs.append(o[0])
        o = torch.cat(outs, dim=0)
        return self.o_proj(o.reshape(x.shape[0], self.hq * self.d))


class AttentionRuntime:
    """What every attention layer shares: geometry, static context tables, RoPE tables, selector sizes."""

    def __init__(self, cfg, device: torch.device, dcp=None):
        from .norm import rope_tables

        # dcp: a DcpGroup (qualify/engine/dcp.py) when the shards are distributed over ranks; None: folded.
        self.geometry = DcpGeometry(
            cfg.block_size,
            cfg.dcp_size,
            cfg.interleave,
            cfg.max_model_len,
            cfg.max_blocks_per_seq,
            rank=None if dcp is None else dcp.rank,
        )
        self.gather_partials = None if dcp is None else dcp.gather_partials
        self.reduce_sum = None if dcp is None else dcp.reduce_sum
        self.kpos, self.kcol, self.koff = self.geometry.context_tables(device)
        self.cos, self.sin = rope_tables(cfg.max_model_len, cfg.shape.attn_head_dim, device)
        self.pool, self.topk = cfg.selector_pool, cfg.selector_topk
        self.num_groups = -(-cfg.max_model_len // cfg.selector_pool)
        self.prefill_query_chunk = 256
