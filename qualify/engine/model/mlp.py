"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one projection."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.fused import silu_mul, silu_mul_reference

from .norm import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inner, dtype=dtype, device=device)
        self.down = Linear(inner, hidden, dtype=dtype, device=device)
        self.fused = False  # kernels.fused.silu_mul, else its torch reference (HybridModel.set_fused)

    def forward(self, x: Tensor) -> Tensor:
        act = silu_mul if self.fused else silu_mul_reference
        return self.down(act(self.gate_up(x)))
