"""Decode-step latency, eager vs FULL CUDA-graph replay, and tokens/s of plain vs speculative greedy decoding
(MTP, num_spec 3), proxy preset. Prints JSON and writes it to --out. Target: replay >= 3x eager at batch 1.
The replayed batch-1 step is also held against its roofline (the bytes it must read at the measured copy
bandwidth) with the profiler's per-kernel split, once with the engine's fused decode glue, once with the
same kernels launched without programmatic dependent launch (kernels.fused.PDL off while that engine
captures), and once with the torch glue (kernels/fused.py against the ops it replaces), in the same run;
and beside engines that captured with other settings of kernels/fused.py (ADD_SQ_IN_REGS flipped;
KIND_SHAPES emptied where it has entries) or of kernels/kda/decode.py (its launch switches all off; its
launches without PDL), each pair of steps timed in interleaved rounds.
With PDL a kernel's programs may start while the one before it finishes, so the per-kernel times can sum
to more than the step.

A step is timed end to end as the engine runs it: host staging into the arena, the forward (eager launches
or one replay), and a device sync; the median of many steps. Weights are seeded random, so the MTP drafts
are rarely accepted; a run with drafts taken from the plain greedy continuation (every draft accepted)
bounds what speculative decoding can gain from the verify path itself, and is labelled as such (drafts
from the speculative engine's own plain decode, so only a near tie between the paths rejects one).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench._common import with_settings, write_result  # noqa: E402
from bench._gpu import (  # noqa: E402
    breakdown,
    copy_bandwidth,
    events_us,
    launch_sequence,
    launch_totals,
    profile_kernels,
    warm_up_clocks,
)
from kernels import fused  # noqa: E402

NUM_SPEC = 3
WIDE = 32  # the wide step's batch (requests)
GEN_TOKENS = 64
EPSILON = 0.05  # the harness's coherence epsilon for bf16 logits


def _engine(preset: str, fused: bool = True, **fields):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine
    from qualify.engine.graphs import capture_engine

    e = Engine(EngineConfig(preset=preset, device="cuda", **fields))
    e.model.set_fused(fused)  # the engine's default on CUDA; False: the torch glue, for comparison
    return e, capture_engine(e)


def _prompts(n: int) -> list[list[int]]:
    return [[256, *f"request {i}: a hybrid engine decodes under graphs".encode()] for i in range(n)]


def _sync() -> None:
    torch.cuda.synchronize()


@contextlib.contextmanager
def _prefilled(r, prompts):  # type: ignore[no-untyped-def]
    """Requests of `prompts` admitted to runner `r`, prefilled and their first tokens appended (ready for a
    decode step); released on the way out."""
    reqs = [r.admit(p, 8) for p in prompts]
    try:
        toks, gaps = r.pick(r.prefill(reqs))
        for q, t, gap in zip(reqs, toks, gaps, strict=True):
            r._append(q, t, gap)
        yield reqs
    finally:
        for q in reqs:
            r.release(q)


@contextlib.contextmanager
def _staged_step(engine, batch: int):  # type: ignore[no-untyped-def]
    """(the padded size, a replay of its captured decode step) for `batch` prefilled requests of `engine`,
    staged once; the requests released on the way out."""
    r, g = engine.runner, engine.runner.graphs
    with _prefilled(r, _prompts(batch)) as reqs:
        n_pad = g.padded_size(batch, 1)
        r.stage_decode(reqs, n_pad)
        yield n_pad, lambda: g.replay(n_pad, 1)


def step_latency(engine, batch: int, steps: int) -> dict:
    """Median ms per decode step of `batch` live requests: eager launches vs one graph replay."""
    r, g = engine.runner, engine.runner.graphs
    with _prefilled(r, _prompts(batch)) as reqs:
        n_pad = g.padded_size(batch, 1)

        def eager() -> None:
            r.stage_decode(reqs, batch)
            r.forward_decode_static(batch)

        def replay() -> None:
            r.stage_decode(reqs, n_pad)
            g.replay(n_pad, 1)

        out = {"padded_to": n_pad}
        for name, fn in (("eager", eager), ("replay", replay)):
            for _ in range(5):
                fn()
            _sync()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                _sync()
                times.append((time.perf_counter() - t0) * 1e3)
            out[f"{name}_ms"] = round(statistics.median(times), 4)
        out["speedup"] = round(out["eager_ms"] / out["replay_ms"], 2)
        return out


def host_profile(engine, steps: int = 20, top: int = 25) -> dict:
    """Where an eager step's host time goes: cProfile over `steps` eager decode steps at batch 1 and over as
    many one-prompt prefills (each synced), the `top` functions by own time, in microseconds per call of the
    profiled unit (a step or a prefill). The eager step is host-bound: what its launches and glue cost."""
    import cProfile
    import pstats

    r = engine.runner
    with _prefilled(r, _prompts(1)) as reqs:

        def step() -> None:
            r.stage_decode(reqs, 1)
            r.forward_decode_static(1)
            _sync()

        def prefill() -> None:
            fresh = [r.admit(p, 8) for p in _prompts(1)]
            try:
                r.prefill(fresh)
                _sync()
            finally:
                for q in fresh:
                    r.release(q)

        out: dict = {}
        for name, fn in (("eager_step_b1", step), ("prefill_one_prompt", prefill)):
            for _ in range(3):
                fn()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(steps):
                fn()
            prof.disable()
            wall = (time.perf_counter() - t0) / steps
            st = pstats.Stats(prof)
            rows = []
            for (file, line, func), (_, ncalls, tottime, cumtime, _) in st.stats.items():  # type: ignore[attr-defined]
                rel = os.path.relpath(file, ROOT) if file.startswith(ROOT) else os.path.basename(file)
                rows.append((tottime, f"{rel}:{line}({func})", ncalls, cumtime))
            rows.sort(reverse=True)
            out[name] = {
                "wall_us": round(wall * 1e6, 1),
                "profiled_units": steps,
                "top_own_time": [
                    {
                        "function": f,
                        "calls_each": round(n / steps, 2),
                        "own_us_each": round(t / steps * 1e6, 1),
                        "cumulative_us_each": round(c / steps * 1e6, 1),
                    }
                    for t, f, n, c in rows[:top]
                ],
            }
        return out


def step_bytes(engine, context_tokens: int, batch: int = 1) -> dict[str, int]:
    """The fewest bytes one decode step of `batch` requests must read from device memory: every weight the
    step multiplies by, once (the embedding's rows; the MTP head is not used by a plain step), each KDA
    layer's fp32 state per request, and the attention layers' KV cache over `context_tokens` tokens per
    request."""
    m, cfg = engine.model, engine.cfg
    shape = m.shape

    def nbytes(mod) -> int:
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    emb = m.embed.weight
    weights = nbytes(m) - nbytes(m.mtp) - nbytes(m.embed) + batch * emb.shape[1] * emb.element_size()
    kda = batch * cfg.layer_pattern.count("K") * shape.kda_heads * shape.kda_head_dim**2 * 4
    kv_row = 2 * shape.attn_kv_heads * shape.attn_head_dim * emb.element_size()
    kv = batch * cfg.layer_pattern.count("A") * context_tokens * kv_row
    return {"weights": weights, "kda_state": kda, "kv": kv, "total": weights + kda + kv}


def roofline(engine, copy: dict, steps: int, batch: int = 1, sequence: bool = False) -> dict:
    """The replayed step of `batch` requests: its time against the bytes it must read at the measured copy
    bandwidth, and the profiler's per-kernel split of one replayed step; with `sequence`, also every launch
    of the step in order with its own time (meaningful where no launch overlaps the one before: no PDL)."""
    prompts = _prompts(batch)
    with _staged_step(engine, batch) as (n_pad, replay):
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
        step_us = events_us(replay, steps)
        need = step_bytes(engine, max(len(p) for p in prompts) + 1, batch)
        events = profile_kernels(replay, calls=5)
        kernels = breakdown(events, 5, top=None)
        ceiling = copy["max"]
        return {
            "batch": batch,
            "padded_to": n_pad,
            "glue": engine.model.glue,
            "bytes": need,
            "replay_us": round(step_us, 2),
            "replay_definition": f"{steps} replays back to back (staging once before), GPU events / {steps}",
            "copy_TBps": ceiling,
            "read_TBps": round(need["total"] / (step_us * 1e-6) / 1e12, 3),
            "fraction_of_copy_bandwidth": round(need["total"] / (step_us * 1e-6) / 1e12 / ceiling, 3),
            "floor_us_at_copy_bandwidth": round(need["total"] / (ceiling * 1e12) * 1e6, 2),
            **launch_totals(kernels),
            "kernels": kernels[:30],
            **({"launches": launch_sequence(events, 5)} if sequence else {}),
        }


STEP_ROUNDS = 7  # interleaved rounds of interleaved_steps


def interleaved_steps(engines: dict, steps: int, rounds: int = STEP_ROUNDS) -> dict[str, float]:
    """Median µs of each engine's replayed one-request decode step: `steps` replays back to back (staged
    once before) timed by GPU events, in `rounds` interleaved rounds, the order rotating."""
    with contextlib.ExitStack() as stack:
        replays = {name: stack.enter_context(_staged_step(e, 1))[1] for name, e in engines.items()}
        for fn in replays.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        names = list(replays)
        samples: dict[str, list[float]] = {n: [] for n in names}
        for i in range(rounds):
            for n in names[i % len(names) :] + names[: i % len(names)]:
                samples[n].append(events_us(replays[n], steps))
    return {n: round(statistics.median(v), 2) for n, v in samples.items()}


def step_beside(engine, preset: str, steps: int, changes: dict, module=fused) -> dict:
    """The one-request step at the module's settings against the same step of an engine that captured its
    graphs with `module`'s `changes` in place (kernels.fused by default; each name set to its value while
    that engine is built and captures, then put back), the two timed side by side in interleaved rounds."""
    before = {k: getattr(module, k) for k in changes}
    other, cap = with_settings(module, changes, lambda: _engine(preset))()
    try:
        if not cap["captured"]:
            return {"unavailable": cap["reason"]}
        us = interleaved_steps({"module": engine, "changed": other}, steps)
    finally:
        other.close()
    return {
        "settings_of": module.__name__,
        "module": {k: repr(v) for k, v in before.items()},
        "changed": {k: repr(v) for k, v in changes.items()},
        "replay_us": us,
        "speedup_of_changed": round(us["module"] / us["changed"], 3),
        "definition": (
            f"medians of {STEP_ROUNDS} interleaved rounds, each {steps} replays back to back / {steps}"
        ),
    }


def tokens_per_second(fn, prompts, tokens: int) -> dict:
    fn(prompts, 8)  # warm-up
    _sync()
    t0 = time.perf_counter()
    res = fn(prompts, tokens)
    _sync()
    secs = time.perf_counter() - t0
    gens = res[0]
    n = sum(len(x.token_ids) for x in gens)
    out = {"batch": len(prompts), "tokens": n, "seconds": round(secs, 4), "tokens_per_s": round(n / secs, 1)}
    if len(res) == 3:
        s = res[2]
        out.update(drafted=s.drafted, accepted=s.accepted, acceptance_rate=round(s.acceptance_rate, 4))
    return out, gens


def coherence(ref, got) -> list[dict]:
    """Per request: the coherence rule of the speculative run against the same engine's plain greedy run
    (both sides' top-2 evidence; no teacher forcing here, so a near tie before the last token reads
    `differs` with forcing `missing`)."""
    from qualify.protocol import compare_greedy

    reports = [
        compare_greedy(a.token_ids, a.top2_gaps, b.token_ids, EPSILON, reference_top2=a.top2_ids,
                       candidate_gaps=b.top2_gaps, candidate_top2=b.top2_ids)
        for a, b in zip(ref, got, strict=True)
    ]  # fmt: skip
    keys = ("outcome", "agrees", "first_divergence", "gap", "candidate_gap", "forcing")
    return [{k: getattr(r, k) for k in keys} for r in reports]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--preset", default="proxy")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per point")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/graphs.py needs a CUDA device")
    from qualify.engine.spec import speculative_generate

    warm_up_clocks()
    result: dict = {"bench": "graphs", "preset": args.preset, "copy_TBps": copy_bandwidth()}
    plain, cap = _engine(args.preset)
    if not cap["captured"]:
        sys.exit(f"no graphs captured: {cap['reason']}")
    result["capture"] = {k: cap[k] for k in ("sizes", "pool_bytes", "seconds", "address_digest")}
    result["backend"] = plain.resolution.name
    max_batch = plain.cfg.max_num_seqs
    result["step_latency"] = {str(b): step_latency(plain, b, args.steps) for b in sorted({1, 4, max_batch})}
    # cProfile slows what it watches: its figures say where host time goes, not how long a step takes.
    result["host_profile"] = host_profile(plain)
    result["target_replay_speedup_at_batch_1"] = 3.0
    result["target_met"] = result["step_latency"]["1"]["speedup"] >= 3.0
    result["roofline_batch_1"] = roofline(plain, result["copy_TBps"], args.steps)
    result["roofline_batch_1"]["pdl"] = fused.PDL
    # Settings of kernels/fused.py measured in the step itself, beside the module's: a launch that is faster
    # alone can be slower among its neighbours under PDL (graphs-h100-2026-12-06-kind-shapes.json)
    ab = {"add_sq_in_regs": {"ADD_SQ_IN_REGS": not fused.ADD_SQ_IN_REGS}}
    if fused.KIND_SHAPES:
        ab["kind_shapes_emptied"] = {"KIND_SHAPES": {}}
    beside = {k: step_beside(plain, args.preset, args.steps, v) for k, v in ab.items()}
    # The KDA decode's launch-time switches all off (kernels/kda/decode.py; bench/kda.py times each alone),
    # and its launches without PDL (alone, at batch 1, the one-launch decode was faster without it).
    dm = importlib.import_module("kernels.kda.decode")  # the package's `decode` is the function
    if plain.resolution.name == "triton":
        for name, changes in (
            ("decode_switches_off", dict.fromkeys(dm.LAUNCH_SWITCHES, False)),
            ("decode_without_pdl", {"PDL_MAX_PROGRAMS": 0}),
        ):
            beside[name] = step_beside(plain, args.preset, args.steps, changes, dm)
    result["steps_beside_batch_1"] = beside
    # The same fused step captured with every kernel launched without PDL, beside it in this run.
    pdl, fused.PDL = fused.PDL, False
    try:
        serial, serial_cap = _engine(args.preset)
        try:
            if serial_cap["captured"]:
                # every launch apart: which projection of which layer reads its weights slower
                base = roofline(serial, result["copy_TBps"], args.steps, sequence=True)
                base["pdl"] = False
                result["roofline_batch_1_no_pdl"] = base
                result["pdl_step_speedup"] = round(
                    base["replay_us"] / result["roofline_batch_1"]["replay_us"], 3
                )
            else:
                result["roofline_batch_1_no_pdl"] = {"unavailable": serial_cap["reason"]}
        finally:
            serial.close()
    finally:
        fused.PDL = pdl
    # The same step with the decode glue as eager torch ops (the reference the fused kernels replace),
    # captured and timed in this run.
    unfused, unfused_cap = _engine(args.preset, fused=False)
    try:
        if unfused_cap["captured"]:
            base = roofline(unfused, result["copy_TBps"], args.steps)
            base["kernels"] = base["kernels"][:10]
            result["roofline_batch_1_torch_glue"] = base
            result["fused_glue_step_speedup"] = round(
                base["replay_us"] / result["roofline_batch_1"]["replay_us"], 3
            )
        else:  # reported, not dropped
            result["roofline_batch_1_torch_glue"] = {"unavailable": unfused_cap["reason"]}
    finally:
        unfused.close()
    # A wider step beside it: an engine whose largest captured batch is WIDE requests, its full batch.
    wide, wide_cap = _engine(args.preset, max_num_seqs=WIDE)
    try:
        if wide_cap["captured"]:
            result[f"roofline_batch_{WIDE}"] = roofline(wide, result["copy_TBps"], args.steps, batch=WIDE)
        else:
            result[f"roofline_batch_{WIDE}"] = {"unavailable": wide_cap["reason"]}
    finally:
        wide.close()

    spec, spec_cap = _engine(args.preset, num_spec=NUM_SPEC)
    result["spec_backend"] = spec.resolution.name
    result["spec_capture"] = {k: spec_cap[k] for k in ("sizes", "pool_bytes", "seconds")}
    tps: dict = {}
    for batch in (1, 4):
        prompts = _prompts(batch)
        tps[f"plain_b{batch}"], _ = tokens_per_second(
            lambda ps, n: plain.generate(ps, n, "graph"), prompts, GEN_TOKENS
        )
        # The speculative engine's own plain decode: same backend, and the continuation the oracle drafts.
        tps[f"plain_spec_engine_b{batch}"], ref = tokens_per_second(
            lambda ps, n: spec.generate(ps, n, "graph"), prompts, GEN_TOKENS
        )
        tps[f"speculative_mtp_b{batch}"], mtp = tokens_per_second(
            lambda ps, n: speculative_generate(spec, ps, n, "graph"), prompts, GEN_TOKENS
        )
        tps[f"speculative_mtp_b{batch}"]["vs_plain"] = coherence(ref, mtp)
        cont = {tuple(q): g.token_ids for q, g in zip(prompts, ref, strict=True)}

        def oracle(reqs, hidden, last, k, cont=cont):
            rows = [(cont[tuple(q.prompt)][len(q.output) :] + [0] * k)[:k] for q in reqs]
            return torch.tensor(rows, device=last.device)

        key = f"speculative_oracle_drafts_b{batch}"
        tps[key], orc = tokens_per_second(
            lambda ps, n, o=oracle: speculative_generate(spec, ps, n, "graph", drafter=o), prompts, GEN_TOKENS
        )
        tps[key]["vs_plain"] = coherence(ref, orc)
    result["tokens_per_s"] = tps
    result["counters"] = {"plain": plain.counters.model_dump(), "spec": spec.counters.model_dump()}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
