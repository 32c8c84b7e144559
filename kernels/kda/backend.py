"""The one KDA backend contract (plan / scratch_specs / bind / run / prefill), its torch and triton
implementations, and `resolve_backend`, which picks one and says why (KDA.md §5). Never a silent fallback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .decode import (
    DEFAULT_LAUNCH_WHY,
    check_decode_args,
    default_launch,
    describe_launch,
    launch_decode,
    partials_spec,
)
from .naive import bounded_gate, gated_rmsnorm, naive_recurrent

BACKENDS = ("auto", "b12x", "triton", "torch")


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here; the message names what is missing."""


@dataclass(frozen=True)
class Caps:
    """What one decode invocation may hold: n = max_requests rows of T = tokens_per_request tokens."""

    num_heads: int
    head_k_dim: int
    head_v_dim: int
    max_requests: int
    tokens_per_request: int
    num_slots: int
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"
    lower_bound: float = -5.0
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DecodePlan:
    """Sizes and launch choices for one Caps; holds no memory."""

    backend: str
    caps: Caps
    block_v: int = 0
    num_warps: int = 0
    extra: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Binding:
    """A validated decode invocation: the plan plus every caller-owned tensor, bound by name."""

    plan: DecodePlan
    tensors: dict[str, Tensor] = field(repr=False)
    scratch: dict[str, Tensor] = field(repr=False)
    native: object = None


@dataclass(frozen=True)
class Resolution:
    name: str
    reason: str


class KdaBackend(Protocol):
    name: str

    def plan(self, caps: Caps) -> DecodePlan: ...
    def scratch_specs(self, plan: DecodePlan) -> dict[str, TensorSpec]: ...
    def bind(self, plan: DecodePlan, *, scratch: dict[str, Tensor], **tensors: Tensor) -> Binding: ...
    def run(self, binding: Binding) -> None: ...
    def prefill(self, **kwargs) -> None: ...


DECODE_TENSORS = (
    "q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_weight",
    "state", "state_indices", "num_accepted", "num_live", "out",
)  # fmt: skip


def check_caps(caps: Caps) -> None:
    for name in ("num_heads", "head_k_dim", "head_v_dim", "max_requests", "tokens_per_request", "num_slots"):
        if int(getattr(caps, name)) <= 0:
            raise ValueError(f"Caps.{name} must be positive, got {getattr(caps, name)}")
    if caps.num_slots < 2:
        raise ValueError(f"Caps.num_slots must be >= 2 (slot 0 is the null slot), got {caps.num_slots}")
    if caps.lower_bound >= 0:
        raise ValueError(f"Caps.lower_bound must be negative, got {caps.lower_bound}")


def check_binding(
    plan: DecodePlan, scratch: dict[str, Tensor], specs: dict[str, TensorSpec], **t: Tensor
) -> None:
    """Shared bind-time validation: tensor set, shapes/dtypes/strides, and agreement with the plan's Caps."""
    missing = [n for n in DECODE_TENSORS if n not in t]
    unknown = [n for n in t if n not in DECODE_TENSORS]
    if missing or unknown:
        raise ValueError(f"bind: missing tensors {missing}, unknown tensors {unknown}")
    c = plan.caps
    n, T, H, K, V = check_decode_args(*(t[name] for name in DECODE_TENSORS))
    got = {"max_requests": n, "tokens_per_request": T, "num_heads": H, "head_k_dim": K, "head_v_dim": V}
    for name, value in got.items():
        if getattr(c, name) != value:
            raise ValueError(
                f"bind: tensors give {name}={value} but the plan was made for {getattr(c, name)}"
            )
    if t["state"].shape[0] != c.num_slots:
        raise ValueError(
            f"bind: state has {t['state'].shape[0]} slots but the plan was made for {c.num_slots}"
        )
    for name in ("q", "k", "v", "z", "out"):
        if t[name].dtype != c.dtype:
            raise ValueError(f"bind: {name} is {t[name].dtype} but the plan's dtype is {c.dtype}")
    if t["q"].device != torch.device(c.device) and not (
        torch.device(c.device).type == t["q"].device.type and torch.device(c.device).index is None
    ):
        raise ValueError(f"bind: tensors are on {t['q'].device} but the plan's device is {c.device}")
    if set(scratch) != set(specs):
        raise ValueError(f"bind: scratch must hold exactly {sorted(specs)}, got {sorted(scratch)}")
    for name, spec in specs.items():
        s = scratch[name]
        if tuple(s.shape) != spec.shape or s.dtype != spec.dtype or s.device != t["q"].device:
            raise ValueError(
                f"bind: scratch {name!r} must be {spec.shape} {spec.dtype} on {t['q'].device}, "
                f"got {tuple(s.shape)} {s.dtype} on {s.device}"
            )
        if not s.is_contiguous():
            raise ValueError(f"bind: scratch {name!r} must be contiguous")


