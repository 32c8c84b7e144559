"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .norm import Linear, Prenormed


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inner, dtype=dtype, device=device)
        self.down = Linear(inner, hidden, dtype=dtype, device=device)

    def forward(self, x: Tensor | Prenormed, then: Callable | None = None):
        """x may be a Prenormed input (fused engines): gate_up then applies the norm's 1/rms in its own
        launch where it can. The activation is computed in gate_up's launch where linear_small serves it,
        else by kernels.fused.silu_mul (fused engines) or its torch reference. `then(down, act)`, where
        given, runs the down projection instead of down(act) (Linear.add_norm: the next residual add and
        norm in its launch)."""
        act = self.gate_up.swiglu(x)
        return self.down(act) if then is None else then(self.down, act)
