"""Parameter-holding building blocks with no initialisation of their own (weights.py fills them):
Linear, Embedding, RMSNorm, and the rotary position tables (derived from the config, not weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import (
    linear_small,
    rmsnorm,
    rmsnorm_linear,
    rmsnorm_reference,
    serves_small,
    silu_mul,
    silu_mul_linear,
    silu_mul_reference,
)


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param(fan_out, fan_in, dtype=dtype, device=device)
        # decode-sized inputs through kernels.fused.linear_small where it beats cuBLAS (set_fused)
        self.fused = False

    def small(self, rows: int) -> bool:
        """Whether `rows` rows go through kernels.fused's decode-sized projection (fused engines only)."""
        return self.fused and serves_small(self.weight, rows)

    def forward(self, x: Tensor | Prenormed) -> Tensor:
        w = self.weight
        if isinstance(x, Prenormed):
            if not self.small(x.rows):
                return F.linear(x.materialize(), w)
            return x.project(w)
        if self.small(x.numel() // w.shape[1]):
            return linear_small(x, w)
        return F.linear(x, w)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """This projection of silu(gate) * up, gate_up = [gate | up]: in one launch where linear_small
        serves the rows (the activation in its prologue), else silu_mul's kernel (fused) or torch ops."""
        if self.small(gate_up.numel() // gate_up.shape[-1]):
            return silu_mul_linear(gate_up, self.weight)
        return F.linear((silu_mul if self.fused else silu_mul_reference)(gate_up), self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param(vocab, hidden, dtype=dtype, device=device)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids.long(), self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, dtype: torch.dtype, device: torch.device, eps: float = 1e-5):
        super().__init__()
        self.weight = param(dim, dtype=dtype, device=device)
        self.eps = eps
        self.fused = False  # kernels.fused.rmsnorm, else its torch reference (HybridModel.set_fused)

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, this norm of it) in one kernel; fused engines only."""
        return rmsnorm(x, self.weight, self.eps, residual)

    def forward(self, x: Tensor) -> Tensor:
        return (rmsnorm if self.fused else rmsnorm_reference)(x, self.weight, self.eps)


@dataclass
class Prenormed:
    """RMSNorm(x + residual) * norm.weight, not computed yet (fused engines). The projection that consumes
    it folds the norm and the add into its own launch where linear_small serves it (Linear.forward), else
    the norm's kernel runs first (`materialize`). Either way `total` is then x + residual, rounded as
    torch's add rounds it (x itself without a residual): the block's residual stream."""

    x: Tensor
    residual: Tensor | None
    norm: RMSNorm
    total: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    def materialize(self) -> Tensor:
        """The normed input, by the norm's kernel (with the add where there is a residual)."""
        if self.residual is None:
            self.total = self.x
            return self.norm(self.x)
        self.total, h = self.norm.add(self.x, self.residual)
        return h

    def project(self, weight: Tensor) -> Tensor:
        """The normed input @ weight.T in one launch (kernels.fused.rmsnorm_linear)."""
        n = self.norm
        if self.residual is None:
            self.total = self.x
            return rmsnorm_linear(self.x, n.weight, n.eps, weight)
        self.total, y = rmsnorm_linear(self.x, n.weight, n.eps, weight, self.residual)
        return y


def rope_tables(
    max_len: int, head_dim: int, device: torch.device, base: float = 10000.0
) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim/2] in fp32 (neox-style halves)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    ang = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, heads, D] rotated at positions [N]; computed in fp32, returned in x's dtype."""
    c = cos[positions.long()][:, None, :]
    s = sin[positions.long()][:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
