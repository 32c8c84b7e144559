"""Prefill benchmark: our Triton varlen KDA prefill vs fla's chunk_kda plus the same gated RMSNorm,
K=V=128, bf16, at 1x8192, 8x1024 and 1x32768 tokens with H=32 and 1x8192 with H=64. Prints JSON and writes
it to --out.

Equal work and equal timing: every contender's host-side metadata is built once before timing (ours: the
chunk list; fla: cu_seqlens_cpu, from which fla caches its chunk indices), every call is captured in a
CUDA graph and timed by GPU events in interleaved rounds; eager timings beside, labelled (bench/_gpu.py).

Inputs: before timing, each contender runs once on pristine inputs and the harness compares every input
tensor with a saved copy (`inputs_modified`): a kernel that writes its inputs in place (fla's chunk_kda is
reported to) would time other work on every later call. Where any contender modifies an input, every
contender's timed call first restores those inputs from the saved copies (the same copies for all alike,
`restore_in_timed_call`), and the restore alone is timed beside (`restore_only`).

I/O floor: the bytes a prefill must move at the least (read q, k, v, a, z, b and the initial state; write
the output and the final state) over the measured device copy bandwidth (`io_floor`), and each
contender's share of it (floor / time). Per pass of ours (`kernels_TBps`, with the profiler's split): the
bytes each of its six launches addresses, every element of every tensor it reads or writes counted once
(re-reads by several programs, which L2 may serve, are not), over the pass's time: how far each pass is
from the copy bandwidth, and so which one the next change should take on.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench._common import with_settings, write_result  # noqa: E402
from bench._gpu import (  # noqa: E402
    TIMING,
    copy_bandwidth,
    kernel_breakdown,
    time_contenders,
    warm_up_clocks,
)
from kernels.kda import build_chunk_metadata, prefill  # noqa: E402
from kernels.kda import chunk as chunk_mod  # noqa: E402
from kernels.kda.chunk import prefill_scratch_specs  # noqa: E402

K, V = 128, 128
# (sequences, tokens per sequence, heads)
SHAPES = ((1, 8192, 32), (8, 1024, 32), (1, 32768, 32), (1, 8192, 64))
# The tensors a prefill reads (checked for in-place writes by every contender): the data, and the sequence
# and chunk metadata (ours: idx, offs, nc, cu, slots, has; fla: cu_long), which a contender writing past its
# own buffers could also change under another's feet.
INPUTS = ("q", "k", "v", "a", "b", "z", "A_log", "dt_bias", "w", "h0")
INPUTS += ("idx", "offs", "nc", "cu", "cu_long", "slots", "has")
ROUNDS = 10
# Our prefill's variants, selected by module constants of kernels.kda.chunk: name -> {constant: value}.
# (Timed before and beaten by the module's constants: the warp counts of the diagonal, off-diagonal and
# W/U passes on 2026-12-03, bench/results/kda-prefill-h200-2026-12-03.json; the off-diagonal pass in 16-wide
# K slices, and at 4 warps in 32-wide ones, on 2026-12-04, bench/results/kda-prefill-h200-2026-12-04.json.
# One intra-chunk launch per (chunk, head) in place of the gate, diagonal, off-diagonal and W/U launches, with
# the state pass applying X itself, ran 0.93-1.03x fla+norm on 2026-12-04:
# bench/results/kda-prefill-h200-2026-12-04-rejected-fused-intra.json.)
VARIANTS: dict[str, dict[str, object]] = {
    # The variants of 2026-12-05 are in docs/KDA.md with their times. The off-diagonal blocks computed by the
    # diagonal pass became the default on 2026-12-05 (bench/results/kda-prefill-h100-2026-12-05-offdiag.json);
    # the one-program-per-chunk off-diagonal pass it replaced, timed beside it:
    "ours_off_diagonal_pass": {"_OFFDIAG_IN_DIAG": False, "_DIAG_STAGES": 3},
    # (X's blocks made by the W/U pass instead, no merge launch, ran slower and was removed; the merge at 1
    # warp spills: kernels/kda/chunk.py.) The merge's products on the tensor cores in three tf32 passes,
    # at 1 warp (163 registers: twelve programs per SM against four; 0.4% faster at 1x8192 in its one run).
    "ours_merge_tf32x3": {"_MERGE_PRECISION": "tf32x3", "_MERGE_WARPS": 1},
    # The defaults before 2026-12-06: Γ in natural units, tl.exp keeping denormals, the earlier sub-chunks'
    # key norms from their whole rows loaded again, the diagonal pass uncapped (the settings that replaced
    # them were timed in bench/results/kda-prefill-h100-2026-12-06-variants.json and -defaults.json).
    "ours_before_2026_12_06": {
        "_GCUM_LOG2": False,
        "_EXP_FTZ": False,
        "_OFFDIAG_NORMS_FROM_SLICES": False,
        "_DIAG_MAXNREG": None,
    },
    # Γ in natural units (the exponentials still flushing denormals): 1.0-1.6% slower in -defaults.json.
    "ours_gamma_natural": {"_GCUM_LOG2": False},
    # The diagonal pass's grid as (chunk, sub-chunk, head), the default before the sub-chunks of a chunk
    # were launched side by side (the same bits; 1.3-5.7% slower in -sub-first.json, most at 1x32768).
    "ours_diag_chunk_first": {"_DIAG_SUB_FIRST": False},
    # (Timed on 2026-12-06 and removed: the key norms from whole rows again, 0.9-1.5% slower, and the norms
    # from the K slices at ptxas's own 190 registers, 3.5-6.6% slower: kernels/kda/chunk.py.)
}


def _gated_norm(out: torch.Tensor, z: torch.Tensor, w: torch.Tensor, cu: torch.Tensor) -> None:
    """Our prefill's own gated RMSNorm kernel, in place on a [.., total, H, V] output."""
    import triton

    tot, H = z.shape[0], z.shape[1]
    chunk_mod._gated_norm_kernel[(triton.cdiv(tot * H, 16),)](
        out, z, w, cu, cu.shape[0] - 1, 1e-5, tot * H, H=H, V=V, ROWS=16
    )


