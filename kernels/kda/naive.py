"""Plain torch references for KDA (KDA.md §1): the token-by-token recurrence, the gates, gated RMSNorm.

These are the oracle every kernel is judged against: fp32 arithmetic throughout, written for clarity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

L2_EPS = 1e-6


def l2norm(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32 (result stays fp32)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def bounded_gate(raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float = -5.0) -> Tensor:
    """GLM-5.3 "safe" gate: g = L * sigmoid(exp(A_log[h]) * (raw + dt_bias[h, :])), fp32.

    raw [..., H, K]; A_log [H]; dt_bias [H*K] (per channel). Per-step decay is bounded below by exp(L).
    """
    H, K = raw.shape[-2], raw.shape[-1]
    x = raw.float() + dt_bias.float().view(H, K)
    return lower_bound * torch.sigmoid(A_log.float().exp().view(H, 1) * x)


def unbounded_gate(raw: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """fla's form: g = -exp(A_log[h]) * softplus(raw + dt_bias[h, :]), fp32."""
    H, K = raw.shape[-2], raw.shape[-1]
    x = raw.float() + dt_bias.float().view(H, K)
    return -A_log.float().exp().view(H, 1) * F.softplus(x)


def gated_rmsnorm(o: Tensor, z: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm(o over the last dim) * weight * sigmoid(z), in fp32; returned in o's dtype."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(z.float())).to(o.dtype)


def naive_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """The KDA recurrence, one token at a time (KDA.md §1).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, already activated); beta [B, T, H].
    initial_state fp32 [B, H, V, K] (V-first) or None for zeros. Returns (o [B, T, H, V] in q's dtype,
    final_state fp32 [B, H, V, K]).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    qf, kf = (l2norm(q), l2norm(k)) if qk_l2norm else (q.float(), k.float())
    qf = qf * scale
    vf, gf, bf = v.float(), g.float(), beta.float()
    # Work in K-first [B, H, K, V] internally so the formulas read as in KDA.md; store V-first.
    if initial_state is None:
        S = q.new_zeros(B, H, K, V, dtype=torch.float32)
    else:
        S = initial_state.float().transpose(-1, -2).clone()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    for t in range(T):
        kt, qt, vt = kf[:, t], qf[:, t], vf[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = S * gf[:, t].exp().unsqueeze(-1)  # Diag(alpha) S: decay each key row
        pred = torch.einsum("bhkv,bhk->bhv", S, kt)
        u = bf[:, t].unsqueeze(-1) * (vt - pred)
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, qt)
    return o.to(q.dtype), S.transpose(-1, -2).contiguous()
