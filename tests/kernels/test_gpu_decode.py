"""Decode/verify at real shapes on a GPU (H=32, K=V=128, bf16): vs the torch reference, CUDA-graph capture."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.kda import Caps, get_backend
from kernels.kda.b12x import packed_qkv_view
from tests.pdl_chain import assert_replay_with_pdl_equals_serial

from .conftest import decode_step

# the module (the package's `decode` is the function), for the settings the tests flip
dm = importlib.import_module("kernels.kda.decode")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REAL = dict(H=32, K=128, V=128, device="cuda")
# bf16 outputs up to ~5: two bf16 ulps relative (b12x also rounds its core output to bf16 before the norm).
OUT_ATOL, OUT_RTOL = 2e-2, 1.6e-2
STATE_ATOL = 1e-4  # fp32 state: reduction order differs from the reference


def bound(name: str, t: dict[str, torch.Tensor]):
    n, T = t["state_indices"].shape
    be = get_backend(name)
    plan = be.plan(Caps(32, 128, 128, n, T, t["state"].shape[0], device="cuda"))
    scratch = {
        m: torch.zeros(s.shape, dtype=s.dtype, device="cuda") for m, s in be.scratch_specs(plan).items()
    }
    return be, be.bind(plan, scratch=scratch, **t)


def run(name: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    was_packed = packed_qkv_view(t["q"], t["k"], t["v"]) is not None
    t = {k: x.clone() for k, x in t.items()}  # clone() makes strided views contiguous: re-pack below
    if was_packed:
        t = packed(t)
    be, binding = bound(name, t)
    be.run(binding)
    torch.cuda.synchronize()
    return t


def assert_close_step(a, b):
    torch.testing.assert_close(a["out"].float(), b["out"].float(), atol=OUT_ATOL, rtol=OUT_RTOL)
    torch.testing.assert_close(a["state"], b["state"], atol=STATE_ATOL, rtol=0)


ACCELERATED = ["triton", "b12x"]


def usable(name: str) -> str:
    """`name` if it can run here; otherwise the test is skipped with the backend's own reason."""
    if name == "b12x":
        from kernels.kda.b12x import b12x_status

        ok, why = b12x_status("cuda")
        if not ok:
            pytest.skip(f"b12x cannot run here: {why}")
    return name


