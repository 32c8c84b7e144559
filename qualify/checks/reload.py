"""reload: in-place reload keeps every parameter and arena address and recaptures nothing; output after it
equals output before; different weights change the output, and captured graphs replay them exactly as an
eager step does (graphs are not stale); then reload back to the weights the receipt names. Every comparison
is made on prompts drawn for this run, in requests of other composition, order and size (checks/probes.py);
and answers the engine gave after each same-weights reload, on prompts it had not seen, are compared with a
freshly booted engine's on the same prompts, which that engine has not seen either: an engine that answers
the harness's repeated prompts from a cache while its weights were damaged by a reload is caught there."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from qualify.checks.base import (
    GEN_TOKENS,
    Check,
    Cond,
    Context,
    Outcome,
    coherence,
    engine_says,
    fail_unless,
    observed,
    tokens,
)
from qualify.client import EngineClient
from qualify.launch.base import EngineOptions
from qualify.protocol import CompletionRequest, CompletionResponse, Describe, ReloadRequest
from qualify.run.geometry import geometry_for

OTHER_SEED_OFFSET = 7919  # any other seed gives other random weights
FRESH_BOOT_S = 300.0


def fresh_options(ctx: Context) -> EngineOptions:
    """The options the engine under test was launched with: the launcher's own, else what
    qualify.run.pipeline.make_launcher gives it."""
    own = getattr(ctx.launcher, "options", None)
    if isinstance(own, EngineOptions):
        return own
    r = ctx.request
    extra = geometry_for(r).engine_args()
    return EngineOptions(preset=r.preset, kda_backend=r.kda_backend, num_spec=r.num_spec, extra_args=extra)


class FreshReference:
    """A fresh engine of the same build and options (the launcher's sibling), booted in a thread while the
    reload check talks to the engine under test; `answers` asks it each group of prompts eagerly, in a
    request of its own; `close` stops it whatever happened."""

    def __init__(self, ctx: Context, boot_s: float | None = None) -> None:
        self.ctx = ctx
        self.boot_s = boot_s  # the boot's own bound; None: what the reload check has left
        self.closed = False
        self.url: str | None = None
        self.error: str | None = None
        self.t0 = time.monotonic()
        self.booted_s: float | None = None
        self.settled_s = 0.0  # waited for its boot before checks that time the engine under test
        try:
            self.ref: Any = ctx.launcher.sibling(fresh_options(ctx), "fresh-reference")
        except NotImplementedError as exc:
            self.ref, self.error = None, str(exc)
        self.thread = threading.Thread(target=self._boot, name="fresh-reference-boot", daemon=True)
        if self.ref is not None:
            self.thread.start()

    def _boot(self) -> None:
        try:
            bound = self.boot_s if self.boot_s is not None else self.ctx.remaining()
            self.url = self.ref.start(min(FRESH_BOOT_S, bound))
            self.booted_s = time.monotonic() - self.t0
        except Exception as exc:  # a reference that cannot boot fails the comparison, never the run
            self.error = f"{type(exc).__name__}: {exc}"[:400]

    def settle(self, timeout_s: float) -> float:
        """Wait (bounded) for the boot to end, before a check that times the engine; the seconds waited."""
        t0 = time.monotonic()
        if self.ref is not None:
            self.thread.join(max(0.0, timeout_s))
        waited = time.monotonic() - t0
        self.settled_s += waited
        return waited

    def answers(
        self, asked: list[tuple[list[Any], CompletionResponse]]
    ) -> tuple[list[CompletionResponse] | None, dict[str, Any]]:
        if self.ref is not None:
            self.thread.join(max(0.0, min(FRESH_BOOT_S, self.ctx.remaining())))
        if self.url is None:
            return None, {"error": self.error or "the fresh engine did not boot within the check's time"}
        client: EngineClient | None = None
        try:
            client = self.ctx.client_for(self.url, max(1.0, self.ctx.remaining()), self.ref.netns)
            out = [
                client.complete(CompletionRequest(prompt=prompts, max_tokens=GEN_TOKENS, mode="eager"))
                for prompts, _ in asked
            ]
            weights = client.describe().engine.weights_digest
        except Exception as exc:  # an answer it cannot give fails the comparison, never the run
            return None, {"url": self.url, "error": f"{type(exc).__name__}: {exc}"[:400]}
        finally:
            if client is not None:
                client.close()
        seconds = {
            "boot": round(self.booted_s or 0.0, 3),
            "total": round(time.monotonic() - self.t0, 3),
            "settled_before_timed_checks": round(self.settled_s, 3),
        }
        return out, {
            "url": self.url,
            "launcher": self.ref.identity(),
            "weights_digest": weights,
            "seconds": seconds,
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ref is not None:
            with contextlib.suppress(Exception):
                self.ref.stop(5.0)
            self.thread.join(10.0)


def _moved_params(r: Any) -> str:
    return f"{r.census.params} parameters: the census says some storage address changed"


def _counts(d: Describe) -> dict[str, int]:
    return {"graph_captures": d.counters.graph_captures, "graph_recaptures": d.counters.graph_recaptures}


EARLY_FREE_SHARE = 0.5  # an early fresh reference on a GPU: at least this share of each GPU free...
EARLY_FREE_TIMES = 4  # ...and at least this many times what the engine under test holds there...
EARLY_OWN_SHARE = 0.5  # ...which holds at least this share of the memory in use there (a GPU not shared)


def early_room(ctx: Context) -> tuple[bool, dict[str, Any]]:
    """Whether the GPU has room to boot the fresh reference beside the engine under test for the rest of
    the run (it then holds its memory until this check ends, where it held it only during this check),
    and is this run's alone: on every GPU the engine uses, by NVML, at least EARLY_FREE_SHARE of the memory
    is free, and EARLY_FREE_TIMES what the engine holds, and the engine holds at least EARLY_OWN_SHARE of
    the memory in use. Where not, or where NVML cannot say, the reference boots with this check: on a GPU
    shared by several runs (tests/harness/test_monitor_gpu.py runs seven at once on one), a reference
    booted early takes memory another run's engines need and CPU time from their timed steps. (whether,
    the figures)"""
    free, held = ctx.gpu_free(), ctx.gpu_memory()
    pid = ctx.launcher.status().detail.get("pid") if ctx.launcher.kind == "local" else None
    mine = (held or {}).get(pid) if isinstance(pid, int) else None
    facts: dict[str, Any] = {"free_total_bytes": free, "engine_bytes": mine}
    if not free or not mine or any(v is None for v in mine.values()):
        return False, {**facts, "why": "NVML does not say what the engine under test holds and what is free"}
    short = [
        i for i, used in mine.items()
        if i not in free or free[i][0] < max(EARLY_FREE_SHARE * free[i][1], EARLY_FREE_TIMES * (used or 0))
    ]  # fmt: skip
    if short:
        return False, {**facts, "why": f"too little free memory on GPU {short} for an early boot"}
    shared = [i for i, used in mine.items() if (used or 0) < EARLY_OWN_SHARE * (free[i][1] - free[i][0])]
    if shared:
        return False, {
            **facts,
            "why": f"GPU {shared} is shared: the engine holds less than half its memory in use",
        }
    return True, facts


def prefetch(ctx: Context, boot_s: float) -> None:
    """Boot the fresh reference as soon as boot has passed (the engine under test is up and has its
    kernels), beside the checks before this one, so that this check no longer waits the 4.6-6.3 s of its
    boot (most of this check's time, 2026-12-05, H100); on a GPU target only where the GPU has room for it
    for the rest of the run (`early_room`), else it boots with this check. On a GPU target a check that
    times the engine (capture) first waits for that boot to end (`settle`, bounded, the wait in the
    evidence), so that no boot shares the GPU and the host's cores with a timed step; the idle reference
    then only holds its memory. (Booted at ready on the H200 on 2026-12-03, before the capture check's
    sampling took the fastest of two pairs per sample, a run failed two capture conditions whose kinds later
    also came in runs without it: see bench/results/qualify-run-h200-2026-12-03-early-fresh-engine.json.
    Booted early in each of seven runs at once on one H100, one run's reference failed to create its cuBLAS
    handle for lack of memory, 2026-12-05: hence the room it asks for.) `run` takes it; the pipeline closes
    it."""
    if "reload" in ctx.prepared:
        return
    if ctx.target != "cpu":
        room, facts = early_room(ctx)
        ctx.facts["fresh_reference_early"] = {"booted_early": room, **facts}
        if not room:
            return
    ctx.prepared["reload"] = FreshReference(ctx, boot_s)


def run(ctx: Context) -> Outcome:
    fresh_ref = ctx.prepared.pop("reload", None) or FreshReference(ctx)  # boots while the checks run
    try:
        return _run(ctx, fresh_ref)
    finally:
        fresh_ref.close()


def _run(ctx: Context, fresh_ref: FreshReference) -> Outcome:
    # With graphs captured every comparison below replays them: mode "graph" refuses to run eagerly.
    replay = "graph" if ctx.captured else "auto"
    d0 = ctx.client.describe()
    subject_weights = ctx.describe.engine.weights_digest if ctx.describe else d0.engine.weights_digest
    prompts = ctx.fresh()
    fresh_eager = ctx.ask(prompts, mode="eager")  # the engine as booted, before any reload, stepping eagerly
    base = ctx.ask(prompts, mode=replay)
    same = ctx.client.reload(ReloadRequest(), timeout_s=ctx.remaining())
    d1 = ctx.client.describe()
    after_same = ctx.ask(prompts, mode=replay)
    coh_same = coherence(base, after_same, reask=ctx.reask(mode=replay))
    ctx.facts["before_vs_after_reload"] = coh_same
    unseen_after_same = ctx.fresh()  # for the fresh engine, later: what this engine answers now
    after_same_unseen = ctx.ask(unseen_after_same, mode=replay)

    seed = int(d0.config.get("seed", 0)) + OTHER_SEED_OFFSET
    # Each comparison is made (teacher forcing included) before the next reload changes the engine.
    other = ctx.client.reload(ReloadRequest(seed=seed), timeout_s=ctx.remaining())
    with_other = ctx.ask(prompts, mode=replay)
    with_other_eager = ctx.ask(prompts, mode="eager")
    changed_output = tokens(with_other) != tokens(base)
    coh_other = coherence(with_other_eager, with_other, reask=ctx.reask(mode=replay))

    back = ctx.client.reload(ReloadRequest(path=same.weights_path), timeout_s=ctx.remaining())
    d2 = ctx.client.describe()
    restored = ctx.ask(prompts, mode=replay)
    coh_back = coherence(base, restored, reask=ctx.reask(mode=replay))
    coh_fresh = coherence(fresh_eager, restored, reask=ctx.reask(mode=replay))
    unseen_restored = ctx.fresh()
    restored_unseen = ctx.ask(unseen_restored, mode=replay)
    asked = [(unseen_after_same, after_same_unseen), (unseen_restored, restored_unseen)]
    fresh, fresh_info = fresh_ref.answers(asked)
    vs_fresh: list[dict[str, Any]] = []
    if fresh is not None:
        reask = ctx.reask(mode=replay)  # the engine now has the subject weights, as it had for both
        pairs = zip(fresh, asked, strict=True)
        vs_fresh = [coherence(ref, cand, len(p), reask=reask) for ref, (p, cand) in pairs]

    arenas0 = {k: v.address for k, v in d0.arenas.items()}
    moved: dict[str, Any] = {
        name: r.census.graph_addresses_moved for name, r in (("same", same), ("other", other), ("back", back))
    }
    replay_modes = [r.mode_used for r in (base, after_same, with_other, restored)]
    evidence = {
        "replay_mode": replay,
        "modes_used": replay_modes,
        "same_weights": same.model_dump(mode="json"),
        "other_weights": {"seed": seed, **other.model_dump(mode="json")},
        "reload_back": back.model_dump(mode="json"),
        "subject_weights_digest": subject_weights,
        "weights_digest_at_end": d2.engine.weights_digest,
        "before_vs_after_same_reload": coh_same,
        "output_changed_with_other_weights": changed_output,
        "other_weights_replay_vs_eager": coh_other,
        "restored_vs_first": coh_back,
        "replay_after_reload_vs_fresh_eager": coh_fresh,
        "graph_addresses_moved": moved,
        "fresh_engine": {
            **fresh_info,
            "early": ctx.facts.get("fresh_reference_early"),
            "after_same_reload": vs_fresh[:1],
            "restored": vs_fresh[1:],
        },
        "counters": {"before": _counts(d0), "after_same": _counts(d1), "end": _counts(d2)},
    }
    conditions = {
        "same_reload_keeps_parameter_addresses": engine_says(
            same.census.addresses_unchanged, None if same.census.addresses_unchanged else _moved_params(same)
        ),
        "same_reload_keeps_arena_addresses": engine_says(
            same.census.arena_addresses_unchanged and {k: v.address for k, v in d1.arenas.items()} == arenas0
        ),
        "same_reload_changes_no_weight": engine_says(
            not same.census.changed and same.census.before_digest == same.census.after_digest,
            f"changed: {same.census.changed[:5]}" if same.census.changed else None,
        ),
        "census_starts_from_the_subject_weights": engine_says(
            same.census.before_digest == subject_weights,
            f"census before_digest {same.census.before_digest}; describe's weights_digest at boot "
            f"{subject_weights} (they must be the same digest of the loaded parameters)",
        ),
        "no_recapture": engine_says(
            _counts(d1) == _counts(d0) and _counts(d2) == _counts(d0),
            f"graph counters before {_counts(d0)}, after the same reload {_counts(d1)}, "
            f"at the end {_counts(d2)}",
        ),
        "no_graph_address_moved": engine_says(
            all(not m for m in moved.values()), f"graph addresses moved: {moved}"
        ),
        "output_same_after_same_reload": observed(coh_same["agrees"], coh_same.get("summary")),
        "other_weights_loaded_in_place": engine_says(
            other.census.addresses_unchanged and bool(other.census.changed),
            f"seed {seed}: addresses unchanged {other.census.addresses_unchanged}, "
            f"{len(other.census.changed)} of {other.census.params} parameters changed",
        ),
        # Tokens the harness compared itself: new weights must change what the engine generates...
        "other_weights_change_output": observed(
            changed_output, None if changed_output else f"seed {seed}: the tokens equal the first weights'"
        ),
        # ...and replayed graphs must agree with an eager step on them (graphs are not stale).
        "other_weights_replay_equals_eager": observed(coh_other["agrees"], coh_other.get("summary")),
        "reload_back_restores_weights": engine_says(
            back.census.after_digest == same.census.before_digest and back.census.addresses_unchanged,
            f"reloading {same.weights_path}: after_digest {back.census.after_digest}, first "
            f"{same.census.before_digest}; addresses unchanged {back.census.addresses_unchanged}",
        ),
        "weights_at_end_are_the_subject": engine_says(
            d2.engine.weights_digest == subject_weights,
            f"weights_digest at the end {d2.engine.weights_digest}, at boot {subject_weights}",
        ),
        "restored_output_equals_first": observed(coh_back["agrees"], coh_back.get("summary")),
        "replay_after_reload_equals_fresh_eager": observed(coh_fresh["agrees"], coh_fresh.get("summary")),
        # A freshly booted engine (the harness's own launch) on prompts neither engine had seen.
        "after_same_reload_equals_a_fresh_engine": _vs_fresh(vs_fresh[:1], fresh_info),
        "restored_equals_a_fresh_engine": _vs_fresh(vs_fresh[1:], fresh_info),
    }
    if ctx.captured:
        conditions["every_comparison_replayed_graphs"] = engine_says(
            all(m == "graph" for m in replay_modes), f"modes used {replay_modes}"
        )
    return fail_unless(conditions, evidence)


def _vs_fresh(reports: list[dict[str, Any]], info: dict[str, Any]) -> Cond:
    if not reports:
        return observed(False, f"no fresh engine to compare with: {info.get('error', 'no answer')}")
    r = reports[0]
    return observed(r["agrees"], r.get("summary"))


CHECK = Check("reload", run, timeout_s=240.0, prepare=prefetch)
