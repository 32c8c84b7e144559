"""Triton decode/verify (interpreted on CPU, compiled on a GPU) against the torch backend and references."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from kernels.kda import Caps, bounded_gate, gated_rmsnorm, get_backend, naive_recurrent
from kernels.kda.backend import DECODE_TENSORS, refuse_capture
from kernels.kda.decode import LAUNCH_SWITCHES, decode, describe_launch, launch_decode

from .conftest import DEVICE, decode_step

# the module (the package's `decode` is the function), for the settings the tests flip
dm = importlib.import_module("kernels.kda.decode")

OUT_ATOL = 2e-2  # bf16 output (one rounding of the core output, one of the normed output)
STATE_ATOL = 1e-5


def run(backend: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    t = {name: x.clone() for name, x in t.items()}
    n, T = t["state_indices"].shape
    H, K, V = t["q"].shape[1], t["q"].shape[2], t["v"].shape[2]
    be = get_backend(backend)
    plan = be.plan(Caps(H, K, V, n, T, t["state"].shape[0], device=DEVICE))
    be.run(be.bind(plan, scratch=scratch_for(be, plan), **t))
    return t


def scratch_for(be, plan) -> dict[str, torch.Tensor]:
    """The backend's scratch for `plan`, uninitialized (bind must zero what needs it)."""
    return {
        m: torch.full(s.shape, -1, dtype=s.dtype, device=DEVICE) for m, s in be.scratch_specs(plan).items()
    }