def packed(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q, k, v moved into one [rows, 3HK] buffer, as the engine binds them (b12x's zero-copy path)."""
    rows, H, K = t["q"].shape
    mixed = torch.cat([t[x].flatten(1) for x in ("q", "k", "v")], dim=1)
    return dict(t, **{x: mixed[:, i * H * K : (i + 1) * H * K].view(rows, H, K) for i, x in enumerate("qkv")})


@pytest.mark.parametrize("name", ACCELERATED)
@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("n", [1, 7, 64, 256])
def test_decode_matches_the_reference_at_real_shapes(name, layout, n):
    usable(name)
    t = decode_step(n, 1, seed=n, **REAL)
    if n > 1:
        t["state_indices"][n // 2] = 0  # one padding row (at n = 1 it would leave nothing to compare)
    if layout == "packed":
        t = packed(t)
    if name == "b12x":
        c = {k: x.clone() for k, x in t.items()}  # at n = 1 separate q/k/v clones often sit back to back
        _, binding = bound(name, packed(c) if layout == "packed" else c)
        assert binding.native[2] == (layout == "separate")  # copies q/k/v exactly when they are not packed
    got = run(name, t)
    assert torch.count_nonzero(got["out"][0]) > 0
    assert_close_step(got, run("torch", t))


@pytest.mark.parametrize("name", ACCELERATED)
def test_verify_with_mixed_accepted_counts_matches_the_reference(name):
    usable(name)
    n, T = 33, 4
    t = decode_step(n, T, seed=1, **REAL)
    t["num_accepted"] = (torch.arange(n, device="cuda", dtype=torch.int32) % T) + 1
    t["num_live"][0] = n - 3
    assert_close_step(run(name, t), run("torch", t))


@pytest.mark.parametrize("name", ACCELERATED)
def test_graph_replay_equals_eager_and_honours_num_live_between_replays(name):
    usable(name)
    n, T = 16, 2
    t = decode_step(n, T, seed=2, **REAL)
    eager = {k: x.clone() for k, x in t.items()}
    captured = {k: x.clone() for k, x in t.items()}
    be_e, b_e = bound(name, eager)
    be_c, b_c = bound(name, captured)
    initial = captured["state"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        be_c.run(b_c)  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be_c.run(b_c)
    for live in (n, 5, 11):
        captured["state"].copy_(initial)
        eager["state"].copy_(initial)
        captured["num_live"].fill_(live)
        eager["num_live"].fill_(live)
        graph.replay()
        be_e.run(b_e)
        torch.cuda.synchronize()
        assert torch.equal(captured["out"], eager["out"])
        assert torch.equal(captured["state"], eager["state"])
        assert torch.count_nonzero(captured["out"][live * T :]) == 0
        dead = t["state_indices"][live:].flatten().long()
        assert torch.equal(captured["state"][dead], initial[dead])


def test_triton_verify_equals_tokens_one_at_a_time_byte_for_byte():
    n, T = 8, 4
    t = decode_step(n, T, seed=3, **REAL)
    t["num_accepted"] = (torch.arange(n, device="cuda", dtype=torch.int32) % T) + 1
    together = run("triton", t)
    state = t["state"].clone()
    outs = []
    for j in range(T):
        one = {name: t[name] for name in ("A_log", "dt_bias", "norm_weight", "num_live")}
        for name in ("q", "k", "v", "a", "b", "z"):
            one[name] = t[name].view(n, T, *t[name].shape[1:])[:, j].contiguous()
        rows = torch.arange(n, device="cuda")
        read = t["state_indices"][rows, t["num_accepted"] - 1] if j == 0 else t["state_indices"][:, j - 1]
        state[t["state_indices"][:, j].long()] = state[read.long()]
        one.update(
            state=state, state_indices=t["state_indices"][:, j : j + 1].contiguous(),
            num_accepted=torch.ones(n, dtype=torch.int32, device="cuda"), out=torch.empty_like(one["z"]),
        )  # fmt: skip
        one = run("triton", one)
        state = one["state"]
        outs.append(one["out"])
    assert torch.equal(together["out"].view(n, T, 32, 128), torch.stack(outs, 1))
    cols = t["state_indices"].flatten().long()
    assert torch.equal(together["state"][cols], state[cols])


@pytest.mark.parametrize("n, T, block_v", [(1, 1, None), (8, 2, None), (16, 1, None), (4, 1, 128)])
def test_decode_in_a_chain_of_pdl_launches_replayed_in_a_graph_equals_it_launched_serially(n, T, block_v):
    """The KDA decode (and on the split path its norm) launches with PDL between the step's other kernels:
    here a kernel before it writes q and one after it reads the normed output. Replayed in a CUDA graph on
    new inputs every replay, the chain gives the bytes the same kernels give launched without PDL; a decode
    or norm kernel that read a step's tensor before its wait would read the previous replay's. n = 8 is the
    largest grid launched with PDL (PDL_MAX_PROGRAMS), n = 16 launches without it between PDL kernels."""
    from kernels import fused
    from kernels.kda.backend import DECODE_TENSORS
    from kernels.kda.decode import check_decode_args, launch_decode

    assert fused.pdl_enabled(torch.empty(1, device="cuda"))
    t = decode_step(n, T, seed=4, **REAL)
    rows, HK = n * T, 32 * 128
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = torch.randn(rows, 2 * HK, generator=g, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(32 * 128, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    initial = t["state"].clone()

    def chain():
        q = fused.silu_mul(gate_up).view(rows, 32, 128)  # a PDL kernel writes q
        args = [q if name == "q" else t[name] for name in DECODE_TENSORS]
        check_decode_args(*args)
        launch_decode(*args, lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=block_v)
        normed = fused.rmsnorm(t["out"].view(rows, HK), nw, 1e-5)  # a PDL kernel reads the output
        return normed, t["out"], t["state"]

    def new_inputs():
        gate_up.copy_(torch.randn(rows, 2 * HK, generator=g, device="cuda").to(torch.bfloat16))
        t["state"].copy_(initial)

    assert_replay_with_pdl_equals_serial(chain, new_inputs, lambda: t["state"].copy_(initial))


def _launch(t: dict[str, torch.Tensor], partials: torch.Tensor | None, **kw) -> None:
    from kernels.kda.backend import DECODE_TENSORS
    from kernels.kda.decode import launch_decode

    launch_decode(
        *(t[x] for x in DECODE_TENSORS), lower_bound=-5.0, norm_eps=1e-5, scale=None, partials=partials, **kw
    )  # fmt: skip


@pytest.mark.parametrize("state_after_wait", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_the_one_launch_norm_gives_the_two_launch_bits_call_after_call(n, state_after_wait, monkeypatch):
    """kernels/kda/decode.py's ONE_LAUNCH (each program waits for its (row, head)'s other V tiles' partial
    sums of squares) against TWO_LAUNCHES (a second kernel adds the same words): the same output and state
    bits, on words kept across three calls whose epochs advance together; with a dead row among them. The
    one-launch program stores its state after the wait or before it (_STATE_AFTER_WAIT): both."""
    from kernels.kda.decode import one_launch_limit

    monkeypatch.setattr(dm, "_STATE_AFTER_WAIT", state_after_wait)
    t = decode_step(n, 1, seed=11, **REAL)
    assert n * 32 * 16 <= one_launch_limit(t["q"], 1)
    got = {}
    for one in (True, False):
        d = {k: x.clone() for k, x in t.items()}
        partials = torch.zeros(n, 32, 16, dtype=torch.int64, device="cuda")
        for live in (n, max(n - 1, 1), n):
            d["state"].copy_(t["state"])
            d["num_live"].fill_(live)
            _launch(d, partials, one_launch=one)
        torch.cuda.synchronize()
        epochs = partials >> 32
        assert int(epochs.min()) == int(epochs.max()) == 3, epochs.unique()
        got[one] = d
    assert torch.equal(got[True]["out"], got[False]["out"])
    assert torch.equal(got[True]["state"], got[False]["state"])
    assert_close_step(got[True], run("torch", t))


def test_the_driver_reports_the_sms_the_context_may_use_and_the_one_launch_limit_counts_them():
    """cuCtxGetExecAffinity's SM count for the process's context (no MPS here: every SM of the device, or
    no count where the driver reports the affinity unsupported outside MPS), and one_launch_limit sized by
    it: 8 resident one-warp programs per SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with torch.cuda.device(0):
        reported = dm.context_sms()
    print(f"context_sms: {reported} of {sms}")
    assert reported in (None, sms)
    assert dm.one_launch_limit(torch.empty(1, device="cuda:0"), 1) == 8 * sms


def test_a_request_gets_the_same_bits_alone_in_one_launch_as_among_fifteen_in_two():
    """Batch 1 normalizes in the decode launch; 16 requests (8192 programs, past one_launch_limit) in a
    second launch. A request's output and state must not depend on which its batch took."""
    from kernels.kda.decode import one_launch_limit

    n = 16
    t = decode_step(n, 1, seed=12, **REAL)
    assert n * 32 * 16 > one_launch_limit(t["q"], 1) >= 32 * 16
    many = run("triton", t)
    alone = {k: t[k] for k in ("A_log", "dt_bias", "norm_weight")}
    for k in ("q", "k", "v", "a", "b", "z"):
        alone[k] = t[k][:1].clone()
    alone.update(
        state=t["state"].clone(), state_indices=t["state_indices"][:1].clone(),
        num_accepted=t["num_accepted"][:1].clone(), num_live=torch.ones(1, dtype=torch.int32, device="cuda"),
        out=torch.empty_like(t["out"][:1]),
    )  # fmt: skip
    alone = run("triton", alone)
    assert torch.equal(alone["out"][0], many["out"][0])
    slot = int(t["state_indices"][0, 0])
    assert torch.equal(alone["state"][slot], many["state"][slot])


def test_a_one_launch_wait_that_cannot_end_gives_up_and_writes_nan():
    """Partial words out of step (one tile's epoch ahead of its siblings') mean no program's wait can end:
    each gives up after SPIN_LIMIT polls and writes NaN, the kernel returns, the state still written."""
    t = decode_step(1, 1, seed=13, **REAL)
    partials = torch.zeros(1, 32, 16, dtype=torch.int64, device="cuda")
    partials[:, :, 0] = 5 << 32
    _launch(t, partials, one_launch=True)
    torch.cuda.synchronize()
    assert torch.isnan(t["out"].float()).all()
    ref = run("torch", decode_step(1, 1, seed=13, **REAL))
    torch.testing.assert_close(t["state"], ref["state"], atol=STATE_ATOL, rtol=0)


def test_one_launch_graph_replays_keep_their_words_in_step_and_equal_eager_launches():
    """The engine's path at batch 1: the backend's bound scratch, captured once, replayed on new inputs."""
    n = 1
    t = decode_step(n, 1, seed=14, **REAL)
    eager = {k: x.clone() for k, x in t.items()}
    captured = {k: x.clone() for k, x in t.items()}
    be_e, b_e = bound("triton", eager)
    be_c, b_c = bound("triton", captured)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        be_c.run(b_c)
    torch.cuda.current_stream().wait_stream(stream)
    be_e.run(b_e)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be_c.run(b_c)
    g = torch.Generator(device="cuda").manual_seed(15)
    for _ in range(4):
        for k in ("q", "k", "v", "z"):
            x = torch.randn(t[k].shape, generator=g, device="cuda").to(t[k].dtype)
            captured[k].copy_(x)
            eager[k].copy_(x)
        graph.replay()
        be_e.run(b_e)
        torch.cuda.synchronize()
        assert torch.equal(captured["out"], eager["out"]) and not torch.isnan(captured["out"].float()).any()
        assert torch.equal(captured["state"], eager["state"])
    words = b_c.scratch["norm_partials"] >> 32
    assert int(words.min()) == int(words.max()) == 5  # the warm-up and four replays (capture runs nothing)