def _prefill_reference(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    z: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    has_initial_state: Tensor,
    out: Tensor,
    lower_bound: float = -5.0,
    norm_eps: float = 1e-5,
    **_metadata: object,
) -> None:
    """Sequence by sequence through chunk_reference; slot 0 = null (output zero, no state touched)."""
    from .chunk import chunk_reference

    cu = cu_seqlens.tolist()
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        slot = int(slots[i])
        if hi == lo:
            continue
        if slot == 0:
            out[lo:hi].zero_()
            continue
        g = bounded_gate(a[lo:hi], A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(b[lo:hi].float())
        init = state[slot][None] if bool(has_initial_state[i]) else None
        o, final = chunk_reference(
            q[lo:hi][None].float(), k[lo:hi][None].float(), v[lo:hi][None].float(), g[None], beta[None],
            initial_state=init,
        )  # fmt: skip
        out[lo:hi] = gated_rmsnorm(o[0], z[lo:hi], norm_weight, norm_eps).to(out.dtype)
        state[slot] = final[0]


class _NoScratch:
    """scratch_specs/bind of a backend that needs no scratch: validate the tensors and keep them."""

    def scratch_specs(self, plan: DecodePlan) -> dict[str, TensorSpec]:
        return {}

    def bind(self, plan: DecodePlan, *, scratch: dict[str, Tensor], **tensors: Tensor) -> Binding:
        check_binding(plan, scratch, self.scratch_specs(plan), **tensors)
        return Binding(plan=plan, tensors=dict(tensors), scratch=dict(scratch))


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise a clear error instead of a broken CUDA-graph capture when a host-syncing path runs in one."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} reads device tensors on the host and cannot run inside CUDA-graph capture; "
            "use the 'triton' or 'b12x' KDA backend, or run eagerly"
        )


class TorchBackend(_NoScratch):
    """The references, looped per request on the host; the CPU backend and the oracle for the others."""

    name = "torch"

    def plan(self, caps: Caps) -> DecodePlan:
        check_caps(caps)
        return DecodePlan(backend=self.name, caps=caps)

    def run(self, binding: Binding) -> None:
        t, c = binding.tensors, binding.plan.caps
        refuse_capture(t["q"].device, "the torch KDA decode reference")
        decode_reference(**t, lower_bound=c.lower_bound, norm_eps=c.norm_eps)

    def prefill(self, *, state_bv: int | None = None, **kwargs) -> None:
        # state_bv: the Triton state pass's column tile, nothing the reference has
        refuse_capture(kwargs["q"].device, "the torch KDA prefill reference")
        _prefill_reference(**kwargs)


