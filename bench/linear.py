"""Decode-sized projections: kernels.fused.linear_small (every launch shape of a sweep) against cuBLAS
(torch's F.linear, with its own heuristic and through TunableOp) at the proxy preset's weight shapes,
bf16, for M = 1 and 32 rows. Prints JSON and writes it to --out; `cublas_*` fields are the faster of the
two cuBLAS contenders (named in `peer`).

Equal work: every contender computes y = x @ W.T with fp32 accumulation into bf16 from the same
inputs; each call is captured in a CUDA graph and timed by GPU events in interleaved rounds
(bench/_gpu.py). Each case reports the bandwidth of the weight read (the bytes a projection of a few rows
must move) against the measured copy ceiling, the peer's figure, the module's launch shape and the sweep's
best.
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

from bench._common import write_result  # noqa: E402
from bench._gpu import TIMING, copy_bandwidth, time_contenders, warm_up_clocks  # noqa: E402
from kernels import fused  # noqa: E402

# (name, N, K) of the proxy preset's decode projections (qualify/engine/config.py, hidden 4096)
SHAPES = (
    ("kda in_proj", 3 * 32 * 128 + 32 + 2 * 128, 4096),
    ("mlp gate_up", 2 * 8192, 4096),
    ("mlp down", 4096, 8192),
    ("attention qkv", (32 + 2 * 4) * 128, 4096),
    ("out_proj / o_proj", 4096, 4096),
)
ROWS = (1, 32)  # a plain decode step of up to 16 rows runs the BM=16 tile; a verify of 8 x 4, BM=32
ROUNDS = 5
MODULE = (fused._BN, fused._BK, fused._WARPS, fused._STAGES)  # the default for shapes off the table
SWEEP = list(itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4)))  # BN, BK, warps, stages


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


def bench_case(name: str, N: int, K: int, M: int, ceiling: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = torch.randn(N, K, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    calls = {"cublas": lambda: F.linear(x, w), "cublas_tunableop": lambda: _tuned_linear(x, w)}
    module = MODULE
    for cfg in [module, *[c for c in SWEEP if c != module]]:
        label = "ours" if cfg == module else "ours_bn{}_bk{}_w{}_s{}".format(*cfg)
        calls[label] = lambda cfg=cfg: fused.linear_small(x, w, cfg)
    errors = {}
    for label, fn in calls.items():
        try:
            err = (fn().float() - ref).abs().max().item()
        except Exception as e:  # a launch shape that does not compile is reported, not dropped
            errors[label] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            continue
        if err > 0.05 * ref.abs().max().item():
            errors[label] = f"wrong result: max error {err:.3g}"
    timings, failed = time_contenders(
        {k: v for k, v in calls.items() if k not in errors}, rounds=ROUNDS, eager=False
    )
    failed.update(errors)
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
        "peer": peer,
        "cublas_us": c["us_streamed"],
        "cublas_TBps": tbps(c["us_streamed"]),
        "ours_us": None if o is None else o["us_streamed"],
        "ours_TBps": None if o is None else tbps(o["us_streamed"]),
        "ours_fraction_of_copy": None if o is None else round(tbps(o["us_streamed"]) / ceiling, 3),
        "ours_vs_cublas": None if o is None else round(c["us_streamed"] / o["us_streamed"], 3),
        "best": best,
        "best_us": b["us_streamed"],
        "best_vs_cublas": round(c["us_streamed"] / b["us_streamed"], 3),
        "timings": timings,
        "unavailable": failed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/linear.py needs a CUDA device")
    warm_up_clocks()
    copy = copy_bandwidth()
    rows = []
    for (name, N, K), M in itertools.product(SHAPES, args.rows):
        rows.append(bench_case(name, N, K, M, copy["max"]))
        print(f"linear: {name} M={M} done", file=sys.stderr, flush=True)
    total = {
        k: round(sum(r[k] for r in rows if r["M"] == 1 and r[k] is not None), 2)
        for k in ("cublas_us", "ours_us", "best_us")
    }
    result = {
        "bench": "linear",
        "work": "y = x @ W.T, bf16 in and out, fp32 accumulation; the same x and W for every contender",
        "module_launch_shape": dict(zip(("BN", "BK", "warps", "stages"), MODULE, strict=True)),
        "sweep": [list(c) for c in SWEEP],
        "copy_TBps": copy,
        "timing": TIMING.format(rounds=ROUNDS, streamed=10) + "; figures: us_streamed",
        "sum_over_shapes_at_M_1_us": total,
        "cases": rows,
    }
    write_result(result, args.out, indent=1)


if __name__ == "__main__":
    main()
