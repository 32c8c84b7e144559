"""Adapter from our KDA backend contract to PyPI b12x 1.5.1's `gdn_decode` KDA path (imported lazily).

b12x takes packed `mixed_qkv [tokens, 2HK+HV]`, raw gate/β and applies the gated RMSNorm itself, so the
boundary matches ours; q/k/v are copied into caller-owned scratch unless they already are views of one
packed row (`packed_qkv_view`).
Its prefill runs only on compute capability 12.x, so this backend's prefill is our Triton prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import (
    Binding,
    Caps,
    DecodePlan,
    TensorSpec,
    TorchBackend,
    check_binding,
    check_caps,
)

B12X_VERSION = "1.5.1"
PREFILL_NOTE = "prefill: triton (b12x prefill needs compute capability 12.x)"


def _import_gdn_decode():
    from b12x.sequence import gdn_decode

    _ = gdn_decode.plan  # the package installs a lazy API; touch it so a broken install fails here
    return gdn_decode


def _prefill_note(device: torch.device) -> str:
    if torch.cuda.get_device_capability(device)[0] == 12:
        return "prefill: triton (b12x prefill not wired into this adapter)"
    return PREFILL_NOTE


_STATUS: dict[torch.device, tuple[bool, str]] = {}  # per device, once per process


def _status(device: torch.device) -> tuple[bool, str]:
    if device not in _STATUS:
        _STATUS[device] = _check_status(device)
    return _STATUS[device]


def record_conformance(device: torch.device) -> tuple[bool, str]:
    """For a warm step's recording pass (qualify/engine/precompile.py: kernels launch nothing there): import
    b12x and run its conformance check so that its kernels are recorded and compiled by the step's workers,
    without comparing the outputs (nothing ran); the device's status is then taken as the check would give
    it on a working install, for this process only (the step's engine then resolves as a serving engine
    would, and records the same work). Every serving engine runs the check for real. On an H100
    (2026-12-05) the check's compiles, done in the step before its recording, were 3.8 s of its start."""
    if device.type != "cuda" or device in _STATUS:
        return _status(device)
    try:
        _import_gdn_decode()
    except Exception:
        return _status(device)  # not importable: as a serving engine would find it
    conformance_check(device, compare=False)
    _STATUS[device] = (
        True,
        f"b12x {B12X_VERSION} decode: conformance check recorded, not compared (a warm step's recording "
        f"pass); {_prefill_note(device)}",
    )
    return _STATUS[device]


