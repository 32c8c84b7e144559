"""Decode-sized projections: kernels.fused.linear_small (every launch shape of a sweep) against cuBLAS
(torch's F.linear, with its own heuristic and through TunableOp) at the proxy preset's weight shapes,
bf16, for M = 1 and 32 rows; and each projection the decode step folds glue into (kernels/fused.py: the
residual add and the next norm but its 1/rms after out_proj / o_proj and down, the norm's 1/rms after
in_proj and qkv, that and SiLU-and-multiply after gate_up; the add, the final norm and the fp32 head at
the end) as the unfused kernels then the projection, against the one launch that folds them in. Prints
JSON and writes it to --out (rewritten after every case, `complete` saying whether all are in); `cublas_*`
fields are the faster of the two cuBLAS contenders (named in `peer`).

Equal work: every contender computes y = x @ W.T with fp32 accumulation into bf16 from the same
inputs; each call is captured in a CUDA graph and timed by GPU events in interleaved rounds
(bench/_gpu.py). Each case reports the bandwidth of the weight read (the bytes a projection of a few rows
must move) against the measured copy ceiling, the peer's figure, the module's launch shape and the sweep's
best. `suggested` picks, per weight shape, the launch shape with the least time at 1 row among those no
slower than the module's at 32 rows, and says whether linear_small (with the fold, where the step folds
one) beats the unfused path with cuBLAS at both row counts: what kernels.fused.SMALL_SHAPES should hold.
With --fold-sweep each fold is timed at every launch shape of the sweep too (`fastest_folded` names
the best), since an epilogue may want another shape than the plain projection; --fold-kinds keeps only
the cases that fold one of the given kinds (add_norm: out_proj / o_proj and MLP down).
Launches here are PDL launches as in the engine, but a graph of one kernel has nothing to overlap:
bench/graphs.py times PDL in the step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._common import with_settings, write_result  # noqa: E402
from bench._gpu import TIMING, copy_bandwidth, time_contenders, warm_up_clocks  # noqa: E402
from kernels import fused  # noqa: E402

HIDDEN, MLP, VOCAB = 4096, 8192, 260
# (name, N, K, the fold the step's launch of it does: "norm" (the deferred norm's 1/rms: the norm's
# kernel before it unfused), "swiglu" (that and SiLU-and-multiply after it: the norm's kernel before and
# silu_mul's after it unfused), "add_norm" (the residual add and the next norm but its 1/rms: the norm's
# kernel with the add after it unfused, timed with the projection that reads it) or None) of the proxy
# preset's decode projections (qualify/engine/config.py)
SHAPES = (
    ("kda in_proj", 3 * 32 * 128 + 32 + 2 * 128, HIDDEN, "norm"),
    ("mlp gate_up", 2 * MLP, HIDDEN, "swiglu"),
    ("mlp down", HIDDEN, MLP, "add_norm"),
    ("attention qkv", (32 + 2 * 4) * 128, HIDDEN, "norm"),
    ("out_proj / o_proj", HIDDEN, 32 * 128, "add_norm"),
)
ROWS = (1, 32)  # a plain decode step of up to 16 rows runs the BM=16 tile; a verify of 8 x 4, BM=32
ROUNDS = 5
MODULE = (fused._BN, fused._BK, fused._WARPS, fused._STAGES, fused._SPLIT)  # for shapes off the table
# BN, BK, warps, stages, split. 8 warps and 16-column tiles lost everywhere on 2026-12-01
# (bench/results/linear-h200-2026-12-01.json) and are kept only at the launch shapes that came closest;
# 64-column tiles and split-K (the K range divided among `split` programs per column tile, their fp32
# partials summed in order by the tile's last program) are new.
SWEEP = sorted(
    {(bn, bk, 4, st, 1) for bn in (32, 64) for bk in (128, 256, 512) for st in (3, 4)}
    | {(16, bk, 4, st, 1) for bk in (256, 512) for st in (3, 4)}
    | {(32, bk, 8, 4, 1) for bk in (128, 256)}
    | {(bn, bk, 4, st, sp) for bn in (32, 64) for bk in (128, 256) for st in (3, 4) for sp in (2, 4)}
    | {(16, 256, 4, 4, sp) for sp in (2, 4)}
)


def label(cfg: tuple[int, ...]) -> str:
    return "ours_bn{}_bk{}_w{}_s{}_k{}".format(*cfg)


LABELS = {label(c): c for c in SWEEP}


def launch_of(name: str, module: tuple[int, ...]) -> tuple[int, ...]:
    """The launch shape a contender's label names ("ours": the module's)."""
    return tuple(module) if name == "ours" else LABELS[name]


def _tuned_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear through PyTorch's TunableOp (cuBLAS and cuBLASLt candidates benchmarked on the first call
    of a shape, the fastest kept): the peer at its best configuration. Enabled for this call only, so the
    plain "cublas" contender keeps cuBLAS's own heuristic choice."""
    from torch.cuda import tunable

    was = tunable.is_enabled()
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.write_file_on_exit(False)
    try:
        return F.linear(x, w)
    finally:
        tunable.enable(was)


