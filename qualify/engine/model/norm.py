"""Parameter-holding building blocks with no initialisation of their own (weights.py fills them):
Linear, Embedding, RMSNorm, and the rotary position tables (derived from the config, not weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import (
    linear_add_norm,
    linear_rows,
    linear_small,
    norm_linear,
    rmsnorm,
    rmsnorm_reference,
    serves_small,
    silu_mul,
    silu_mul_reference,
    swiglu_linear,
)


class _RowsMode:
    """Whether projections run row-invariant (rows_invariant): read by every Linear of a fused engine."""

    on = False


ROWS = _RowsMode()


@contextlib.contextmanager
def rows_invariant() -> Iterator[None]:
    """Inside: every projection of a fused engine goes through kernels.fused.linear_rows, whose result for a
    row depends on that row alone (not on how many rows share the call, nor where among them it sits), and
    no row count picks another kernel (linear_small's decode-sized launches stay off). What the batched
    prefill runs under (qualify/engine/runner.py): a prompt's logits never depend on its batch. One engine
    worker thread steps the model, so a flag on the module is enough."""
    before, ROWS.on = ROWS.on, True
    try:
        yield
    finally:
        ROWS.on = before


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param(fan_out, fan_in, dtype=dtype, device=device)
        # decode-sized inputs through kernels.fused.linear_small where it beats cuBLAS (set_fused)
        self.fused = False

    def small(self, rows: int) -> bool:
        """Whether `rows` rows go through kernels.fused's decode-sized projection (fused engines only; never
        under rows_invariant)."""
        return self.fused and not ROWS.on and serves_small(self.weight, rows)

    def _product(self, x: Tensor) -> Tensor:
        """x @ weight.T: linear_rows under rows_invariant (fused engines), else cuBLAS's."""
        if self.fused and ROWS.on:
            return linear_rows(x, self.weight)
        return F.linear(x, self.weight)

    def forward(self, x: Tensor | Prenormed) -> Tensor:
        w = self.weight
        if isinstance(x, Prenormed):
            if not self.small(x.rows):
                return self._product(x.materialize())
            return x.project(w)
        if self.small(x.numel() // w.shape[1]):
            return linear_small(x, w)
        return self._product(x)

    def swiglu(self, x: Tensor | Prenormed) -> Tensor:
        """silu(gate) * up of this projection of x, [gate | up] (MLP gate_up): the activation in this
        projection's launch where linear_small serves the rows (kernels.fused.swiglu_linear), else
        silu_mul's kernel (fused engines) or its torch reference after it."""
        w = self.weight
        if isinstance(x, Prenormed):
            if self.small(x.rows):
                return x.project_swiglu(w)
            x = x.materialize()
        elif self.small(x.numel() // w.shape[1]):
            return swiglu_linear(x, w)
        return (silu_mul if self.fused else silu_mul_reference)(self._product(x))

    def add_norm(self, x: Tensor, residual: Tensor, norm: RMSNorm) -> Prenormed:
        """residual + this projection of x, handed on unevaluated to `norm` (Prenormed). Where linear_small
        serves the rows, this launch also writes the sum (the residual stream), the sum times the norm's
        weight and its partial sums of squares (kernels.fused.linear_add_norm), and the projection that
        reads the norm applies its 1/rms; else the add is left to the norm's kernel."""
        if self.small(x.numel() // self.weight.shape[1]):
            s, u, sq = linear_add_norm(x, self.weight, residual, norm.weight)
            return Prenormed(s, None, norm, total=s, scaled=u, sq=sq)
        return Prenormed(self(x), residual, norm)


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
    """RMSNorm(x + residual) * norm.weight, not computed yet (fused engines). Either the launch that
    produced x did the add and all of the norm but its 1/rms (Linear.add_norm: `total` is then the sum,
    `scaled` the sum times the norm's weight and `sq` its partial sums of squares), and the projection that
    reads it applies the 1/rms to its fp32 accumulator (kernels.fused.norm_linear, swiglu_linear); or the
    add is still to do (x and residual; no residual at the first block), and the norm's kernel computes it
    first (`materialize`). Once consumed, `total` is x + residual, rounded as torch's add rounds it (x
    itself without a residual): the block's residual stream."""

    x: Tensor
    residual: Tensor | None
    norm: RMSNorm
    total: Tensor | None = None
    scaled: Tensor | None = None
    sq: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    def materialize(self) -> Tensor:
        """The normed input, by the norm's kernel (with the add where it is still to do)."""
        if self.scaled is not None:
            return self.norm(self.total)
        if self.residual is None:
            self.total = self.x
            return self.norm(self.x)
        self.total, h = self.norm.add(self.x, self.residual)
        return h

    def project(self, weight: Tensor) -> Tensor:
        """The normed input @ weight.T, for a weight linear_small serves: one launch where the producer did
        the add (kernels.fused.norm_linear), else the norm's kernel then linear_small."""
        if self.scaled is None:
            return linear_small(self.materialize(), weight)
        return norm_linear(self.scaled, self.sq, self.norm.eps, weight)

    def project_swiglu(self, weight: Tensor) -> Tensor:
        """silu(gate) * up of the normed input @ weight.T (MLP gate_up), as `project`."""
        if self.scaled is None:
            return swiglu_linear(self.materialize(), weight)
        return swiglu_linear(self.scaled, weight, self.sq, self.norm.eps)


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