def decode_reference(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    z: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor,
    num_live: Tensor,
    out: Tensor,
    lower_bound: float = -5.0,
    norm_eps: float = 1e-5,
    scale: float | None = None,
) -> None:
    """KDA.md §3 slot semantics with naive_recurrent, one token at a time (host syncs: reference only)."""
    n, T = state_indices.shape
    live = int(num_live[0])
    idx = state_indices.tolist()
    acc = num_accepted.tolist()
    for r in range(n):
        rows = slice(r * T, (r + 1) * T)
        src = idx[r][min(max(acc[r] - 1, 0), T - 1)] if r < live else 0
        if src == 0:
            out[rows].zero_()
            continue
        S = state[src][None].clone()
        g = bounded_gate(a[rows], A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(b[rows].float())
        for j in range(T):
            tok = slice(r * T + j, r * T + j + 1)
            o, S = naive_recurrent(
                q[tok][None].float(), k[tok][None].float(), v[tok][None].float(), g[j : j + 1][None],
                beta[j : j + 1][None], scale=scale, initial_state=S,
            )  # fmt: skip
            out[tok] = gated_rmsnorm(o[0], z[tok], norm_weight, norm_eps).to(out.dtype)
            if idx[r][j] != 0:
                state[idx[r][j]] = S[0]


class TritonBackend:
    """Our Triton decode/verify (kernels.kda.decode) and chunked prefill (kernels.kda.chunk). Its one
    scratch tensor, norm_partials, holds the split launch's partial sums of squares (decode.partials_spec):
    zeroed at bind, then written only by these launches, which keep its words' epochs in step."""

    name = "triton"

    def scratch_specs(self, plan: DecodePlan) -> dict[str, TensorSpec]:
        c = plan.caps
        shape = partials_spec(c.max_requests * c.tokens_per_request, c.num_heads, c.head_v_dim, plan.block_v)
        return {} if shape is None else {"norm_partials": TensorSpec(shape, torch.int64)}

    def bind(self, plan: DecodePlan, *, scratch: dict[str, Tensor], **tensors: Tensor) -> Binding:
        check_binding(plan, scratch, self.scratch_specs(plan), **tensors)
        for t in scratch.values():
            t.zero_()
        return Binding(plan=plan, tensors=dict(tensors), scratch=dict(scratch))

    def plan(self, caps: Caps) -> DecodePlan:
        check_caps(caps)
        for name in ("head_k_dim", "head_v_dim"):
            d = getattr(caps, name)
            if d < 16 or d & (d - 1):
                raise ValueError(f"triton backend needs Caps.{name} a power of two >= 16, got {d}")
        bv, nw = default_launch(caps.max_requests, caps.num_heads, caps.head_v_dim, caps.tokens_per_request)
        return DecodePlan(
            backend=self.name, caps=caps, block_v=bv, num_warps=nw,
            extra=(("launch", describe_launch(bv, nw, caps.head_v_dim)), ("why", DEFAULT_LAUNCH_WHY)),
        )  # fmt: skip

    def run(self, binding: Binding) -> None:
        p, t = binding.plan, binding.tensors
        launch_decode(
            *(t[name] for name in DECODE_TENSORS),
            lower_bound=p.caps.lower_bound, norm_eps=p.caps.norm_eps, scale=None,
            block_v=p.block_v, num_warps=p.num_warps, partials=binding.scratch.get("norm_partials"),
        )  # fmt: skip

    def prefill(self, **kwargs) -> None:
        from .chunk import prefill

        prefill(**kwargs)


def get_backend(name: str) -> KdaBackend:
    """The backend object for a resolved name ("torch", "triton", "b12x")."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return TritonBackend()
    if name == "b12x":
        from .b12x import B12xBackend

        return B12xBackend()
    raise ValueError(
        f"unknown KDA backend {name!r}; choose one of {', '.join(b for b in BACKENDS if b != 'auto')}"
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def consults_b12x(requested: str, *, speculative: bool, device: str | torch.device) -> bool:
    """Whether resolve_backend asks b12x (imports it and runs its conformance check) for this request: b12x
    requested, or auto with speculation on CUDA (a warm step records that check where an engine runs it)."""
    cuda = torch.device(device).type == "cuda"
    return requested == "b12x" or (requested == "auto" and cuda and speculative)


def resolve_backend(requested: str, *, speculative: bool, device: str | torch.device) -> Resolution:
    """Pick the backend for `requested` on `device`; the reason records why (and what prefill uses)."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown KDA backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if requested == "torch":
        if cuda:
            return Resolution(
                "torch", "torch reference requested on CUDA: correct but slow (host loop per request)"
            )
        return Resolution("torch", "torch reference requested")
    if requested == "triton":
        if cuda:
            return Resolution("triton", "triton requested")
        if _interpreting():
            return Resolution("triton", f"triton requested on {dev} under TRITON_INTERPRET=1 (interpreter)")
        raise BackendUnavailable(
            f"KDA backend 'triton' needs a CUDA device, got {dev}; use 'torch' or 'auto'"
        )
    from .b12x import b12x_status

    if requested == "b12x":
        ok, why = b12x_status(dev)
        if not ok:
            raise BackendUnavailable(f"KDA backend 'b12x' unavailable: {why}; use 'triton' or 'auto'")
        return Resolution("b12x", f"b12x requested: {why}")
    # auto
    if not cuda:
        return Resolution("torch", f"auto: no CUDA device ({dev}), torch reference")
    if not speculative:
        return Resolution("triton", "auto: CUDA without speculation")
    ok, why = b12x_status(dev)
    if ok:
        return Resolution("b12x", f"auto: speculative on CUDA, {why}")
    return Resolution("triton", f"auto: speculative on CUDA, b12x unavailable ({why})")