def _fla_call(fla, x: dict[str, torch.Tensor], *, norm: bool, use_graph: bool) -> Callable[[], None]:
    """fla's serving configuration (bounded gate, β sigmoid and L2 norm in kernel, V-first state), with
    cu_seqlens_cpu made once here so fla's chunk-index cache hits on every call."""
    q, k, v, a, b = (x[n][None] for n in ("q", "k", "v", "a", "b"))
    kwargs = dict(
        initial_state=x["h0"], state_v_first=True, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
        A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=x["cu_long"], cu_seqlens_cpu=x["cu_cpu"],
    )  # fmt: skip
    if use_graph:
        kwargs["use_graph"] = True

    def call() -> None:
        with torch.inference_mode():
            o = fla(q, k, v, a, b, **kwargs)[0]
            if norm:
                _gated_norm(o, x["z"], x["w"], x["cu"])

    return call


def _inputs(nseq: int, seqlen: int, H: int) -> dict[str, torch.Tensor]:
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(nseq * seqlen * H)
    tot = nseq * seqlen
    cu_list = [i * seqlen for i in range(nseq + 1)]

    def rnd(*shape: int, s: float = 1.0, dtype: torch.dtype = bf) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * s).to(dtype)

    idx = torch.zeros(tot // 64 + nseq, 2, dtype=torch.int32)
    offs = torch.zeros(nseq + 1, dtype=torch.int32)
    n = build_chunk_metadata(cu_list, 64, idx, offs)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    return {
        "q": rnd(tot, H, K), "k": rnd(tot, H, K), "a": rnd(tot, H, K), "v": rnd(tot, H, V),
        "z": rnd(tot, H, V), "b": rnd(tot, H), "A_log": rnd(H, s=0.5, dtype=torch.float32),
        "dt_bias": rnd(H * K, dtype=torch.float32), "w": rnd(V, s=0.1, dtype=torch.float32) + 1,
        "pool": rnd(nseq + 1, H, V, K, s=0.05, dtype=torch.float32), "h0": rnd(nseq, H, V, K, s=0.05,
        dtype=torch.float32), "idx": idx.to(dev), "offs": offs.to(dev),
        "nc": torch.tensor([n], dtype=torch.int32, device=dev), "cu": cu, "cu_long": cu.long(),
        "cu_cpu": cu.long().cpu(), "slots": torch.arange(1, nseq + 1, dtype=torch.int32, device=dev),
        "has": torch.ones(nseq, dtype=torch.bool, device=dev), "out": torch.empty(tot, H, V, dtype=bf,
        device=dev),
    }  # fmt: skip


def _ours(x: dict[str, torch.Tensor]) -> Callable[[], None]:
    tot, H = x["q"].shape[0], x["q"].shape[1]
    scratch = {
        m: torch.empty(s, dtype=d, device="cuda") for m, (s, d) in prefill_scratch_specs(tot, H, K, V).items()
    }
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "w", "pool", "cu", "slots", "has", "idx")
    args = [x[n] for n in names] + [x["offs"], x["nc"], x["out"]]
    return lambda: prefill(*args, scratch=scratch)


