"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import silu_mul

from .norm import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inner, dtype=dtype, device=device)
        self.down = Linear(inner, hidden, dtype=dtype, device=device)
        self.fused = False  # kernels.fused.silu_mul (set by HybridModel.set_fused)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return self.down(silu_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
