"""The second engine's model: a hybrid decoder of KDA and attention layers, each followed by a gated MLP,
stepping one token at a time through caches that are views of its shared-memory group allocations.

Its own math (docs/KDA.md's recurrence as the protocol describes the state): per KDA head a state S of
V x K (stored V-first, [H, V, K]), decayed per key channel, delta-rule write, read out by the query; a
depthwise causal conv of width W over q, k and v whose last W-1 inputs are the conv state; attention over a
paged cache [blocks, shards, block_size, kv_heads, head_dim] whose tokens are dealt to shards round-robin.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# The model this engine declares in its manifest (its own dimensions, not the reference engine's).
DIMS = {
    "kda_heads": 3,
    "kda_head_dim": 8,
    "conv_width": 3,
    "attn_kv_heads": 2,
    "attn_head_dim": 8,
    "vocab": 260,
}
HIDDEN, Q_HEADS, MLP = 40, 4, 72
BOS = 256
GATE_FLOOR = -4.0  # log decay per step is in [GATE_FLOOR, 0]


@dataclass
class Seq:
    """One live request: its slot row, its block table and how many tokens its caches hold."""

    row: int
    blocks: list[int]
    length: int = 0


def param_shapes(pattern: str) -> dict[str, tuple[int, ...]]:
    H, K, W = DIMS["kda_heads"], DIMS["kda_head_dim"], DIMS["conv_width"]
    KV, D, V = DIMS["attn_kv_heads"], DIMS["attn_head_dim"], DIMS["vocab"]
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (V, HIDDEN),
        "final_norm": (HIDDEN,),
        "lm_head": (V, HIDDEN),
    }
    for i, kind in enumerate(pattern):
        p = f"layers.{i}."
        shapes[p + "norm"] = (HIDDEN,)
        shapes[p + "mlp_norm"] = (HIDDEN,)
        shapes[p + "mlp_gate"] = (MLP, HIDDEN)
        shapes[p + "mlp_up"] = (MLP, HIDDEN)
        shapes[p + "mlp_down"] = (HIDDEN, MLP)
        if kind == "K":
            shapes[p + "in_proj"] = (3 * H * K + H + H * K, HIDDEN)  # q, k, v, beta, gate
            shapes[p + "conv"] = (3 * H * K, W)
            shapes[p + "dt_bias"] = (H * K,)
            shapes[p + "out_proj"] = (HIDDEN, H * K)
        else:
            shapes[p + "q_proj"] = (Q_HEADS * D, HIDDEN)
            shapes[p + "kv_proj"] = (2 * KV * D, HIDDEN)
            shapes[p + "o_proj"] = (HIDDEN, Q_HEADS * D)
    return shapes


def seeded(pattern: str, seed: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in sorted(param_shapes(pattern).items()):
        g = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:7], "big")
        )
        if name.endswith("norm"):
            out[name] = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith("dt_bias"):
            out[name] = 0.5 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return out


def save_weights(state: dict[str, torch.Tensor], path: str) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"engine": "second-engine"})


class Model:
    """Parameters are plain tensors that keep their storage for life: a reload copies into them."""

    def __init__(self, pattern: str, caches: dict, geometry: dict) -> None:
        self.pattern = pattern
        self.params = {n: torch.zeros(s) for n, s in param_shapes(pattern).items()}
        self.caches = caches  # layer -> {"state", "conv"} or {"k", "v"} tensors (views of the allocations)
        self.block_size = geometry["block_size"]
        self.shards = geometry["shards"]
        self.dcp = geometry["dcp_size"]
        self.interleave = geometry["interleave"]
        # Distributed DCP (dcp_ranks = dcp_size): this process stores shard `rank` only (local shard 0) and
        # `exchange(positions, keys, values)` returns every shard's rows of the same positions, in order.
        self.rank = geometry.get("rank", 0)
        self.exchange = geometry.get("exchange")

    # ------------------------------------------------------------ weights
    def load(self, path: str) -> None:
        state = load_file(path)
        want = param_shapes(self.pattern)
        if set(state) != set(want) or any(tuple(state[n].shape) != want[n] for n in want):
            raise ValueError(f"weights file {path} does not fit this model ({len(state)} tensors)")
        with torch.no_grad():
            for n, t in state.items():
                self.params[n].copy_(t)

    def census(self) -> tuple[dict[str, int], dict[str, str]]:
        ptrs = {n: t.data_ptr() for n, t in self.params.items()}
        sums = {
            n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in self.params.items()
        }
        return ptrs, sums

    # ------------------------------------------------------------ one token
    def step(self, seq: Seq, token: int, slot_in: int, slot_out: int) -> torch.Tensor:
        """Run `token` at position seq.length: KDA layers read their state from slot_in and write slot_out;
        attention writes K and V of this position into the paged cache. Returns the logits."""
        p = self.params
        x = p["embed"][token]
        pos = seq.length
        for i, kind in enumerate(self.pattern):
            pre = f"layers.{i}."
            h = _rms(x, p[pre + "norm"])
            if kind == "K":
                x = x + self._kda(i, pre, h, slot_in, slot_out)
            else:
                x = x + self._attention(i, pre, h, seq, pos)
            h = _rms(x, p[pre + "mlp_norm"])
            x = x + p[pre + "mlp_down"] @ (F.silu(p[pre + "mlp_gate"] @ h) * (p[pre + "mlp_up"] @ h))
        return p["lm_head"] @ _rms(x, p["final_norm"])

    def _kda(self, i: int, pre: str, h: torch.Tensor, slot_in: int, slot_out: int) -> torch.Tensor:
        p, c = self.params, self.caches[i]
        H, K = DIMS["kda_heads"], DIMS["kda_head_dim"]
        proj = p[pre + "in_proj"] @ h
        qkv, beta, gate = proj[: 3 * H * K], proj[3 * H * K : 3 * H * K + H], proj[3 * H * K + H :]
        window = torch.cat([c["conv"][slot_in], qkv[:, None]], dim=1)  # [3HK, W]
        conv = F.silu((window * p[pre + "conv"]).sum(dim=1))
        c["conv"][slot_out] = window[:, 1:]
        q, k, v = conv.view(3, H, K)
        with torch.profiler.record_function("kda::torch"):
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            decay = torch.exp(GATE_FLOOR * torch.sigmoid(gate + p[pre + "dt_bias"])).view(H, 1, K)
            b = torch.sigmoid(beta).view(H, 1)
            S = c["state"][slot_in] * decay  # [H, V, K], each key channel decayed at its own rate
            u = b * (v - (S * k[:, None, :]).sum(-1))  # [H, V]
            S = S + u[:, :, None] * k[:, None, :]
            c["state"][slot_out] = S
            o = (S * q[:, None, :]).sum(-1)  # [H, V]
        return p[pre + "out_proj"] @ o.reshape(-1)

    def _where(self, seq: Seq, pos: int) -> tuple[int, int, int]:
        """(block, shard, row) of token `pos`: a block covers block_size * dcp tokens, dealt to the shards
        `interleave` at a time, round-robin."""
        span = self.block_size * self.dcp
        q = pos % span
        chunk = q // self.interleave
        shard = chunk % self.dcp
        row = (chunk // self.dcp) * self.interleave + q % self.interleave
        return seq.blocks[pos // span], shard, row

    def _attention(self, i: int, pre: str, h: torch.Tensor, seq: Seq, pos: int) -> torch.Tensor:
        p, c = self.params, self.caches[i]
        KV, D = DIMS["attn_kv_heads"], DIMS["attn_head_dim"]
        q = (p[pre + "q_proj"] @ h).view(Q_HEADS, D)
        k, v = (p[pre + "kv_proj"] @ h).view(2, KV, D)
        where = [self._where(seq, t) for t in range(pos + 1)]
        if self.exchange is None:  # folded: every shard is here
            blk, shard, row = where[pos]
            c["k"][blk, shard, row] = k
            c["v"][blk, shard, row] = v
            bi = torch.tensor([w[0] for w in where])
            si = torch.tensor([w[1] for w in where])
            ri = torch.tensor([w[2] for w in where])
            keys, vals = c["k"][bi, si, ri], c["v"][bi, si, ri]  # [T, KV, D]
        else:  # distributed: the position's shard stores it; every rank's rows are gathered in order
            blk, shard, row = where[pos]
            if shard == self.rank:
                c["k"][blk, 0, row] = k
                c["v"][blk, 0, row] = v
            mine = [t for t, w in enumerate(where) if w[1] == self.rank]
            bi = torch.tensor([where[t][0] for t in mine], dtype=torch.long)
            ri = torch.tensor([where[t][2] for t in mine], dtype=torch.long)
            keys, vals = self.exchange(mine, c["k"][bi, 0, ri], c["v"][bi, 0, ri], pos + 1)
        group = Q_HEADS // KV
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        att = torch.softmax((keys * q[None]).sum(-1) / math.sqrt(D), dim=0)  # [T, Q_HEADS]
        return p[pre + "o_proj"] @ (att[:, :, None] * vals).sum(0).reshape(-1)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean() + 1e-6) * w
