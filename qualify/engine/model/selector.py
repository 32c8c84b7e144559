"""Pooled top-k block selector: keys mean-pooled over groups of `pool` positions, each query keeps its own
group plus the top-(k-1) earlier complete groups by pooled score (dense while the context is short).

Only groups that end before the query's own group are eligible, so a selection never depends on tokens at
or after the query: prefill, decode and speculative verify select the same rows for the same position.
Vectorized throughout (no loops over tokens, no host syncs), so it runs inside a captured step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def pool_keys(
    kc: Tensor,
    kpos: Tensor,
    seq_lens: Tensor,
    pool: int,
    num_groups: int,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Mean of the valid keys of each group. kc [R, S, L, kvh, D]; kpos [S, L]; -> [R, G, kvh, D] fp32.
    `reduce_sum` (distributed DCP) sums the per-rank sums and counts, so every rank pools every shard."""
    R, S, L, kvh, D = kc.shape
    valid = (kpos[None] < seq_lens[:, None, None]).reshape(R, S * L)  # [R, S*L]
    gid = (kpos // pool).clamp(max=num_groups - 1).reshape(1, S * L).expand(R, -1)
    kf = kc.float().reshape(R, S * L, kvh * D) * valid[..., None]
    sums = torch.zeros(R, num_groups, kvh * D, dtype=torch.float32, device=kc.device)
    sums.scatter_add_(1, gid[..., None].expand(-1, -1, kvh * D), kf)
    counts = torch.zeros(R, num_groups, dtype=torch.float32, device=kc.device)
    counts.scatter_add_(1, gid, valid.float())
    if reduce_sum is not None:
        sums, counts = reduce_sum(sums), reduce_sum(counts)
    return (sums / counts.clamp(min=1.0)[..., None]).view(R, num_groups, kvh, D)


def select_rows(q: Tensor, qpos: Tensor, pooled: Tensor, pool: int, topk: int, out_rows: Tensor) -> None:
    """Write each query's selected group indices into out_rows [R*Tq, topk] (-1 = none), in place.

    q [R, Tq, Hq, D]; qpos [R, Tq]; pooled [R, G, kvh, D]. Score of a group = sum over query heads of
    q·pooled_key(kv head of that query head) / sqrt(D).
    """
    R, Tq, Hq, D = q.shape
    G, kvh = pooled.shape[1], pooled.shape[2]
    qg = q.float().view(R, Tq, kvh, Hq // kvh, D)
    score = torch.einsum("rtkgd,rnkd->rtn", qg, pooled) * D**-0.5  # [R, Tq, G]
    own = (qpos.long() // pool)[..., None]  # [R, Tq, 1]
    g = torch.arange(G, device=q.device)[None, None, :]
    score = torch.where(g < own, score, torch.full_like(score, float("-inf")))
    score = torch.where(g == own, torch.full_like(score, float("inf")), score)
    k = min(topk, G)
    vals, idx = torch.topk(score, k, dim=-1)
    rows = torch.where(vals > float("-inf"), idx, torch.full_like(idx, -1)).to(out_rows.dtype)
    out_rows[:, :k].copy_(rows.view(R * Tq, k))
    if k < out_rows.shape[1]:
        out_rows[:, k:].fill_(-1)


def rows_to_key_mask(rows: Tensor, kpos: Tensor, pool: int, num_groups: int, R: int, Tq: int) -> Tensor:
    """Expand selected rows [R*Tq, topk] (read back from the arena) to a key mask [R, Tq, S, L]."""
    sel = torch.zeros(R * Tq, num_groups + 1, dtype=torch.bool, device=rows.device)
    sel.scatter_(1, (rows.long() + 1).clamp(min=0), True)  # -1 lands in column 0, dropped below
    sel = sel[:, 1:]
    S, L = kpos.shape
    gid = (kpos // pool).clamp(max=num_groups - 1).reshape(-1)
    return sel[:, gid].view(R, Tq, S, L)
