"""Backend resolution table (never a silent fallback), get_backend, and the torch backend's prefill."""

from __future__ import annotations

import sys

import pytest
import torch

import kernels.kda.b12x as b12x_adapter
from kernels.kda import (
    BACKENDS,
    BackendUnavailable,
    Caps,
    bounded_gate,
    gated_rmsnorm,
    get_backend,
    naive_recurrent,
    resolve_backend,
)


@pytest.fixture
def fresh_b12x_status():
    b12x_adapter._STATUS.clear()
    yield
    b12x_adapter._STATUS.clear()


@pytest.fixture
def no_b12x(monkeypatch, fresh_b12x_status):
    monkeypatch.setitem(sys.modules, "b12x", None)  # import b12x -> ImportError


@pytest.fixture
def b12x_imports(monkeypatch, fresh_b12x_status):
    monkeypatch.setattr(b12x_adapter, "_import_gdn_decode", lambda: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="auto, b12x, triton, torch"):
        resolve_backend("cutlass", speculative=False, device="cpu")
    assert BACKENDS == ("auto", "b12x", "triton", "torch")


@pytest.mark.parametrize("speculative", [False, True])
def test_auto_on_cpu_is_the_torch_reference(speculative):
    r = resolve_backend("auto", speculative=speculative, device="cpu")
    assert r.name == "torch" and "no CUDA" in r.reason


def test_auto_on_cuda_without_speculation_is_triton(no_b12x):
    assert resolve_backend("auto", speculative=False, device="cuda:0").name == "triton"


def test_auto_with_speculation_falls_to_triton_saying_b12x_is_not_installed(no_b12x):
    r = resolve_backend("auto", speculative=True, device="cuda:0")
    assert r.name == "triton" and "b12x==1.5.1 not importable" in r.reason


def test_explicit_b12x_without_the_package_is_unavailable(no_b12x):
    with pytest.raises(BackendUnavailable, match="b12x==1.5.1 not importable"):
        resolve_backend("b12x", speculative=True, device="cuda:0")


def test_explicit_b12x_on_cpu_names_the_missing_device():
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        resolve_backend("b12x", speculative=True, device="cpu")


def test_b12x_failing_its_conformance_check_is_refused_and_auto_says_why(b12x_imports, monkeypatch):
    def fail(device):
        raise AssertionError("max |out - ref| = 0.5")

    monkeypatch.setattr(b12x_adapter, "conformance_check", fail)
    with pytest.raises(BackendUnavailable, match="conformance check .* failed: max"):
        resolve_backend("b12x", speculative=True, device="cuda:0")
    b12x_adapter._STATUS.clear()
    r = resolve_backend("auto", speculative=True, device="cuda:0")
    assert r.name == "triton" and "conformance" in r.reason


def test_b12x_passing_its_check_records_that_prefill_runs_on_triton(b12x_imports, monkeypatch):
    monkeypatch.setattr(b12x_adapter, "conformance_check", lambda device: None)
    for requested in ("b12x", "auto"):
        r = resolve_backend(requested, speculative=True, device="cuda:0")
        assert r.name == "b12x"
        assert "prefill: triton (b12x prefill needs compute capability 12.x)" in r.reason


def test_explicit_triton_without_cuda_is_unavailable_unless_interpreting(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        resolve_backend("triton", speculative=False, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in resolve_backend("triton", speculative=False, device="cpu").reason


def test_torch_on_cuda_is_allowed_but_says_it_is_the_slow_reference():
    r = resolve_backend("torch", speculative=True, device="cuda:0")
    assert r.name == "torch" and "slow" in r.reason


def test_get_backend_returns_each_contract_and_refuses_unknown_names():
    for name in ("torch", "triton", "b12x"):
        assert get_backend(name).name == name
    with pytest.raises(ValueError, match="b12x, triton, torch"):
        get_backend("auto")


def test_b12x_plan_refuses_shapes_it_cannot_run():
    with pytest.raises(ValueError, match="head dims 128/128"):
        get_backend("b12x").plan(Caps(2, 64, 64, 1, 1, 4))
    with pytest.raises(ValueError, match="at most 8 tokens"):
        get_backend("b12x").plan(Caps(2, 128, 128, 1, 9, 40))


def test_caps_with_no_room_beyond_the_null_slot_are_refused():
    with pytest.raises(ValueError, match="num_slots must be >= 2"):
        get_backend("torch").plan(Caps(2, 16, 16, 1, 1, 1))


def test_torch_prefill_runs_each_sequence_from_its_slot_and_writes_back_in_place():
    H, K, V = 2, 16, 32
    lens, slots, has_init = [5, 0, 70, 3], [2, 3, 1, 0], [True, False, False, True]
    total = sum(lens)
    g = torch.Generator().manual_seed(0)
    t = {
        "q": torch.randn(total, H, K, generator=g).bfloat16(),
        "k": torch.randn(total, H, K, generator=g).bfloat16(),
        "v": torch.randn(total, H, V, generator=g).bfloat16(),
        "a": torch.randn(total, H, K, generator=g).bfloat16(),
        "b": torch.randn(total, H, generator=g).bfloat16(),
        "A_log": torch.randn(H, generator=g) * 0.5,
        "dt_bias": torch.randn(H * K, generator=g) * 0.5,
        "z": torch.randn(total, H, V, generator=g).bfloat16(),
        "norm_weight": torch.rand(V, generator=g) + 0.5,
    }
    state = torch.randn(5, H, V, K, generator=g) * 0.1
    before = state.clone()
    out = torch.full((total, H, V), 9.0, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    get_backend("torch").prefill(
        **t, state=state, cu_seqlens=cu, slots=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(has_init), chunk_indices=None, chunk_offsets=None, num_chunks=None,
        out=out,
    )  # fmt: skip
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if hi == lo:
            continue
        if slots[i] == 0:
            assert torch.equal(out[lo:hi].float(), torch.zeros(hi - lo, H, V))
            continue
        gk = bounded_gate(t["a"][lo:hi], t["A_log"], t["dt_bias"])[None]
        qkv = (t[x][lo:hi].float()[None] for x in ("q", "k", "v"))
        beta = torch.sigmoid(t["b"][lo:hi].float())[None]
        init = before[slots[i]][None] if has_init[i] else None
        o, S = naive_recurrent(*qkv, gk, beta, initial_state=init)
        want = gated_rmsnorm(o[0], t["z"][lo:hi], t["norm_weight"]).bfloat16()
        torch.testing.assert_close(out[lo:hi].float(), want.float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(state[slots[i]], S[0], atol=1e-4, rtol=0)
    assert torch.equal(state[[0, 4]], before[[0, 4]])  # null slot and an unused slot untouched
    assert torch.equal(state[3], before[3])  # the empty sequence's slot
