"""What the folded projections of kernels/fused.py are held to, shared by the GPU tests at the proxy
preset's shapes (test_gpu_fused.py) and the CPU tests (test_fused_glue.py), which also hold these bounds
to a torch emulation of the kernels' rounding at the GPU tests' shapes and dtype: a bound that no correct
kernel can meet fails on CPU, before device time is spent on it.

Why not "within a bf16 step of the exact value": the norm's output, or the row times the norm's weight
when the 1/rms is deferred to the accumulator, is rounded to 16 bits before the dot. Each rounding is up to
half a step of its entry, so at K = 4096 a bf16 result carries about 0.16 RMS of error against the exact
fp32 product (|y| ~ 64), and 7.5% of its entries lie more than 0.05 + |y|/128 away: the two-launch path
(the norm's kernel, then the projection) as much as the fold. The branch's first GPU run (2026-12-04) held
the fold to that bound and failed all 12 cases; the kernel computed what it was meant to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def exact_norm(s: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    sf = s.float()
    return sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * g.float()


def rms_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).pow(2).mean().sqrt().item()


def check_linear_add_norm(s, u, sq, x, w, res, nw, tiles: int) -> None:
    """(s, u, sq) = linear_add_norm(x, w, res, nw): s is the product rounded to the activation dtype plus
    the residual, rounded again (the product's own rounding may land a step apart where the sums are
    ordered differently); u is s * nw rounded once, exactly; sq holds each column tile's sums of s^2."""
    dt = x.dtype
    y = F.linear(x.float(), w.float())
    want = (y.to(dt).float() + res.float()).to(dt)
    step = 2.0**-7 if dt == torch.bfloat16 else 2.0**-10
    # The product may round a step of |y| apart (fp32 sums in another order); the sums a step of |y| apart
    # may then round to grid points two steps of |s| apart (a tie one way, past the next one the other).
    # The first GPU run of the epilogues (2026-12-04) saw 2^-7 where |y| + |res| < 1 at K = 4096, M = 5.
    bound = step * (2 * y.abs() + res.float().abs()) + 1e-6
    assert ((s.float() - want.float()).abs() <= bound).all(), (s.float() - want.float()).abs().max()
    assert torch.equal(u, (s.float() * nw.float()).to(dt))
    assert sq.shape == (tiles, x.shape[0]) and sq.dtype == torch.float32
    torch.testing.assert_close(sq.sum(0), s.float().pow(2).sum(-1), rtol=1e-5, atol=1e-3)


def check_norm_linear(y, s, u, sq, nw, w, eps: float, *, ratio: float = 1.1, floor: float = 0.0) -> None:
    """y = norm_linear(u, sq, eps, w) for (s, u, sq) of a linear_add_norm:

    - what it computes: u @ w.T in fp32 times the rows' 1/rms from sq, rounded once: within a step of
      the output dtype of that product (the order of the fp32 sums aside);
    - what it stands for: RMSNorm(s) * nw @ w.T. Its error against the exact fp32 value is the two-launch
      path's (the norm's output rounded, then the projection): RMS no more than `ratio` times that path's
      plus `floor` (small shapes estimate an RMS from few entries)."""
    K = s.shape[-1]
    rstd = torch.rsqrt(sq.sum(0) / K + eps)[:, None]
    emulated = F.linear(u.float(), w.float()) * rstd
    torch.testing.assert_close(y.float(), emulated, atol=0.05, rtol=2**-7)
    exact = F.linear(exact_norm(s, nw, eps), w.float())
    two = F.linear(exact_norm(s, nw, eps).to(s.dtype).float(), w.float()).to(y.dtype)
    assert rms_err(y, exact) <= ratio * rms_err(two, exact) + floor, (rms_err(y, exact), rms_err(two, exact))


def check_swiglu_linear(a, x, w, sq=None, eps: float = 0.0) -> None:
    """a = swiglu_linear(x, w, sq, eps): silu(gate) * up of gate_up = x @ w.T (times the 1/rms from sq),
    gate and up rounded to the activation dtype, then SiLU and the product rounded as silu_mul rounds
    them. A gate or up entry may round a step apart from torch's (the sums are ordered differently), which
    SiLU and the product carry into the output: a few steps of its dtype at the entry's size."""
    gu = F.linear(x.float(), w.float())
    if sq is not None:
        gu = gu * torch.rsqrt(sq.sum(0) / x.shape[-1] + eps)[:, None]
    gate, up = gu.to(x.dtype).chunk(2, dim=-1)
    want = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    step = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10
    # one step of gate or up moves the output by about that step times |up| * (|silu'| <= 1.1) or |silu(g)|
    bound = 3 * step * (gate.float().abs() + 1) * (up.float().abs() + 1) + 1e-6
    err = (a.float() - want.float()).abs()
    assert (err <= bound).all(), err.max()