def _check_status(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"b12x needs a CUDA device, got {device}"
    try:
        _import_gdn_decode()
    except Exception as e:  # ImportError, or a dependency (cutlass-dsl, tvm-ffi) failing at import
        return False, (
            f"package b12x=={B12X_VERSION} not importable ({type(e).__name__}: {e}); "
            "install it with --no-deps plus nvidia-cutlass-dsl-libs-base/core and apache-tvm-ffi"
        )
    try:
        conformance_check(device)
    except Exception as e:
        return False, f"b12x start-up conformance check against the torch reference failed: {e}"
    return True, f"b12x {B12X_VERSION} decode passed its conformance check; {_prefill_note(device)}"


def b12x_status(device: str | torch.device) -> tuple[bool, str]:
    """(usable, why): imports b12x and runs the conformance check once per device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _status(dev)


def conformance_check(device: torch.device, *, seed: int = 0, compare: bool = True) -> None:
    """One small verify step (T=2, mixed accepted counts, a null row, a dead row): b12x vs the reference
    (`compare=False`: run both, compare nothing: record_conformance)."""
    H, K, n, T, slots = 2, 128, 4, 2, 10
    caps = Caps(H, K, K, n, T, slots, device=device)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, s: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * s).to(device)

    base = {
        "q": rnd(n * T, H, K).bfloat16(),
        "k": rnd(n * T, H, K).bfloat16(),
        "v": rnd(n * T, H, K).bfloat16(),
        "a": rnd(n * T, H, K).bfloat16(),
        "b": rnd(n * T, H).bfloat16(),
        "A_log": rnd(H, s=0.5),
        "dt_bias": rnd(H * K, s=0.5),
        "z": rnd(n * T, H, K).bfloat16(),
        "norm_weight": rnd(K, s=0.1) + 1,
        "state": rnd(slots, H, K, K, s=0.1),
        "state_indices": torch.tensor([[1, 2], [3, 4], [0, 0], [5, 6]], dtype=torch.int32, device=device),
        "num_accepted": torch.tensor([1, 2, 1, 1], dtype=torch.int32, device=device),
        "num_live": torch.tensor([3], dtype=torch.int32, device=device),
    }
    results = []
    for backend in (TorchBackend(), B12xBackend()):
        t = {name: x.clone() for name, x in base.items()}
        t["out"] = torch.full((n * T, H, K), 7.0, dtype=torch.bfloat16, device=device)
        plan = backend.plan(caps)
        scratch = {
            m: torch.zeros(s.shape, dtype=s.dtype, device=device)
            for m, s in backend.scratch_specs(plan).items()
        }
        backend.run(backend.bind(plan, scratch=scratch, **t))
        torch.cuda.synchronize(device)
        results.append((t["out"].float(), t["state"]))
    if not compare:
        return
    (o_ref, s_ref), (o, s) = results
    out_err = (o - o_ref).abs().max().item()
    state_err = (s - s_ref).abs().max().item()
    if not out_err <= 3e-2 or not state_err <= 1e-4:
        raise AssertionError(
            f"max |out - ref| = {out_err:.3g} (allowed 3e-2), max |state - ref| = {state_err:.3g}"
        )


def packed_qkv_view(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """A zero-copy [rows, 2HK+HV] view when q, k, v already are one packed `mixed_qkv` row, else None.

    The rule: q, k, v are views of ONE storage; per row k starts right after q and v right after k; each is
    contiguous within its row ([H, K] / [H, V]); for rows > 1 they share a row stride of at least the packed
    width; the packed view lies inside that storage. A size-1 row dim carries no layout (torch may give
    it any stride), so at rows == 1 the row stride is not compared and the packed view gets the width.
    Separately allocated tensors that merely sit side by side (the caching allocator often places
    same-size allocations back to back) are NOT packed: a view across allocations is out of bounds for
    torch and may be recycled under us, so they take the copy path.
    """
    rows, H, K = q.shape
    V = v.shape[2]
    width = 2 * H * K + H * V
    storage = q.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in (k, v)):
        return None
    if q.stride()[1:] != (K, 1) or k.stride()[1:] != (K, 1) or v.stride()[1:] != (V, 1):
        return None
    if rows > 1:
        if not q.stride(0) == k.stride(0) == v.stride(0) or q.stride(0) < width:
            return None
        row_stride = q.stride(0)
    else:
        row_stride = width
    base = q.storage_offset()
    if k.storage_offset() != base + H * K or v.storage_offset() != base + 2 * H * K:
        return None
    if (base + (rows - 1) * row_stride + width) * q.element_size() > storage.nbytes():
        return None
    return q.as_strided((rows, width), (row_stride, 1), base)


class B12xBackend:
    """b12x decode behind our contract; prefill delegates to our Triton prefill.

    With `autotune`, bind() lets b12x's autotuner choose its launch configuration by timing the bound
    step itself, its activations re-produced before each sample and the state pool restored after (for
    benchmarks: it holds a copy of the pool while it tunes); without it, b12x's default
    configuration is compiled and primed with zero live rows (nothing in the pool touched)."""

    name = "b12x"

    def __init__(self, *, autotune: bool = False) -> None:
        self.autotune = autotune

    def plan(self, caps: Caps) -> DecodePlan:
        check_caps(caps)
        if caps.head_k_dim != 128 or caps.head_v_dim != 128:
            raise ValueError(
                f"b12x KDA decode needs head dims 128/128, got {caps.head_k_dim}/{caps.head_v_dim}"
            )
        if caps.tokens_per_request > 8:
            raise ValueError(
                f"b12x KDA decode allows at most 8 tokens per request, got {caps.tokens_per_request}"
            )
        if caps.dtype != torch.bfloat16:
            raise ValueError(f"b12x KDA decode needs bf16 activations, got {caps.dtype}")
        return DecodePlan(backend=self.name, caps=caps)

    def scratch_specs(self, plan: DecodePlan) -> dict[str, TensorSpec]:
        c = plan.caps
        H, K, V, n, T = c.num_heads, c.head_k_dim, c.head_v_dim, c.max_requests, c.tokens_per_request
        return {
            "mixed_qkv": TensorSpec((n * T, 2 * H * K + H * V), c.dtype),
            "query_start_loc": TensorSpec((n + 1,), torch.int32),
            "num_tokens": TensorSpec((1,), torch.int32),
            "prime_count": TensorSpec((1,), torch.int32),
            "b12x": TensorSpec((1,), torch.uint8),
        }

    def bind(self, plan: DecodePlan, *, scratch: dict[str, Tensor], **tensors: Tensor) -> Binding:
        check_binding(plan, scratch, self.scratch_specs(plan), **tensors)
        gd = _import_gdn_decode()
        from b12x.preparation import PreparationSession, PreparedCall

        c, t = plan.caps, tensors
        n, T, H, K = c.max_requests, c.tokens_per_request, c.num_heads, c.head_k_dim
        device = t["q"].device
        packed = packed_qkv_view(t["q"], t["k"], t["v"])
        mixed = scratch["mixed_qkv"] if packed is None else packed
        torch.arange(0, (n + 1) * T, T, out=scratch["query_start_loc"])
        num_tokens = t["num_live"] if T == 1 else scratch["num_tokens"]
        scratch["prime_count"].zero_()
        native_tensors = dict(
            mixed_qkv=mixed, raw_g=t["a"], raw_beta=t["b"], z=t["z"], A_log=t["A_log"],
            dt_bias=t["dt_bias"].view(H, K), norm_weight=t["norm_weight"], recurrent_state=t["state"],
            query_start_loc=scratch["query_start_loc"], num_accepted_tokens=t["num_accepted"],
            state_indices=t["state_indices"], num_seqs=t["num_live"], num_tokens=num_tokens, output=t["out"],
        )  # fmt: skip
        try:
            bcaps = gd.Caps(
                device=device, max_tokens=n * T, max_seqs=n, max_state_slots=c.num_slots, key_heads=H,
                value_heads=H, state_index_columns=T, gate_activation="sigmoid", null_state_index=0,
            )  # fmt: skip
            bplan = gd.plan(bcaps, invocation=gd.invocation_from_tensors(bcaps, **native_tensors))

            def prime(state: object) -> PreparedCall:
                # Compile and prime with zero live rows: nothing in the pool is read or written.
                zero = dict(
                    native_tensors, num_seqs=scratch["prime_count"], num_tokens=scratch["prime_count"]
                )
                args = [zero[name] for name in _B12X_OPERANDS]
                return PreparedCall(
                    run=lambda: state.run_tensors(
                        *args, eps=c.norm_eps, scale=K**-0.5, lower_bound=c.lower_bound
                    ),
                    output=t["out"],
                )

            def live(state: object) -> PreparedCall:
                # b12x's autotuner races candidates on the real step: it needs the step's activations
                # produced before each timed call (here restored from a copy taken at bind, so every sample
                # sees the same inputs), and `restore` puts the state pool and output back afterwards, so
                # tuning leaves the bound tensors as it found them (bench-only: it doubles their memory).
                args = [native_tensors[name] for name in _B12X_OPERANDS]
                inputs = {n: native_tensors[n].clone() for n in _B12X_ACTIVATIONS}
                kept = {n: native_tensors[n].clone() for n in ("recurrent_state", "output")}

                def produce() -> None:
                    for n, saved in inputs.items():
                        native_tensors[n].copy_(saved)

                def restore() -> None:
                    for n, saved in kept.items():
                        native_tensors[n].copy_(saved)
                    produce()

                return PreparedCall(
                    run=lambda: state.run_tensors(
                        *args, eps=c.norm_eps, scale=K**-0.5, lower_bound=c.lower_bound
                    ),
                    output=t["out"],
                    produce=produce,
                    restore=restore,
                    owners=(inputs, kept),
                )

            if self.autotune and T > 1:
                torch.mul(t["num_live"], T, out=scratch["num_tokens"])
            session = PreparationSession(device=device, autotune=self.autotune)
            request = bplan.request(
                name=f"qualify-kda-decode-{id(bplan)}",
                prepare_call=prime,
                benchmark_call=live if self.autotune else prime,
            )
            session.prepare((request,), autotune=self.autotune)
            native = gd.bind_kda(bplan, scratch=scratch["b12x"], **native_tensors)
        except (TypeError, ValueError) as e:
            raise ValueError(f"b12x refused the binding: {e}") from e
        return Binding(
            plan=plan, tensors=dict(tensors), scratch=dict(scratch), native=(native, session, packed is None)
        )

    def run(self, binding: Binding) -> None:
        from b12x.sequence.gdn_decode import run_kda

        native, _session, copy_qkv = binding.native
        c, t, s = binding.plan.caps, binding.tensors, binding.scratch
        if copy_qkv:
            H, K, V = c.num_heads, c.head_k_dim, c.head_v_dim
            mixed = s["mixed_qkv"]
            rows = mixed.shape[0]
            mixed[:, : H * K].view(rows, H, K).copy_(t["q"])
            mixed[:, H * K : 2 * H * K].view(rows, H, K).copy_(t["k"])
            mixed[:, 2 * H * K :].view(rows, H, V).copy_(t["v"])
        if c.tokens_per_request > 1:
            torch.mul(t["num_live"], c.tokens_per_request, out=s["num_tokens"])
        run_kda(native, lower_bound=c.lower_bound, eps=c.norm_eps)

    def prefill(self, **kwargs) -> None:
        from .chunk import prefill

        prefill(**kwargs)


# b12x's positional operand order for run_tensors (b12x/sequence/gdn_decode/_tuning.py _OPERANDS, KDA names).
# The step's activations (what a previous layer writes before each decode step).
_B12X_ACTIVATIONS = ("mixed_qkv", "raw_g", "raw_beta", "z")
_B12X_OPERANDS = (
    "mixed_qkv", "raw_g", "raw_beta", "z", "A_log", "dt_bias", "norm_weight", "recurrent_state",
    "query_start_loc", "num_accepted_tokens", "state_indices", "num_seqs", "num_tokens", "output",
)  # fmt: skip