def _checked(calls: dict, want: torch.Tensor, wants: dict | None = None) -> dict[str, str]:
    """Run every call once; the ones that fail or are wrong (beyond a bf16 step of the fp32 result `want`,
    or of wants[name] where given) are reported, not timed."""
    errors = {}
    for name, fn in calls.items():
        try:
            got = fn()
        except Exception as e:  # a launch shape that does not compile is reported, not dropped
            errors[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            continue
        got = got[0] if isinstance(got, tuple) else got
        ref = (wants or {}).get(name, want)
        err = (got.float() - ref).abs().max().item()
        if err > 0.05 * ref.abs().max().item():
            errors[name] = f"wrong result: max error {err:.3g}"
    return errors


def _time(calls: dict, want, wants: dict | None = None) -> tuple[dict, dict]:
    errors = _checked(calls, want, wants)
    timings, failed = time_contenders(
        {k: v for k, v in calls.items() if k not in errors}, rounds=ROUNDS, eager=False
    )
    failed.update(errors)
    return timings, failed


def bench_case(name: str, N: int, K: int, M: int, ceiling: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = torch.randn(N, K, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    calls = {"cublas": lambda: F.linear(x, w), "cublas_tunableop": lambda: _tuned_linear(x, w)}
    module = fused.launch_shape(N, K)
    for cfg in [module, *[c for c in SWEEP if c != module]]:
        calls["ours" if cfg == module else label(cfg)] = lambda cfg=cfg: fused.linear_small(x, w, cfg)
    timings, failed = _time(calls, ref)
    nbytes = N * K * 2

    def tbps(us: float) -> float:
        return round(nbytes / (us * 1e-6) / 1e12, 3)

    best = min((k for k in timings if k.startswith("ours")), key=lambda k: timings[k]["us_streamed"])
    # the faster of cuBLAS's heuristic and TunableOp's pick is the peer every ratio is taken against
    peer = min(
        (k for k in ("cublas", "cublas_tunableop") if k in timings), key=lambda k: timings[k]["us_streamed"]
    )
    c, o, b = timings[peer], timings.get("ours"), timings[best]
    return {
        "case": name,
        "N": N,
        "K": K,
        "M": M,
        "weight_bytes": nbytes,
        "module_launch_shape": list(module),
        "peer": peer,
        "cublas_us": c["us_streamed"],
        "cublas_TBps": tbps(c["us_streamed"]),
        "ours_us": None if o is None else o["us_streamed"],
        "ours_TBps": None if o is None else tbps(o["us_streamed"]),
        "ours_fraction_of_copy": None if o is None else round(tbps(o["us_streamed"]) / ceiling, 3),
        "ours_vs_cublas": None if o is None else round(c["us_streamed"] / o["us_streamed"], 3),
        "best": best,
        "best_launch_shape": list(launch_of(best, module)),
        "best_us": b["us_streamed"],
        "best_TBps": tbps(b["us_streamed"]),
        "best_vs_cublas": round(c["us_streamed"] / b["us_streamed"], 3),
        "timings": timings,
        "unavailable": failed,
    }


Shape = tuple[int, ...]
Sweep = tuple[Shape, ...]


def fold_shapes(module: Shape, best: Shape, sweep: Sweep = ()) -> dict[str, Shape]:
    """The launch shapes a fold is timed at, by contender name: the module's, the plain sweep's best, and
    each shape of `sweep` not already named (by its sweep label without `ours_`)."""
    shapes = {"module": tuple(module), "best": tuple(best)}
    shapes |= {label(c).removeprefix("ours_"): tuple(c) for c in sweep if tuple(c) not in shapes.values()}
    return shapes


def fastest_folded(us: dict[str, float], shapes: dict[str, Shape]) -> dict | None:
    """The folded contender with the least time (`folded_<name>` in `us`) and its launch shape."""
    folded = {k.removeprefix("folded_"): v for k, v in us.items() if k.startswith("folded_")}
    if not folded:
        return None
    name = min(folded, key=folded.get)
    return {"name": name, "launch_shape": list(shapes[name]), "us_streamed": folded[name]}


def cases_to_run(names: list[str] | None, fold_kinds: list[str] | None) -> list[tuple]:
    """SHAPES' cases named in `names` (all without), and of those only the ones whose launch folds one of
    `fold_kinds` (all without)."""
    todo = [s for s in SHAPES if not names or s[0] in names]
    return [s for s in todo if not fold_kinds or s[3] in fold_kinds]


def bench_fold(name: str, N: int, K: int, M: int, kind: str, best: Shape, sweep: Sweep = ()) -> dict:
    """The unfused path around the projection (the kernels a fold replaces, then the projection by cuBLAS
    or by linear_small at the module's launch shape) against the one launch that folds them in, at the
    module's launch shape, at the plain sweep's best (`best`) and at every launch shape of `sweep` (the
    fold's own sweep: an epilogue may want another shape than the plain projection's; labelled as the
    plain sweep's, `folded_bn…`). "norm": rmsnorm with the add, then the
    projection, against norm_linear on the producer's (u, sq); "swiglu": the same then silu_mul, against
    swiglu_linear; "add_norm": the plain projection (the add and the norm are the next projection's
    unfused kernel, timed there) against linear_add_norm."""
    g = torch.Generator(device="cuda").manual_seed(N + K + M + 1)
    bf = torch.bfloat16
    w = torch.randn(N, K, generator=g, device="cuda").to(bf)
    plain = fused.launch_shape(N, K)  # the unfused path's projection
    shapes = fold_shapes(fused.launch_shape(N, K, kind=kind), best, sweep)  # the fold's own (KIND_SHAPES)
    wants = {}
    if kind == "add_norm":
        a = torch.randn(M, K, generator=g, device="cuda").to(bf)
        r = torch.randn(M, N, generator=g, device="cuda").to(bf)
        nw = (torch.rand(N, generator=g, device="cuda") + 0.5).to(bf)
        want = F.linear(a.float(), w.float())
        calls = {"unfused_cublas": lambda: F.linear(a, w), "unfused_ours": lambda: fused.linear_small(a, w)}
        for k, cfg in shapes.items():
            calls[f"folded_{k}"] = lambda cfg=cfg: fused.linear_add_norm(a, w, r, nw, cfg)
            wants[f"folded_{k}"] = want + r.float()  # s, the residual stream
        for k in ("module", "best"):  # the epilogue of kernels.fused.ADD_SQ_IN_REGS, at the same shapes
            add = lambda cfg=shapes[k]: fused.linear_add_norm(a, w, r, nw, cfg)  # noqa: E731
            calls[f"sq_in_regs_{k}"] = with_settings(fused, {"ADD_SQ_IN_REGS": True}, add)
            wants[f"sq_in_regs_{k}"] = want + r.float()
    else:
        x, r = (torch.randn(M, K, generator=g, device="cuda").to(bf) for _ in range(2))
        nw = (torch.rand(K, generator=g, device="cuda") + 0.5).to(bf)
        s = x + r
        u, sq = (s.float() * nw.float()).to(bf), s.float().pow(2).sum(-1)[None].contiguous()
        h = fused.rmsnorm_reference(s, nw, 1e-5)
        after = fused.silu_mul if kind == "swiglu" else (lambda t: t)
        want = F.linear(h.float(), w.float())
        if kind == "swiglu":
            want = fused.silu_mul_reference(want.to(bf)).float()
        calls = {
            "unfused_cublas": lambda: after(F.linear(fused.rmsnorm(x, nw, 1e-5, r)[1], w)),
            "unfused_ours": lambda: after(fused.linear_small(fused.rmsnorm(x, nw, 1e-5, r)[1], w, plain)),
        }
        for k, cfg in shapes.items():
            if kind == "swiglu":
                calls[f"folded_{k}"] = lambda cfg=cfg: fused.swiglu_linear(u, w, sq, 1e-5, cfg)
            else:
                calls[f"folded_{k}"] = lambda cfg=cfg: fused.norm_linear(u, sq, 1e-5, w, cfg)
    timings, failed = _time(calls, want, wants)
    us = {k: v["us_streamed"] for k, v in timings.items()}
    unfused = min((us[k] for k in us if k.startswith("unfused")), default=None)
    fastest = fastest_folded(us, shapes)
    one = None if fastest is None else fastest["us_streamed"]
    # add_norm: the folded launch with ADD_SQ_IN_REGS's epilogue against the same launch without it
    in_regs = {k: (us.get(f"folded_{k}"), us.get(f"sq_in_regs_{k}")) for k in ("module", "best")}
    in_regs_ratio = {k: round(f / v, 3) for k, (f, v) in in_regs.items() if f and v}
    return {
        "case": name,
        "M": M,
        "fold": kind,
        **({"sq_in_regs_vs_folded": in_regs_ratio} if kind == "add_norm" else {}),
        "launch_shapes": {k: list(v) for k, v in shapes.items()},
        "us_streamed": us,
        "folded_vs_unfused": None if unfused is None or one is None else round(unfused / one, 3),
        "fastest_folded": fastest,
        "unavailable": failed,
    }


def bench_head(M: int) -> dict:
    """The step's end: the last residual add, the final norm and the fp32 LM head as the torch glue runs
    them (the add, the norm kernel, two upcasts, an fp32 GEMM, the copies into the static outputs)
    against kernels.fused.norm_head's one launch."""
    g = torch.Generator(device="cuda").manual_seed(M)
    bf = torch.bfloat16
    x, r = (torch.randn(M, HIDDEN, generator=g, device="cuda").to(bf) for _ in range(2))
    nw = (torch.rand(HIDDEN, generator=g, device="cuda") + 0.5).to(bf)
    w = torch.randn(VOCAB, HIDDEN, generator=g, device="cuda").to(bf)
    hidden, logits = torch.empty(M, HIDDEN, dtype=bf, device="cuda"), torch.empty(M, VOCAB, device="cuda")

    def separate():
        s = x + r
        hidden.copy_(s)
        logits.copy_(F.linear(fused.rmsnorm(s, nw, 1e-5).float(), w.float()))
        return logits

    def one():
        fused.norm_head(x, r, nw, 1e-5, w, hidden, logits)
        return logits

    want = F.linear(fused.rmsnorm_reference(x + r, nw, 1e-5).float(), w.float())
    timings, failed = _time({"add_norm_upcast_gemm_copies": separate, "norm_head": one}, want)
    us = {k: v["us_streamed"] for k, v in timings.items()}
    ratio = None
    if len(us) == 2:
        ratio = round(us["add_norm_upcast_gemm_copies"] / us["norm_head"], 3)
    return {"case": "lm head", "M": M, "us_streamed": us, "one_vs_separate": ratio, "unavailable": failed}


def _pick(one: dict, wide: dict, base):
    """The key of `one` (times at 1 row) with the least time among those timed in `wide` (at 32 rows) no
    slower than `base` there (all of `one` where none is), ties going to `base`."""
    bound = wide.get(base, float("inf"))
    ok = [k for k in one if k in wide and wide[k] <= bound] or list(one)
    return min(ok, key=lambda k: (one[k], k != base))


def suggest(cases: list[dict], folds: list[dict]) -> dict:
    """Per weight shape: the launch shape with the least time at 1 row among those no slower than the
    module's at 32 rows (the 1-request step is the target, the wide step must not lose), and whether
    linear_small should serve the shape: faster than cuBLAS at both row counts, counting the fold where
    the step folds a kernel into the projection (the folded launch against that kernel plus cuBLAS)."""
    out = {}
    for name, N, K, _ in SHAPES:
        by_m = {c["M"]: c for c in cases if c["N"] == N and c["K"] == K}
        if 1 not in by_m:
            continue
        one = {k: v["us_streamed"] for k, v in by_m[1]["timings"].items() if k.startswith("ours")}
        wide = {k: v["us_streamed"] for k, v in by_m[32]["timings"].items()} if 32 in by_m else {}
        pick = _pick(one, wide, "ours")
        shape = launch_of(pick, fused.launch_shape(N, K))
        serve = {}
        for M, case in by_m.items():
            fold = next((f for f in folds if f["case"] == name and f["M"] == M), None)
            if fold is not None and fold["folded_vs_unfused"] is not None:
                us = fold["us_streamed"]
                two = us.get("unfused_cublas")
                serve[M] = two is not None and min(v for k, v in us.items() if k.startswith("folded")) < two
            else:
                serve[M] = case["best_vs_cublas"] > 1.0
        out[f"{N}x{K}"] = {
            "case": name,
            "launch_shape": list(shape),
            "us_at_1": one[pick],
            "us_at_32": wide.get(pick),
            "serve": all(serve.values()),
            "faster_than_cublas_path_at": {str(m): v for m, v in serve.items()},
        }
    return out


def suggest_kinds(folds: list[dict]) -> dict:
    """Per fold of a weight shape (kernels.fused.KIND_SHAPES' key, "kind NxK"): the launch shape with the
    least folded time at 1 row among those timed at 32 rows too and no slower there than the fold's module
    shape, by suggest's rule; `differs` says whether it is another shape than the module's (a table entry
    to add), `gain_at_1` the module's time at 1 row over the pick's."""
    out = {}
    for name, N, K, kind in SHAPES:
        by_m = {f["M"]: f for f in folds if f["case"] == name and f["fold"] == kind}
        if 1 not in by_m:
            continue

        def timed(fold: dict) -> dict[tuple[int, ...], float]:
            us, shapes = fold["us_streamed"], fold["launch_shapes"]
            return {tuple(shapes[k]): us[f"folded_{k}"] for k in shapes if f"folded_{k}" in us}

        one = timed(by_m[1])
        wide = timed(by_m[32]) if 32 in by_m else {}
        module = tuple(by_m[1]["launch_shapes"]["module"])
        if module not in one:
            continue
        pick = _pick(one, wide, module)
        out[f"{kind} {N}x{K}"] = {
            "case": name,
            "launch_shape": list(pick),
            "differs": pick != module,
            "us_at_1": one[pick],
            "us_at_32": wide.get(pick),
            "module_us_at_1": one[module],
            "module_us_at_32": wide.get(module),
            "gain_at_1": round(one[module] / one[pick], 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--shapes", nargs="*", help="case names to run (default: all)")
    ap.add_argument(
        "--fold-sweep", action="store_true",
        help="also time each folded launch at every launch shape of the sweep (see --fold-kinds)",
    )  # fmt: skip
    ap.add_argument(
        "--fold-kinds", nargs="*", choices=("norm", "swiglu", "add_norm"),
        help="only the cases whose launch folds one of these (default: every case)",
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/linear.py needs a CUDA device")
    warm_up_clocks()
    copy = copy_bandwidth()
    result = {
        "bench": "linear",
        "work": "y = x @ W.T, bf16 in and out, fp32 accumulation; the same x and W for every contender",
        "module_launch_shape": dict(zip(("BN", "BK", "warps", "stages", "split"), MODULE, strict=True)),
        "module_table": {f"{n}x{k}": list(v) for (n, k), v in fused.SMALL_SHAPES.items()},
        "module_kind_table": {f"{kd} {n}x{k}": list(v) for (kd, n, k), v in fused.KIND_SHAPES.items()},
        "sweep": [list(c) for c in SWEEP],
        "fold_sweep": args.fold_sweep,
        "pdl": fused.PDL,
        "copy_TBps": copy,
        "timing": TIMING.format(rounds=ROUNDS, streamed=10) + "; figures: us_streamed",
    }
    rows: list[dict] = []
    folds: list[dict] = []
    heads: list[dict] = []
    todo = cases_to_run(args.shapes, args.fold_kinds)
    fold_sweep = SWEEP if args.fold_sweep else ()
    total = len(todo) * len(args.rows)

    def save(done: bool) -> None:
        sums = {
            k: round(sum(r[k] for r in rows if r["M"] == 1 and r[k] is not None), 2)
            for k in ("cublas_us", "ours_us", "best_us")
        }
        body = {**result, "sum_over_shapes_at_M_1_us": sums, "cases": rows, "folds": folds, "head": heads}
        body["suggested"] = suggest(rows, folds)
        body["suggested_kinds"] = suggest_kinds(folds)
        write_result({**body, "complete": done}, args.out, indent=1, echo=done)

    for (name, N, K, kind), M in itertools.product(todo, args.rows):
        case = bench_case(name, N, K, M, copy["max"])
        rows.append(case)
        if kind is not None:
            folds.append(bench_fold(name, N, K, M, kind, tuple(case["best_launch_shape"]), fold_sweep))
        print(f"linear: {name} M={M} done ({len(rows)}/{total})", file=sys.stderr, flush=True)
        save(False)
    if not args.shapes and not args.fold_kinds:
        for M in args.rows:
            heads.append(bench_head(M))
    save(True)


if __name__ == "__main__":
    main()