def _modified_inputs(
    x: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], fn: Callable[[], None]
) -> list[str]:
    """Run `fn` once on pristine inputs; the names of the inputs it wrote. The inputs are restored after."""
    _put_back(x, saved, INPUTS)
    fn()
    _sync()
    changed = [n for n in INPUTS if not torch.equal(x[n], saved[n])]
    _put_back(x, saved, INPUTS)
    _sync()
    return changed


def _put_back(x: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], names: Iterable[str]) -> None:
    """Copy the saved `names` back into x's tensors (in place: captured graphs keep their addresses)."""
    for n in names:
        x[n].copy_(saved[n])


def _error_line(e: Exception) -> str:
    """An exception in one line of at most 200 characters, for a result's JSON."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _variants_vs_default(
    x: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], calls: dict[str, Callable[[], None]]
) -> dict[str, dict]:
    """Each variant of ours run once from the same inputs and initial states as the default: whether its
    output and final states are the default's bits, and how far they are from them where not (outside any
    timed region; the inputs and the state pool restored after)."""
    names = [n for n in VARIANTS if n in calls]
    if not names:
        return {}
    pool0 = x["pool"].clone()

    def restore() -> None:
        _put_back(x, saved, INPUTS)
        x["pool"].copy_(pool0)

    def once(fn: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        restore()
        fn()
        _sync()
        return x["out"].to(torch.float32, copy=True), x["pool"].clone()

    report: dict[str, dict] = {}
    try:
        ref_out, ref_pool = once(calls["ours"])
    except Exception as e:  # nothing to compare with; the timing reports the default's failure too
        return {"ours": {"error": _error_line(e)}}
    scale = float(ref_out.abs().max())
    for name in names:
        try:
            out, pool = once(calls[name])
        except Exception as e:  # reported with the timing's own failure too
            report[name] = {"error": _error_line(e)}
            continue
        report[name] = {
            "same_bits": bool(torch.equal(out, ref_out) and torch.equal(pool, ref_pool)),
            "output_max_abs_diff": float((out - ref_out).abs().max()),
            "output_default_max_abs": scale,
            "state_max_abs_diff": float((pool - ref_pool).abs().max()),
            "finite": bool(torch.isfinite(out).all() and torch.isfinite(pool).all()),
        }
    restore()
    _sync()
    return report


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _restoring(x: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], names: list[str], fn):
    """fn preceded by restoring `names` from their saved copies (captured with it, so timed with it)."""

    def call() -> None:
        _put_back(x, saved, names)
        fn()

    return call


def _io_floor(nseq: int, seqlen: int, H: int, copy_TBps: float | None) -> dict:
    """The least bytes a prefill moves: q, k, v, a, z (bf16, [T, H, 128]), b (bf16, [T, H]) and the fp32
    initial state read; the bf16 output and the fp32 final state written."""
    tot = nseq * seqlen
    state = nseq * H * V * K * 4
    nbytes = 5 * tot * H * K * 2 + tot * H * 2 + tot * H * V * 2 + 2 * state
    floor = {"bytes": nbytes}
    if copy_TBps:
        floor["copy_TBps"] = copy_TBps
        floor["floor_ms"] = round(nbytes / (copy_TBps * 1e12) * 1e3, 4)
    return floor


def _pass_bytes(nseq: int, seqlen: int, H: int) -> dict[str, int]:
    """Bytes each launch of our prefill addresses at the module's defaults (kernels/kda/chunk.py and
    chunk_intra.py: the off-diagonal blocks in the diagonal pass, X's lower triangle read), each element
    once (re-reads, which L2 may serve, are not counted), for sequences of whole 64-token chunks: rows of P
    and X hold 64 columns; the diagonal pass writes a row's 16-column diagonal block and the blocks left of
    it (24 columns a row on average over the four sub-chunks), nothing right of it; the merge reads X's
    blocks on and left of the diagonal and rewrites those left of it; the W/U pass reads X's rows on and left
    of the diagonal (32.5 a row on average), the state pass P's rows whole."""
    e = nseq * seqlen * H  # (token, head) rows
    bf, f4 = 2, 4
    kb, vb = e * K * bf, e * V * bf  # one bf16 [T, H, 128] tensor
    g = e * K * f4  # Γ, fp32
    state = nseq * H * V * K * f4
    return {
        "_gate_kernel": kb + H * f4 + H * K * f4 + g,
        # q, k, Γ, b read; Q̃, K̄, the norms, P's and X's (A's) blocks on and left of the diagonal written
        "diag_kernel": 2 * kb + g + e * bf + 2 * kb + e * 2 * f4 + e * 40 * bf + e * 40 * f4,
        # X's diagonal and A's off-diagonal blocks read, X's off-diagonal blocks written
        "merge_kernel": e * 40 * f4 + e * 24 * f4,
        # X's rows on and left of the diagonal, b, the key norms, k, Γ, v read; W, U written
        "wu_kernel": e * 65 // 2 * f4 + e * bf + e * f4 + kb + g + vb + kb + vb,
        # Q̃, K̄, W, U, P's rows and Γ at each chunk's last row read, the state read and written, the output
        "_state_kernel": 3 * kb + vb + e * 64 * bf + (e // 64) * K * f4 + 2 * state + vb,
        # the output and z read, the weight, the output written
        "_gated_norm_kernel": 2 * vb + V * f4 + vb,
    }


def pass_rates(breakdown: list[dict], nbytes: dict[str, int], copy_TBps: float | None) -> dict[str, dict]:
    """Each pass of ours in the profiler's split (kernel name, us per call): its bytes, TB/s and share of
    the copy bandwidth."""
    out: dict[str, dict] = {}
    for k in breakdown:
        name, us = k.get("kernel"), k.get("us_per_call")
        if name in nbytes and isinstance(us, int | float) and us > 0:
            rate = nbytes[name] / (us * 1e-6) / 1e12
            out[name] = {"bytes": nbytes[name], "us": us, "TBps": round(rate, 3)}
            if copy_TBps:
                out[name]["share_of_copy"] = round(rate / copy_TBps, 3)
    return out


def bench_shape(
    nseq: int,
    seqlen: int,
    H: int,
    fla,
    *,
    breakdown: bool,
    copy_TBps: float | None,
    exclude: frozenset[str] = frozenset(),
    breakdown_variants: bool = False,
) -> dict:
    x = _inputs(nseq, seqlen, H)
    saved = {n: x[n].clone() for n in INPUTS}
    ours = _ours(x)
    calls: dict[str, Callable[[], None]] = {"ours": ours}
    calls.update({name: with_settings(chunk_mod, settings, ours) for name, settings in VARIANTS.items()})
    row: dict = {"tokens": f"{nseq}x{seqlen}", "H": H}
    if fla is not None:
        calls["fla+norm"] = _fla_call(fla, x, norm=True, use_graph=False)
        calls["fla+norm(use_graph)"] = _fla_call(fla, x, norm=True, use_graph=True)
        calls["fla"] = _fla_call(fla, x, norm=False, use_graph=False)
    calls = {k: fn for k, fn in calls.items() if k not in exclude}
    modified: dict[str, list[str]] = {}
    for label in ("ours", "fla+norm", "fla+norm(use_graph)", "fla"):
        if label in calls:
            try:
                modified[label] = _modified_inputs(x, saved, calls[label])
            except Exception as e:  # reported with the timing's own failure below
                modified[label] = [f"could not run: {_error_line(e)}"[:200]]
    row["inputs_modified"] = modified
    restore = sorted({n for names in modified.values() for n in names if n in INPUTS})
    if restore:  # equal work: every timed call starts from the same inputs
        calls = {k: _restoring(x, saved, restore, fn) for k, fn in calls.items()}
        calls["restore_only"] = _restoring(x, saved, restore, lambda: None)
    row["restore_in_timed_call"] = restore
    if "ours" in calls:
        row["variants_vs_default"] = _variants_vs_default(x, saved, calls)
    timings, failed = time_contenders(calls, rounds=ROUNDS, singles=3, streamed=5)
    row.update({k: {"unavailable": why} for k, why in failed.items()})
    row.update(
        {k: {m.replace("us", "ms"): round(us / 1e3, 4) for m, us in t.items()} for k, t in timings.items()}
    )
    floor = _io_floor(nseq, seqlen, H, copy_TBps)
    if "floor_ms" in floor:
        floor["share_of_floor"] = {
            k: round(floor["floor_ms"] * 1e3 / t["us"], 3) for k, t in timings.items() if k != "restore_only"
        }
    row["io_floor"] = floor
    peers = [p for p in ("fla+norm", "fla+norm(use_graph)") if p in timings]
    if "ours" in timings and peers:
        fastest = min(peers, key=lambda p: timings[p]["us"])
        row["fastest_peer"] = fastest
        row["speedup_vs_fastest_peer"] = round(timings[fastest]["us"] / timings["ours"]["us"], 3)
        row["speedup_vs_fastest_peer_eager"] = round(
            min(timings[p]["eager_us"] for p in peers) / timings["ours"]["eager_us"], 3
        )
    if breakdown:
        split = ("ours", "fla+norm", *(VARIANTS if breakdown_variants else ()))
        row["kernels_us"] = {k: kernel_breakdown(calls[k]) for k in split if k in timings}
        ours_split = row["kernels_us"].get("ours")
        if isinstance(ours_split, list):
            row["kernels_TBps"] = pass_rates(ours_split, _pass_bytes(nseq, seqlen, H), copy_TBps)
    del x, saved
    torch.cuda.empty_cache()
    return row


def pick_shapes(spec: str, error: Callable[[str], object]) -> tuple[tuple[int, int, int], ...]:
    """The SHAPES named in spec ("NxTxH,..."), in SHAPES' order; all of them when spec is empty."""
    names = {f"{n}x{t}x{h}": (n, t, h) for n, t, h in SHAPES}
    wanted = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in names]
    if unknown:
        error(f"--shapes: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return tuple(v for k, v in names.items() if k in wanted) if wanted else SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiler's per-kernel split")
    ap.add_argument("--exclude", default="", help="comma-separated contenders not to run (recorded)")
    ap.add_argument(
        "--breakdown-variants", action="store_true", help="the per-kernel split of every variant of ours too"
    )
    ap.add_argument(
        "--shapes",
        default="",
        help="comma-separated shapes to run, NxTxH as in SHAPES (e.g. 1x8192x64); default: all (recorded)",
    )
    ap.add_argument(
        "--profile-calls",
        type=int,
        default=0,
        help="no timing and no JSON: run ours eagerly this many times at the first shape asked for, for a "
        "profiler that wraps the process (scripts/gpu-check ncu)",
    )
    args = ap.parse_args()
    shapes = pick_shapes(args.shapes, ap.error)
    if not torch.cuda.is_available():
        sys.exit("bench/kda_prefill.py needs a CUDA device")
    if args.profile_calls > 0:
        call = _ours(_inputs(*shapes[0]))
        for _ in range(args.profile_calls):
            call()
        _sync()
        return
    exclude = frozenset(x for x in args.exclude.split(",") if x)
    try:
        from fla.ops.kda import chunk_kda as fla
    except Exception as exc:  # the peer is optional: record why it is missing
        fla, why = None, f"unavailable: fla-core not importable: {type(exc).__name__}: {exc}"
    else:
        why = "fla-core chunk_kda, with our gated RMSNorm kernel on its output (fla+norm)"
    warm_up_clocks()
    copy = copy_bandwidth()
    rows: list[dict] = []
    result = {
        "bench": "kda_prefill",
        "shape": {"H": sorted({h for _, _, h in shapes}), "K": K, "V": V, "chunk": 64},
        "shapes": [f"{n}x{t}x{h}" for n, t, h in shapes],
        "copy_bandwidth": copy,
        "state": "ours reads its initial state from a pool slot and writes the final state back into it (the "
        "serving layout: same bytes every call); fla reads h0 and writes a new final-state tensor",
        "work": "ours: gate, beta sigmoid, L2 norm, chunked recurrence and gated RMSNorm into a pool slot; "
        "fla+norm: the same in chunk_kda plus our gated RMSNorm kernel; fla: chunk_kda alone",
        "variants": {k: {n: str(v) for n, v in s.items()} for k, s in VARIANTS.items()},
        "excluded": sorted(exclude),
        "breakdown_variants": args.breakdown_variants,
        "peer": why,
        "timing": TIMING.format(rounds=ROUNDS, streamed=5).replace("us", "ms") + "; figures in ms",
        "prefill": rows,
    }
    for n, s, h in shapes:
        rows.append(
            bench_shape(
                n,
                s,
                h,
                fla,
                breakdown=not args.no_breakdown,
                copy_TBps=copy["max"],
                exclude=exclude,
                breakdown_variants=args.breakdown_variants,
            )
        )
        print(f"kda_prefill: {rows[-1]['tokens']} done", file=sys.stderr, flush=True)
        # Written after every shape, so a run cut short by its caller's time limit keeps what it measured
        # (`complete` says whether every shape asked for is in); printed once, at the end.
        done = len(rows) == len(shapes)
        write_result({**result, "complete": done}, args.out, indent=1, echo=done)


if __name__ == "__main__":
    main()
