"""Parameter-holding building blocks with no initialisation of their own (weights.py fills them):
Linear, Embedding, RMSNorm, and the rotary position tables (derived from the config, not weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import SMALL_M, SMALL_SHAPES, linear_small, rmsnorm, rmsnorm_reference


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param(fan_out, fan_in, dtype=dtype, device=device)
        # decode-sized inputs through kernels.fused.linear_small where it beats cuBLAS (set_fused)
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (
            self.fused
            and tuple(w.shape) in SMALL_SHAPES
            and x.numel() <= SMALL_M * w.shape[1]
            and w.element_size() == 2
        ):
            return linear_small(x, w)
        return F.linear(x, w)


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
