"""How far a prompt's prefill logits move with the batch around it: each prompt prefilled alone, then
among random fillers at a random position, its last-token logits (and last hidden state) compared, by the
engine's prefill and (under `one_forward`, same seed) in one plain varlen forward over each batch. Prints
JSON; --out writes it too.

Why: the harness compares answers given in batches of different composition; the speculative check holds
a drafted run, sent as a batch of one, to a plain reference of the same prompt asked among fillers, and
reads a first token that differs where the reference's top-2 gap is above the harness's epsilon (0.05) as
a failure. On an H100 (2026-12-05, proxy preset, `--spec mtp:3`) the reference engine failed it so, at a
gap of 0.069 on the first token, and this script measured the plain batched prefill's move there: up to
0.109 (bench/results/batch-variance-h100-2026-12-05.json). The engine then prefilled each prompt on its
own; a CUDA engine now prefills a batch in one row-invariant forward (Runner.prefill, rows_invariant).
The figure to expect from the engine's prefill is 0 either way; `one_forward` keeps the plain batched
figure beside it."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench._common import write_result  # noqa: E402
from qualify.checks.base import EPSILON  # noqa: E402  (the harness's coherence epsilon)


def _prompt(rng: random.Random, lo: int = 8, hi: int = 96) -> list[int]:
    from qualify.engine.tokenizer import BOS

    return [BOS, *(rng.randrange(32, 127) for _ in range(rng.randint(lo, hi)))]


def _prefill(
    runner, batch: list[list[int]], at: int, one_forward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and last hidden state of batch[at], prefilled with the rest of `batch` (fp32 copies):
    by the engine's prefill, or with `one_forward` in one plain varlen forward over the whole batch (the
    engine's prefill before 2026-12-05)."""
    reqs = [runner.admit(p, 1) for p in batch]
    try:
        logits = (runner._prefill_varlen if one_forward else runner.prefill)(reqs)
        return logits[at].float().clone(), runner.prefill_hidden[at].float().clone()
    finally:
        for r in reqs:
            runner.release(r)


def measure(engine, prompts: int, rounds: int, seed: int = 0, one_forward: bool = False) -> dict:
    """Per prompt: prefilled alone twice (the control: a deterministic engine moves by 0), then `rounds`
    times among 1 to (capacity - 1) random fillers; the largest move of its logits and hidden state, and
    whether its top-1 changed. The summary says how many first-token top-2 gaps lie within that move."""
    runner = engine.runner
    pick = runner.pick  # the engine's own greedy choice and top-2 gap
    rng = random.Random(seed)
    cap = max(1, engine.cfg.max_num_seqs)
    rows, gaps = [], []
    for _ in range(prompts):
        p = _prompt(rng)
        alone, h_alone = _prefill(runner, [p], 0, one_forward)
        again, _ = _prefill(runner, [p], 0, one_forward)
        (top1,), (gap,) = pick(alone[None])
        gaps.append(gap)
        moves, h_moves, flips = [], [], 0
        for _ in range(rounds):
            fillers = [_prompt(rng) for _ in range(rng.randint(1, cap - 1) if cap > 1 else 0)]
            at = rng.randint(0, len(fillers))
            batch = [*fillers[:at], p, *fillers[at:]]
            got, h_got = _prefill(runner, batch, at, one_forward)
            moves.append(float((got - alone).abs().max()))
            h_moves.append(float((h_got - h_alone).abs().max()))
            flips += int(pick(got[None])[0][0] != top1)
        rows.append({
            "tokens": len(p), "top2_gap_alone": round(gap, 5),
            "repeat_alone_max_abs": float((again - alone).abs().max()),
            "among_fillers_max_abs": max(moves, default=0.0), "hidden_max_abs": max(h_moves, default=0.0),
            "top1_changed": flips,
        })  # fmt: skip
    moved = [r["among_fillers_max_abs"] for r in rows]
    worst = max(moved, default=0.0)
    return {
        "prompts": prompts,
        "rounds": rounds,
        "epsilon": EPSILON,
        "repeat_alone_max_abs": max((r["repeat_alone_max_abs"] for r in rows), default=0.0),
        "among_fillers_max_abs": worst,
        "among_fillers_median_abs": statistics.median(moved) if moved else 0.0,
        "prompts_whose_top1_changed": sum(1 for r in rows if r["top1_changed"]),
        "gaps_below_epsilon": sum(1 for g in gaps if g < EPSILON),
        "gaps_below_the_largest_move": sum(1 for g in gaps if g < worst),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--preset", default="proxy")
    ap.add_argument("--device", default="cuda", help="cuda (the default) or cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/batch_variance.py: no CUDA device (--device cpu runs it on the CPU)")
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    engine = Engine(EngineConfig(preset=args.preset, device=args.device, cudagraph_mode="none"))
    try:
        result = {"bench": "batch_variance", "preset": args.preset, "backend": engine.resolution.name}
        result.update(measure(engine, args.prompts, args.rounds, args.seed))
        # the same prompts, fillers and positions (the same seed) in one varlen forward over each batch
        result["one_forward"] = {
            "what": "each batch prefilled in one plain varlen forward (cuBLAS's products, one head over "
            "every row), as the engine did before 2026-12-05",
            **measure(engine, args.prompts, args.rounds, args.seed, one_forward=True),
        }
    finally:
        engine.close()
    write_result(result, args.out)


if __name__ == "__main__":
    main()
