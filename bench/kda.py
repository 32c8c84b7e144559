"""KDA decode/verify benchmark: ours vs fla-core 0.6.0 and b12x 1.5.1 side by side in one process.

Prefill is bench/kda_prefill.py. Every contender is captured in a CUDA graph and timed by GPU events in
interleaved rounds (bench/_gpu.py); eager timings are reported beside, labelled. b12x is prepared with its
autotuner on. Prints JSON and writes it to --out. A peer that cannot run is recorded as
"unavailable: <reason>".
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench._common import with_settings, write_result  # noqa: E402
from bench._gpu import TIMING, copy_bandwidth, time_contenders, warm_up_clocks  # noqa: E402

DM = importlib.import_module("kernels.kda.decode")  # the package's `decode` is the function
# The decode's launch-time switches at their defaults.
DECODE_SWITCHES = {name: getattr(DM, name) for name in DM.LAUNCH_SWITCHES}

H, K, V = 32, 128, 128
DECODE_BATCHES = (1, 8, 64, 256, 1024)
VERIFY_BATCHES = (1, 64, 256)
VERIFY_T = 4
# Our decode with one of kernels.kda.decode's launch-time switches flipped (ours_<switch>_on / _off), and with
# all of them off, timed beside the default at every batch (the reasons are beside the switches).
DECODE_VARIANTS: dict[str, dict[str, object]] = {
    **{f"ours{name.lower()}_{'off' if on else 'on'}": {name: not on} for name, on in DECODE_SWITCHES.items()},
    "ours_switches_off": dict.fromkeys(DECODE_SWITCHES, False),
    # the two-launch norm one (row, head) pair per one-warp program at every size, as before 2026-12-06
    # (kernels/kda/decode.py's _NORM_PAIRS_FROM)
    "ours_norm_one_pair": {"_NORM_PAIRS": 1, "_NORM_WARPS": 1},
}


def make_inputs(n: int, T: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """One decode/verify step at H=32, K=V=128; q/k/v are views of one packed row (b12x's mixed_qkv)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = n * T

    def rnd(*shape: int, s: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * s).to(dtype)

    mixed = rnd(rows, 3 * H * K)
    slots = rows + 1
    acc = torch.randint(1, T + 1, (n,), generator=g, device="cuda", dtype=torch.int32)
    return {
        "q": mixed[:, : H * K].view(rows, H, K),
        "k": mixed[:, H * K : 2 * H * K].view(rows, H, K),
        "v": mixed[:, 2 * H * K :].view(rows, H, V),
        "a": rnd(rows, H, K),
        "b": rnd(rows, H),
        "A_log": rnd(H, s=0.5, dtype=torch.float32),
        "dt_bias": rnd(H * K, s=0.5, dtype=torch.float32),
        "z": rnd(rows, H, V),
        "norm_weight": rnd(V, s=0.1, dtype=torch.float32) + 1,
        "state": rnd(slots, H, V, K, s=0.05, dtype=torch.float32),
        "state_indices": torch.arange(1, slots, device="cuda", dtype=torch.int32).view(n, T),
        "num_accepted": acc,
        "num_live": torch.tensor([n], device="cuda", dtype=torch.int32),
        "out": torch.empty(rows, H, V, device="cuda", dtype=torch.bfloat16),
    }


def ours(
    t: dict[str, torch.Tensor],
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    pdl: bool | None = None,
    norm: bool = True,
    one_launch: bool | None = None,
) -> Callable[[], None]:
    """Our decode as the engine launches it: the split path's partial words kept across calls (the
    backend's scratch), so each call is one epoch on them, allocated here before timing."""
    from kernels.kda.backend import DECODE_TENSORS

    args = [t[name] for name in DECODE_TENSORS]
    n, T, H, _, V = DM.check_decode_args(*args)
    bv = block_v or DM.default_launch(n, H, V, T)[0]
    shape = DM.partials_spec(n * T, H, V, bv)
    partials = None if shape is None else torch.zeros(shape, dtype=torch.int64, device="cuda")
    return lambda: DM.launch_decode(
        *args, lower_bound=-5.0, norm_eps=1e-5, scale=None, block_v=block_v, num_warps=num_warps, pdl=pdl,
        norm=norm, partials=partials, one_launch=one_launch,
    )  # fmt: skip


def one_launch_default(t: dict[str, torch.Tensor]) -> bool:
    """Whether our default launch normalizes in the decode launch itself for these inputs."""
    n, T = t["state_indices"].shape
    H, V = t["q"].shape[1], t["v"].shape[2]
    return DM.norm_in_decode_launch(t["q"], n, T, V, *DM.default_launch(n, H, V, T))


def gated_norm(t: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The same in-place gated RMSNorm kernel our split-V path uses, for like-for-like peer timing, launched
    as ours launches it (with programmatic dependent launch where the device has it: behind a kernel that
    never signals, as fla's, its launch still overlaps that kernel's end)."""
    from kernels.fused import pdl_enabled

    out, z, w = t["out"], t["z"], t["norm_weight"]
    pdl = pdl_enabled(out)
    return lambda: DM.launch_gated_norm(out, z, w, 1e-5, pdl)


def fla(t: dict[str, torch.Tensor], n: int, T: int) -> Callable[[], None]:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    common = dict(
        A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=t["state"], inplace_final_state=True,
        state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
    )  # fmt: skip
    # fla's kernel ignores strides (assumes contiguous q/k/v), so it gets contiguous copies made once here.
    t = {**t, "q": t["q"].contiguous(), "k": t["k"].contiguous(), "v": t["v"].contiguous()}
    if T == 1:
        shaped = {x: t[x].view(n, 1, *t[x].shape[1:]) for x in ("q", "k", "v", "a", "b", "out")}
        extra = dict(ssm_state_indices=t["state_indices"].view(n))
    else:
        shaped = {x: t[x].view(1, n * T, *t[x].shape[1:]) for x in ("q", "k", "v", "a", "b", "out")}
        cu = torch.arange(0, (n + 1) * T, T, device="cuda", dtype=torch.int32)
        extra = dict(
            cu_seqlens=cu, ssm_state_indices=t["state_indices"], num_accepted_tokens=t["num_accepted"]
        )
    s = shaped
    return lambda: fused_recurrent_kda_fwd(
        s["q"], s["k"], s["v"], s["a"], s["b"], out=s["out"], **common, **extra
    )


NO_NORM = (
    "ours_no_norm: our split decode kernel alone (gate, beta sigmoid, L2 norms, recurrence, state stores; "
    "its output not normalized, the norm kernel not launched), the work of fla's fused_recurrent_kda_fwd "
    "as called here, to be compared with 'fla'; 'ours' and the peers in PEERS include the gated RMSNorm"
)


B12X_ADAPTER = (
    "b12x: our adapter's run() as the engine calls it; at T > 1 that is one extra torch.mul launch per call "
    "(num_tokens = num_live * T on the device), charged to b12x; b12x_kernel: b12x's run_kda alone, "
    "num_tokens computed once before timing. Both prepared with b12x's autotuner on, benchmarking the real "
    "step; q/k/v are adjacent views of one packed row, so the adapter copies nothing."
)


def b12x(t: dict[str, torch.Tensor], n: int, T: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(adapter call, kernel-only call) over one binding, prepared once with the autotuner on."""
    from kernels.kda.b12x import B12xBackend, b12x_status
    from kernels.kda.backend import Caps

    ok, why = b12x_status("cuda")
    if not ok:
        raise RuntimeError(why)
    be = B12xBackend(autotune=True)
    plan = be.plan(Caps(H, K, V, n, T, t["state"].shape[0], device="cuda"))
    scratch = {
        m: torch.zeros(s.shape, dtype=s.dtype, device="cuda") for m, s in be.scratch_specs(plan).items()
    }
    binding = be.bind(plan, scratch=scratch, **t)
    if binding.native[2]:
        raise RuntimeError("q/k/v were not packed adjacently; b12x would pay an extra copy")
    from b12x.sequence.gdn_decode import run_kda

    if T > 1:
        torch.mul(t["num_live"], T, out=scratch["num_tokens"])
    native, c = binding.native[0], plan.caps
    return (lambda: be.run(binding)), (lambda: run_kda(native, lower_bound=c.lower_bound, eps=c.norm_eps))


def state_tbps(n: int, T: int, us: float) -> float:
    return round(n * H * K * V * 4 * (1 + T) / (us * 1e-6) / 1e12, 3)


def with_rates(t: dict[str, float], n: int, T: int) -> dict[str, float]:
    return {
        **t,
        "state_TBps": state_tbps(n, T, t["us"]),
        "state_TBps_streamed": state_tbps(n, T, t["us_streamed"]),
    }


PEERS = ("fla+norm", "b12x", "b12x_kernel")  # like for like with ours (gated RMSNorm included)


SWEEP = (
    (128, 32), (128, 16), (128, 8), (128, 4), (128, 2), (64, 8), (64, 4), (64, 2), (32, 4), (32, 1), (32, 2),
    (16, 1), (16, 2), (8, 1), (8, 2),
)  # fmt: skip


def bench_decode(
    batches: tuple[int, ...], T: int, *, peers: bool = True, sweep: bool | tuple[int, ...] = False
) -> list[dict]:
    """sweep: True times every SWEEP launch at every batch; a tuple of batches, at those only."""
    rows = []
    for n in batches:
        t = make_inputs(n, T)
        builders: dict[str, Callable[[], Callable[[], None]]] = {"ours": lambda t=t: ours(t)}
        # the same launches without programmatic dependent launch: what it saves, measured in this run
        builders["ours_no_pdl"] = lambda t=t: ours(t, pdl=False)
        # the decode kernel alone, its output left unnormalized: the same work as fla's kernel (NO_NORM)
        builders["ours_no_norm"] = lambda t=t: ours(t, norm=False)
        for name, settings in DECODE_VARIANTS.items():
            builders[name] = lambda t=t, settings=settings: with_settings(DM, settings, ours(t))
        if one_launch_default(t):
            # the same kernels with the norm in a second launch, as larger grids run it (ONE_LAUNCH)
            builders["ours_two_launches"] = lambda t=t: ours(t, one_launch=False)
        if sweep is True or (isinstance(sweep, tuple) and n in sweep):
            for bv, nw in SWEEP:
                builders[f"ours_bv{bv}_w{nw}"] = lambda t=t, bv=bv, nw=nw: ours(t, block_v=bv, num_warps=nw)
        if peers:
            builders["fla"] = lambda t=t, n=n: fla(t, n, T)

            def fla_norm(t=t, n=n):
                f, g = fla(t, n, T), gated_norm(t)
                return lambda: (f(), g())

            builders["fla+norm"] = fla_norm
            pair: list = []

            def b12x_call(i: int, t=t, n=n, pair=pair) -> Callable[[], None]:
                if not pair:
                    pair.extend(b12x(t, n, T))
                return pair[i]

            builders["b12x"] = lambda: b12x_call(0)
            builders["b12x_kernel"] = lambda: b12x_call(1)
        row: dict[str, object] = {"batch": n, "T": T}
        calls = {}
        for label, build in builders.items():
            try:
                calls[label] = build()
            except Exception as e:
                row[label] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        timings, failed = time_contenders(calls)
        for label, why in failed.items():
            row[label] = {"unavailable": why}
        for label, timing in timings.items():
            row[label] = with_rates(timing, n, T)
        ours_us = row["ours"].get("us") if isinstance(row.get("ours"), dict) else None
        peer_us = {p: row[p]["us"] for p in PEERS if "us" in row.get(p, {})}
        if ours_us and peer_us:
            fastest = min(peer_us, key=peer_us.get)
            for p, us in peer_us.items():
                row[f"speedup_vs_{p}"] = round(us / ours_us, 3)
            row["fastest_peer"] = fastest
            row["speedup_vs_fastest_peer"] = round(peer_us[fastest] / ours_us, 3)
            streamed = {p: row[p]["us_streamed"] for p in peer_us}
            row["speedup_vs_fastest_peer_streamed"] = round(
                min(streamed.values()) / row["ours"]["us_streamed"], 3
            )
        rows.append(row)
        print(f"kda: T={T} batch={n} done", file=sys.stderr, flush=True)
        del t, calls
        torch.cuda.empty_cache()
    return rows


def check_agreement(n: int = 8, T: int = VERIFY_T) -> dict[str, float]:
    """Ours vs fla+norm on one verify step from identical inputs: the comparison is like for like."""
    out = {}
    try:
        a, b = make_inputs(n, T, seed=1), make_inputs(n, T, seed=1)
        ours(a)()
        f, g = fla(b, n, T), gated_norm(b)
        f()
        g()
        out["out_max_abs_diff_vs_fla+norm"] = (a["out"].float() - b["out"].float()).abs().max().item()
        out["state_max_abs_diff_vs_fla"] = (a["state"] - b["state"]).abs().max().item()
    except Exception as e:
        out["unavailable"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64 only")
    ap.add_argument(
        "--sweep", action="store_true", help="also time our kernel at several (block_v, num_warps)"
    )
    ap.add_argument(
        "--sweep-batches", help="comma-separated batches to sweep at (implies --sweep; default: every batch)"
    )
    args = ap.parse_args()
    sweep: bool | tuple[int, ...] = args.sweep
    if args.sweep_batches:
        try:
            sweep = tuple(int(b) for b in args.sweep_batches.split(","))
        except ValueError:
            ap.error(f"--sweep-batches takes comma-separated integers, got {args.sweep_batches!r}")
    if not torch.cuda.is_available():
        sys.exit("bench/kda.py needs a CUDA device")
    decode_batches = (1, 64) if args.quick else DECODE_BATCHES
    verify_batches = (1, 64) if args.quick else VERIFY_BATCHES
    warm_up_clocks()
    result: dict[str, object] = {
        "bench": "kda",
        "shape": {"H": H, "K": K, "V": V},
        "state_TBps_definition": "batch*H*K*V*4 bytes*(1 read + T writes) / time",
        "timing": TIMING.format(rounds=20, streamed=10),
        "peers": "fla: fused_recurrent_kda_fwd (no gated norm); fla+norm: it plus our gated RMSNorm kernel "
        "(launched as ours is, with programmatic dependent launch where the device has it); " + B12X_ADAPTER,
        "no_norm": NO_NORM,
        "pdl": "ours launches the decode kernel and its norm with programmatic dependent launch on sm_90 "
        "(kernels.fused.PDL) where the grid has at most kernels.kda.decode.PDL_MAX_PROGRAMS programs; "
        "ours_no_pdl: the same launches without it",
        "one_launch": "at T = 1, on grids the SMs hold at once (kernels.kda.decode.one_launch_limit), "
        "ours normalizes in the decode launch, each program waiting for its (row, head)'s other V tiles' "
        "partial sums of squares; ours_two_launches: the same kernels with the norm in a second launch, "
        "as larger grids and verify run it (the same bits, tests/kernels/test_gpu_decode.py)",
        "variants": {k: {n: str(v) for n, v in s.items()} for k, s in DECODE_VARIANTS.items()},
        "copy_TBps": copy_bandwidth(),
    }
    result["sweep"] = {"launches": [list(x) for x in SWEEP], "batches": "all" if sweep is True else sweep}
    result["decode"] = bench_decode(decode_batches, 1, sweep=sweep)
    result["verify"] = bench_decode(verify_batches, VERIFY_T, sweep=sweep)
    result["agreement"] = check_agreement()
    write_result(result, args.out, indent=1)


if __name__ == "__main__":
    main()
