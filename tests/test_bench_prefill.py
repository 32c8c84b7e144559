"""bench/kda_prefill.py's equal-work guards, on CPU tensors: an in-place write to an input is found, the
restoring wrapper gives every call the same inputs, and the I/O floor counts the bytes it says."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kp = pytest.importorskip("bench.kda_prefill")


def _inputs() -> dict:
    return {n: torch.arange(8, dtype=torch.float32) + i for i, n in enumerate(kp.INPUTS)}


def test_an_in_place_write_is_found_and_undone() -> None:
    x = _inputs()
    saved = {n: t.clone() for n, t in x.items()}

    def writes_v_and_a() -> None:
        x["v"].mul_(2)
        x["a"][0] = -1

    assert kp._modified_inputs(x, saved, writes_v_and_a) == ["v", "a"]
    assert all(torch.equal(x[n], saved[n]) for n in kp.INPUTS)  # restored after the probe
    assert kp._modified_inputs(x, saved, lambda: None) == []


def test_the_restoring_call_starts_every_call_from_the_saved_inputs() -> None:
    x = _inputs()
    saved = {n: t.clone() for n, t in x.items()}
    seen: list[float] = []

    def doubles_v() -> None:
        seen.append(float(x["v"].sum()))
        x["v"].mul_(2)

    call = kp._restoring(x, saved, ["v"], doubles_v)
    for _ in range(3):
        call()
    assert seen == [float(saved["v"].sum())] * 3


def test_each_variant_is_compared_with_the_default_from_the_same_inputs_and_states() -> None:
    x = _inputs()
    x["out"], x["pool"] = torch.zeros(8), torch.ones(8)
    saved = {n: t.clone() for n, t in x.items()}
    name, other, broken = list(kp.VARIANTS)[:3]

    def default() -> None:  # output from v; the final state accumulated onto the pool it started from
        x["out"].copy_(x["v"] * 2)
        x["pool"].add_(x["v"])
        x["v"].mul_(3)  # an in-place write the next call must not see

    def off_by_a_bit() -> None:
        default()
        x["out"][5] += 0.25

    def fails() -> None:
        raise RuntimeError("no kernel")

    calls = {"ours": default, name: default, other: off_by_a_bit, broken: fails, "fla+norm": fails}
    report = kp._variants_vs_default(x, saved, calls)
    assert set(report) == {name, other, broken}
    assert report[name]["same_bits"] and report[name]["output_max_abs_diff"] == 0.0 and report[name]["finite"]
    assert not report[other]["same_bits"] and report[other]["output_max_abs_diff"] == 0.25
    assert report[other]["state_max_abs_diff"] == 0.0
    assert report[broken] == {"error": "RuntimeError: no kernel"}
    assert all(torch.equal(x[n], saved[n]) for n in (*kp.INPUTS, "pool"))  # restored after
    no_default = kp._variants_vs_default(x, saved, {**calls, "ours": fails})
    assert no_default == {"ours": {"error": "RuntimeError: no kernel"}}
    assert kp._variants_vs_default(x, saved, {"ours": fails, "fla+norm": fails}) == {}  # no variant: no run


def test_io_floor_counts_inputs_outputs_and_both_states() -> None:
    f = kp._io_floor(2, 64, 4, 4.0)
    tot, h = 128, 4
    state = 2 * h * 128 * 128 * 4
    assert f["bytes"] == 5 * tot * h * 128 * 2 + tot * h * 2 + tot * h * 128 * 2 + 2 * state
    assert f["floor_ms"] == round(f["bytes"] / 4e12 * 1e3, 4)
    assert "floor_ms" not in kp._io_floor(2, 64, 4, None)


def test_pass_bytes_name_every_launch_of_ours_and_rates_follow_from_them() -> None:
    import kernels.kda.chunk as ch
    import kernels.kda.chunk_intra as ci

    launched = {ch._gate_kernel, ci.diag_kernel, ci.merge_kernel, ci.wu_kernel, ch._state_kernel}
    launched.add(ch._gated_norm_kernel)
    nbytes = kp._pass_bytes(1, 8192, 32)
    assert set(nbytes) == {k.fn.__name__ for k in launched}  # the names the profiler reports
    e = 8192 * 32
    assert nbytes["_gate_kernel"] == e * 128 * (2 + 4) + 32 * 4 + 32 * 128 * 4  # a read, Γ written
    assert nbytes["_gated_norm_kernel"] == 3 * e * 128 * 2 + 128 * 4
    split = [
        {"kernel": "wu_kernel", "us_per_call": 100.0, "launches_per_call": 1.0},
        {"kernel": "void at::native::copy", "us_per_call": 5.0, "launches_per_call": 1.0},
        {"kernel": "_gate_kernel", "us_per_call": 0.0, "launches_per_call": 1.0},
    ]
    rates = kp.pass_rates(split, nbytes, 4.0)
    assert list(rates) == ["wu_kernel"]  # other kernels and empty times are left out
    tbps = nbytes["wu_kernel"] / 100e-6 / 1e12
    assert rates["wu_kernel"] == {
        "bytes": nbytes["wu_kernel"], "us": 100.0, "TBps": round(tbps, 3), "share_of_copy": round(tbps / 4, 3)
    }  # fmt: skip
    assert "share_of_copy" not in kp.pass_rates(split, nbytes, None)["wu_kernel"]


def test_shapes_are_picked_by_name_in_the_benchs_order_and_an_unknown_one_is_refused() -> None:
    def error(msg: str):
        raise SystemExit(msg)

    assert kp.pick_shapes("", error) == kp.SHAPES
    assert kp.pick_shapes(" 1x8192x64 , 8x1024x32", error) == ((8, 1024, 32), (1, 8192, 64))
    with pytest.raises(SystemExit, match=r"unknown shape\(s\) 1x8192x16; choose from 1x8192x32"):
        kp.pick_shapes("1x8192x32,1x8192x16", error)


def test_every_variant_sets_existing_constants_of_the_prefill_to_values_of_their_kind() -> None:
    # A misspelt constant would only show on the GPU machine, as a contender that could not run.
    import kernels.kda.chunk as chunk

    for name, settings in kp.VARIANTS.items():
        assert name.startswith("ours_") and settings, name
        for const, value in settings.items():
            assert hasattr(chunk, const), f"{name}: kernels.kda.chunk has no {const}"
            default = getattr(chunk, const)
            # a constant annotated `int | None` (a cap) takes either; any other keeps its default's type
            optional = "None" in str(chunk.__annotations__.get(const, ""))
            kinds = (int, type(None)) if optional else (type(default),)
            assert isinstance(value, kinds) and value != default, f"{name}: {const}={value!r}"
