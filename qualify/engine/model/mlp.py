"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one projection."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .norm import Linear, Prenormed


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inner, dtype=dtype, device=device)
        self.down = Linear(inner, hidden, dtype=dtype, device=device)

    def forward(self, x: Tensor | Prenormed) -> Tensor:
        """x may be a Prenormed input (fused engines): gate_up then computes the norm in its own launch
        where it can. The activation is computed in the down projection's launch where linear_small serves
        it, else by kernels.fused.silu_mul (fused engines) or its torch reference."""
        return self.down.silu_mul(self.gate_up(x))