def assert_same_step(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    torch.testing.assert_close(a["out"].float(), b["out"].float(), atol=OUT_ATOL, rtol=0)
    torch.testing.assert_close(a["state"], b["state"], atol=STATE_ATOL, rtol=0)


def test_decode_matches_the_torch_backend():
    t = decode_step(4, 1)
    assert_same_step(run("triton", t), run("torch", t))


def test_verify_with_mixed_accepted_counts_matches_the_torch_backend():
    t = decode_step(3, 4, seed=1)
    t["num_accepted"] = torch.tensor([1, 3, 4], dtype=torch.int32, device=DEVICE)
    assert_same_step(run("triton", t), run("torch", t))


def test_verify_reads_column_accepted_minus_one_and_writes_every_column():
    # Independent of the torch backend: gates + naive_recurrent + gated norm for one request.
    t = decode_step(1, 4, seed=2)
    t["num_accepted"][0] = 3
    got = run("triton", t)
    src = int(t["state_indices"][0, 2])
    g = bounded_gate(t["a"], t["A_log"], t["dt_bias"])[None]
    beta = torch.sigmoid(t["b"].float())[None]
    f = [t[x].float()[None] for x in ("q", "k", "v")]
    for j in range(4):
        o, S = naive_recurrent(
            f[0][:, : j + 1], f[1][:, : j + 1], f[2][:, : j + 1], g[:, : j + 1], beta[:, : j + 1],
            initial_state=t["state"][src][None],
        )  # fmt: skip
        torch.testing.assert_close(got["state"][int(t["state_indices"][0, j])], S[0], atol=STATE_ATOL, rtol=0)
    want = gated_rmsnorm(o[0], t["z"], t["norm_weight"])
    torch.testing.assert_close(got["out"].float(), want.bfloat16().float(), atol=OUT_ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_null_slot_rows_output_zero_and_touch_no_state(backend):
    t = decode_step(3, 2, seed=3)
    t["state_indices"][1] = 0  # a padding request
    got = run(backend, t)
    assert torch.equal(got["out"][2:4].float(), torch.zeros_like(got["out"][2:4].float()))
    written = {int(s) for s in t["state_indices"].flatten()} - {0}
    untouched = [s for s in range(t["state"].shape[0]) if s not in written]
    assert torch.equal(got["state"][untouched], t["state"][untouched])  # slot 0 included


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_null_destination_column_is_not_written(backend):
    t = decode_step(2, 3, seed=4)
    t["state_indices"][0, 1] = 0
    got = run(backend, t)
    assert torch.equal(got["state"][0], t["state"][0])
    assert not torch.equal(
        got["state"][int(t["state_indices"][0, 2])], t["state"][int(t["state_indices"][0, 2])]
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_at_or_beyond_num_live_output_zero_and_touch_no_state(backend):
    t = decode_step(4, 2, seed=5)
    t["num_live"][0] = 2
    got = run(backend, t)
    assert torch.equal(got["out"][4:].float(), torch.zeros(4, *got["out"].shape[1:]))
    dead = t["state_indices"][2:].flatten().tolist()
    assert torch.equal(got["state"][dead], t["state"][dead])
    assert not torch.equal(got["state"][t["state_indices"][:2].flatten().tolist()], t["state"][[1, 2, 3, 4]])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_verify_equals_the_same_tokens_one_at_a_time_byte_for_byte(backend):
    n, T = 2, 4
    t = decode_step(n, T, seed=6)
    t["num_accepted"] = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    together = run(backend, t)
    state = t["state"].clone()
    outs = []
    for j in range(T):
        one = {name: t[name] for name in ("A_log", "dt_bias", "norm_weight", "num_live")}
        for name in ("q", "k", "v", "a", "b", "z"):
            one[name] = t[name].view(n, T, *t[name].shape[1:])[:, j].contiguous()
        read = (
            t["state_indices"][torch.arange(n), t["num_accepted"] - 1]
            if j == 0
            else t["state_indices"][:, j - 1]
        )
        state[t["state_indices"][:, j].long()] = state[read.long()]  # carry the running state into column j
        one.update(
            state=state, state_indices=t["state_indices"][:, j : j + 1].contiguous(),
            num_accepted=torch.ones(n, dtype=torch.int32, device=DEVICE), out=torch.empty_like(one["z"]),
        )  # fmt: skip
        one = run(backend, one)
        state = one["state"]
        outs.append(one["out"])
    assert torch.equal(together["out"].view(n, T, *together["out"].shape[1:]), torch.stack(outs, 1))
    cols = t["state_indices"].flatten().tolist()
    assert torch.equal(together["state"][cols], state[cols])


def test_fused_norm_path_matches_the_split_path():
    t = decode_step(2, 2, seed=7)
    fused, split = ({k: x.clone() for k, x in t.items()} for _ in range(2))
    for d, bv in ((fused, 32), (split, 16)):
        launch_decode(
            *(d[x] for x in DECODE_TENSORS), lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=bv
        )
    assert_same_step(fused, split)
    assert_same_step(fused, run("torch", t))


def test_strided_token_rows_are_honoured():
    t = decode_step(2, 1, seed=8)
    rows, H, K = t["q"].shape
    packed = torch.zeros(rows, 3, H, K, dtype=t["q"].dtype, device=DEVICE)
    packed[:, 0], packed[:, 1] = t["q"], t["k"]
    strided = dict(t, q=packed[:, 0], k=packed[:, 1])
    assert not strided["q"].is_contiguous()
    assert_same_step(run("triton", strided), run("torch", t))


BAD = [
    ("q", lambda t: t["q"].double(), "q must be torch.bfloat16"),
    ("k", lambda t: t["k"][:, :, :8], "k must have shape"),
    ("b", lambda t: t["b"][:, :1], "b must have shape"),
    ("dt_bias", lambda t: t["dt_bias"].view(2, -1), "dt_bias must have shape"),
    (
        "state",
        lambda t: t["state"].transpose(-1, -2).contiguous().transpose(-1, -2),
        "state must be contiguous within",
    ),
    ("state", lambda t: t["state"].bfloat16(), "state must be torch.float32"),
    ("state_indices", lambda t: t["state_indices"].long(), "state_indices must be int32"),
    ("num_live", lambda t: t["num_live"].repeat(2), "num_live must have shape"),
    (
        "v",
        lambda t: t["v"].transpose(-1, -2).contiguous().transpose(-1, -2),
        "v must be contiguous in its last",
    ),
    (
        "z",
        lambda t: torch.empty_strided(t["z"].shape, (64, 1, 2), dtype=t["z"].dtype),
        "z must be contiguous",
    ),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_are_refused_with_a_clear_error(name, mutate, message):
    t = decode_step(2, 2)
    t[name] = mutate(t)
    for call in (lambda: decode(**t), lambda: run("triton", t)):
        with pytest.raises(ValueError, match=message):
            call()


def test_bind_refuses_tensors_that_disagree_with_the_plan():
    t = decode_step(2, 2)
    be = get_backend("triton")
    plan = be.plan(Caps(2, 16, 32, 3, 2, t["state"].shape[0], device=DEVICE))
    with pytest.raises(ValueError, match="max_requests=2 but the plan was made for 3"):
        be.bind(plan, scratch=scratch_for(be, plan), **t)
    plan = be.plan(Caps(2, 16, 32, 2, 2, t["state"].shape[0], device=DEVICE))
    with pytest.raises(ValueError, match="missing tensors"):
        be.bind(plan, scratch=scratch_for(be, plan), **{k: x for k, x in t.items() if k != "z"})
    with pytest.raises(ValueError, match="scratch must hold exactly"):
        be.bind(plan, scratch={"x": t["b"]}, **t)


def test_triton_plan_records_its_launch_and_run_honours_a_fused_plan():
    t = decode_step(3, 2, seed=9)
    be = get_backend("triton")
    plan = be.plan(Caps(2, 16, 32, 3, 2, t["state"].shape[0], device=DEVICE))
    extra = dict(plan.extra)
    assert (plan.block_v, plan.num_warps) == (8, 1) and extra["launch"].startswith("split: 4 programs")
    assert "one_launch_limit" in extra["launch"]  # the plan says where the norm runs
    assert "sweep" in extra["why"]
    fused_plan = dataclasses.replace(plan, block_v=32, num_warps=2)
    assert describe_launch(32, 2, 32).startswith("fused")
    split, fused = ({k: x.clone() for k, x in t.items()} for _ in range(2))
    be.run(be.bind(plan, scratch=scratch_for(be, plan), **split))
    be.run(be.bind(fused_plan, scratch=scratch_for(be, fused_plan), **fused))
    assert_same_step(fused, split)
    assert_same_step(fused, run("torch", t))
    # The fused path rounds to bf16 once, the split path twice: different bits prove the plan was honoured.
    assert not torch.equal(fused["out"], split["out"])


def test_the_torch_reference_refuses_to_run_inside_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture; use the 'triton'"):
        refuse_capture(torch.device("cuda", 0), "the torch KDA decode reference")
    refuse_capture(torch.device("cpu"), "the torch KDA decode reference")  # a CPU run is never captured


def test_the_pdl_limit_takes_pdl_exactly_where_the_recorded_h200_run_found_it_faster() -> None:
    # bench/results/kda-h200-2026-12-05-pdl-every-batch.json timed every decode and verify batch with PDL
    # ('ours') and without ('ours_no_pdl') in one run: PDL_MAX_PROGRAMS must take PDL at each batch whose
    # grid it admits only where PDL was the faster there, and leave it off wherever it was slower.
    import json
    from pathlib import Path

    from kernels.kda.decode import PDL_MAX_PROGRAMS, default_launch

    path = Path(__file__).resolve().parents[2] / "bench/results/kda-h200-2026-12-05-pdl-every-batch.json"
    run = json.loads(path.read_text())
    H, V = run["shape"]["H"], run["shape"]["V"]
    rows = run["decode"] + run["verify"]
    assert len(rows) == 8
    for row in rows:
        n, T = row["batch"], row["T"]
        bv, _ = default_launch(n, H, V, T)
        with_pdl = n * H * (V // bv) <= PDL_MAX_PROGRAMS
        faster = row["ours"]["us_streamed"] < row["ours_no_pdl"]["us_streamed"]
        assert with_pdl == faster, (n, T, row["ours"], row["ours_no_pdl"])


def test_the_split_decode_without_its_norm_writes_the_core_output_and_the_same_state():
    # launch_decode(norm=False), bench/kda.py's like-for-like with fla's kernel (which has no norm): the
    # core output o, the state the normed launch writes, and a refusal where the norm is in-kernel.
    t = decode_step(2, 1, seed=7)
    normed, core = ({name: x.clone() for name, x in t.items()} for _ in range(2))
    for got, norm in ((normed, True), (core, False)):
        args = [got[name] for name in DECODE_TENSORS]
        launch_decode(*args, lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=8, num_warps=1, norm=norm)
    assert torch.equal(core["state"], normed["state"])
    g = bounded_gate(t["a"], t["A_log"], t["dt_bias"])
    beta = torch.sigmoid(t["b"].float())
    for r in range(2):
        f = [t[x].float()[r : r + 1, None] for x in ("q", "k", "v")]
        gb = (g[r : r + 1, None], beta[r : r + 1, None])
        o, _ = naive_recurrent(*f, *gb, initial_state=t["state"][r + 1][None])
        torch.testing.assert_close(core["out"][r].float(), o[0, 0].bfloat16().float(), atol=OUT_ATOL, rtol=0)
        want = gated_rmsnorm(o[0, 0], t["z"][r], t["norm_weight"])
        torch.testing.assert_close(normed["out"][r].float(), want.bfloat16().float(), atol=OUT_ATOL, rtol=0)
    args = [t[name] for name in DECODE_TENSORS]
    with pytest.raises(ValueError, match="needs block_v < V"):
        launch_decode(*args, lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=32, num_warps=1, norm=False)


def test_the_split_norm_sums_partial_words_that_advance_one_epoch_a_call_and_bind_zeroes_them():
    """The split path's norm reads one partial word per (row, head, V tile): the tile's fp32 sum of squares
    in its low 32 bits, the call count (epoch) in its high. Kept across calls (the backend's scratch,
    zeroed at bind), every word of a (row, head) advances together, a dead row's words carry zero, and the
    normed output is the torch backend's. The one-launch wait is never taken here: the interpreter runs one
    program after another, so one_launch_limit is 0 and forcing it is refused."""
    from kernels.kda.decode import one_launch_limit

    t = decode_step(3, 1, seed=21)
    be = get_backend("triton")
    plan = be.plan(Caps(2, 16, 32, 3, 1, t["state"].shape[0], device=DEVICE))
    scratch = scratch_for(be, plan)
    assert set(scratch) == {"norm_partials"} and scratch["norm_partials"].shape == (3, 2, 4)
    d = {k: x.clone() for k, x in t.items()}
    binding = be.bind(plan, scratch=scratch, **d)
    assert not scratch["norm_partials"].any()
    d["num_live"].fill_(2)
    for _ in range(2):
        d["state"].copy_(t["state"])
        be.run(binding)
    words = scratch["norm_partials"]
    assert (words >> 32).eq(2).all()
    values = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    assert values[2].eq(0).all() and values[:2].gt(0).all()
    core = {k: x.clone() for k, x in t.items()}
    core["num_live"].fill_(2)
    launch_decode(
        *(core[x] for x in DECODE_TENSORS), lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=8, norm=False
    )  # fmt: skip
    sums = core["out"].float().view(3, 2, 4, 8).square().sum(-1)
    torch.testing.assert_close(values[:2], sums[:2], rtol=1e-6, atol=0)
    ref = {k: x.clone() for k, x in t.items()}
    ref["num_live"].fill_(2)
    assert_same_step(d, run("torch", ref))
    assert one_launch_limit(t["q"], 1) == 0
    with pytest.raises(ValueError, match="the one-launch norm needs T = 1 and at most 0 programs"):
        launch_decode(
            *(t[x] for x in DECODE_TENSORS), lower_bound=-5.0, norm_eps=1e-5, scale=None, one_launch=True
        )  # fmt: skip


@pytest.mark.parametrize(
    "off", [(), *((s,) for s in LAUNCH_SWITCHES), LAUNCH_SWITCHES], ids=lambda o: "+".join(o) or "none"
)
def test_every_setting_of_the_launch_switches_matches_the_torch_backend(monkeypatch, off):
    # bench/kda.py times each switch turned off beside the default: each setting must compute the step.
    for name in off:
        monkeypatch.setattr(dm, name, False)
    for n, T, seed in ((3, 1, 11), (2, 4, 12)):
        t = decode_step(n, T, seed=seed)
        if T > 1:
            t["num_accepted"] = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
        assert_same_step(run("triton", t), run("torch", t))


def test_the_one_launch_limit_counts_the_sms_the_context_may_use(monkeypatch):
    """one_launch_limit sizes the grid by the SMs this process's CUDA context may use: fewer than the
    device's under an MPS active-thread percentage, where programs past them would never be resident and
    the wait would end in NaN. The count comes from the driver (cuCtxGetExecAffinity's SM count), read
    through cuda.h's struct; a driver that does not say leaves the device's count."""
    import ctypes

    assert dm.usable_sms(132, None) == 132
    assert dm.usable_sms(132, 66) == 66 and dm.usable_sms(132, 200) == 132

    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(dm._ExecAffinityParam), ctypes.c_int)
    def get(param, kind):
        calls.append(kind)
        param.contents.type = kind
        param.contents.sm_count = 66
        return 0

    class Driver:
        cuCtxGetExecAffinity = get

    monkeypatch.setattr(dm.ctypes, "CDLL", lambda name: Driver())
    assert dm.context_sms() == 66 and calls == [0]  # CU_EXEC_AFFINITY_TYPE_SM_COUNT

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(dm._ExecAffinityParam), ctypes.c_int)
    def unsupported(param, kind):
        return 224  # CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY

    Driver.cuCtxGetExecAffinity = unsupported
    assert dm.context_sms() is None

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(dm.ctypes, "CDLL", no_driver)
    assert dm.context_sms() is None

    # one_launch_limit on a (stand-in) CUDA tensor of a 132-SM device whose context may use 66
    from contextlib import nullcontext
    from types import SimpleNamespace

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dm, "_SMS", {})
    monkeypatch.setattr(dm, "context_sms", lambda: 66)
    monkeypatch.setattr(dm.torch.cuda, "device", lambda idx: nullcontext())
    monkeypatch.setattr(
        dm.torch.cuda, "get_device_properties", lambda idx: SimpleNamespace(multi_processor_count=132)
    )
    t = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    assert dm.one_launch_limit(t, 1) == 8 * 66 and dm.one_launch_limit(t, 2) == 4 * 66


def test_the_two_launch_norm_gives_the_same_bits_at_either_program_shape(monkeypatch):
    """The second launch's gated norm runs one (row, head) pair per one-warp program on small launches and
    _NORM_PAIRS per program on large ones (kernels/kda/decode.py's _NORM_PAIRS_FROM): both shapes give the
    same bits and the torch backend's step, a last program's pairs past the end masked."""
    assert dm.norm_program_shape(dm._NORM_PAIRS_FROM - 1) == (1, 1)
    assert dm.norm_program_shape(dm._NORM_PAIRS_FROM) == (dm._NORM_PAIRS, dm._NORM_WARPS)
    t = decode_step(3, 1, seed=31)  # 3 rows x 2 heads: 6 pairs, one 8-pair program with 2 past the end
    t["num_live"].fill_(2)
    got = {}
    for pairs_from in (1, 10**9):
        monkeypatch.setattr(dm, "_NORM_PAIRS_FROM", pairs_from)
        got[pairs_from] = run("triton", t)
    assert torch.equal(got[1]["out"], got[10**9]["out"]) and torch.equal(got[1]["state"], got[10**9]["state"])
    assert_same_step(got[1], run("torch", t))
