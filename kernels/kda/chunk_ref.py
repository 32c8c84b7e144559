"""Chunked KDA in torch (KDA.md §4): the algorithm the Triton prefill implements, with safe decay handling."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kda.naive import l2norm


def _decay_products(
    left: torch.Tensor, right: torch.Tensor, gam: torch.Tensor, sub_chunk: int
) -> torch.Tensor:
    """M[r, j] = Σ_d left_r[d]·right_j[d]·exp(Γ_r[d] − Γ_j[d]) for j ≤ r (upper triangle is zero).

    Shapes [..., C, K]. Every exponent is split at a point between j and r so that no factor
    overflows: a sub-chunk boundary for cross-block terms (both factors ≤ 1), the middle of the
    sub-chunk for diagonal blocks (each factor within e^{±|g|·sub_chunk/2}).
    """
    C = gam.shape[-2]
    out = left.new_zeros(*left.shape[:-2], C, C)
    for i0 in range(0, C, sub_chunk):
        i1 = min(i0 + sub_chunk, C)
        # Diagonal block: reference point inside the block.
        ref = gam[..., min(i0 + sub_chunk // 2, i1 - 1), :].unsqueeze(-2)
        li = left[..., i0:i1, :] * torch.exp(gam[..., i0:i1, :] - ref)
        rj = right[..., i0:i1, :] * torch.exp(ref - gam[..., i0:i1, :])
        out[..., i0:i1, i0:i1] = (li @ rj.transpose(-1, -2)).tril()
        if i0 == 0:
            continue
        # Cross blocks j < i0 ≤ r: split at Γ_{i0−1}, the boundary before row block i.
        bound = gam[..., i0 - 1, :].unsqueeze(-2)
        li = left[..., i0:i1, :] * torch.exp(gam[..., i0:i1, :] - bound)
        rj = right[..., :i0, :] * torch.exp(bound - gam[..., :i0, :])
        out[..., i0:i1, :i0] = li @ rj.transpose(-1, -2)
    return out


def chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = 64,
    sub_chunk: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over [B, T, H, ·] inputs chunk by chunk; returns (o in q's dtype, final state fp32 [B, H, V, K]).

    Same semantics as `naive_recurrent`; g is the activated log-space decay (≤ 0).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    if qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    # Padding with k = 0, β = 0, g = 0 is exact: padded tokens write nothing and decay nothing.
    qf, kf, vf, gf = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qf, kf, vf, gf))
    bf = F.pad(bf, (0, 0, 0, pad))

    # [B, H, n, C, ·]
    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(qf), chunks(kf), chunks(vf), chunks(gf)
    bc = bf.reshape(B, n, C, H).permute(0, 3, 1, 2)
    gam = gc.cumsum(-2)

    # Parallel over chunks: A, P, T = (I + A)^{-1} Diag(β), W = T·K̃, U = T·V.
    A = _decay_products(kc, kc, gam, sub_chunk).tril(-1) * bc.unsqueeze(-1)
    P = _decay_products(qc, kc, gam, sub_chunk)
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + A, torch.diag_embed(bc), upper=False, unitriangular=True)
    W = Tm @ (kc * torch.exp(gam))
    U = Tm @ vc
    q_tilde = qc * torch.exp(gam)
    gam_last = gam[..., -1:, :]
    k_bar = kc * torch.exp(gam_last - gam)

    # Sequential over chunks, state kept K-first [B, H, K, V] internally.
    if initial_state is None:
        S = q.new_zeros(B, H, K, V, dtype=torch.float32)
    else:
        S = initial_state.float().transpose(-1, -2).clone()
    o = torch.empty(B, H, n, C, V, dtype=torch.float32, device=q.device)
    for c in range(n):
        delta = U[:, :, c] - W[:, :, c] @ S
        o[:, :, c] = q_tilde[:, :, c] @ S + P[:, :, c] @ delta
        S = torch.exp(gam_last[:, :, c]).transpose(-1, -2) * S + k_bar[:, :, c].transpose(-1, -2) @ delta
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(q.dtype), S.transpose(-1, -2).contiguous()
