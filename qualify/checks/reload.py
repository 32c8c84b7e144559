"""reload: in-place reload keeps every parameter and arena address and recaptures nothing; output after it
equals output before; different weights change the output, and captured graphs replay them exactly as an
eager step does (graphs are not stale); then reload back to the weights the receipt names."""

from __future__ import annotations

from typing import Any

from qualify.checks.base import Check, Context, Outcome, coherence, engine_says, fail_unless, observed, tokens
from qualify.protocol import Describe, ReloadRequest

OTHER_SEED_OFFSET = 7919  # any other seed gives other random weights


def _counts(d: Describe) -> dict[str, int]:
    return {"graph_captures": d.counters.graph_captures, "graph_recaptures": d.counters.graph_recaptures}


def run(ctx: Context) -> Outcome:
    # With graphs captured every comparison below replays them: mode "graph" refuses to run eagerly.
    replay = "graph" if ctx.captured else "auto"
    d0 = ctx.client.describe()
    subject_weights = ctx.describe.engine.weights_digest if ctx.describe else d0.engine.weights_digest
    fresh_eager = ctx.generate(mode="eager")  # the engine as booted, before any reload, stepping eagerly
    base = ctx.generate(mode=replay)
    same = ctx.client.reload(ReloadRequest(), timeout_s=ctx.remaining())
    d1 = ctx.client.describe()
    after_same = ctx.generate(mode=replay)
    coh_same = coherence(base, after_same, reask=ctx.reask(mode=replay))
    ctx.facts["before_vs_after_reload"] = coh_same

    seed = int(d0.config.get("seed", 0)) + OTHER_SEED_OFFSET
    # Each comparison is made (teacher forcing included) before the next reload changes the engine.
    other = ctx.client.reload(ReloadRequest(seed=seed), timeout_s=ctx.remaining())
    with_other = ctx.generate(mode=replay)
    with_other_eager = ctx.generate(mode="eager")
    changed_output = tokens(with_other) != tokens(base)
    coh_other = coherence(with_other_eager, with_other, reask=ctx.reask(mode=replay))

    back = ctx.client.reload(ReloadRequest(path=same.weights_path), timeout_s=ctx.remaining())
    d2 = ctx.client.describe()
    restored = ctx.generate(mode=replay)
    coh_back = coherence(base, restored, reask=ctx.reask(mode=replay))
    coh_fresh = coherence(fresh_eager, restored, reask=ctx.reask(mode=replay))

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
        "counters": {"before": _counts(d0), "after_same": _counts(d1), "end": _counts(d2)},
    }
    conditions = {
        "same_reload_keeps_parameter_addresses": engine_says(same.census.addresses_unchanged),
        "same_reload_keeps_arena_addresses": engine_says(
            same.census.arena_addresses_unchanged and {k: v.address for k, v in d1.arenas.items()} == arenas0
        ),
        "same_reload_changes_no_weight": engine_says(
            not same.census.changed and same.census.before_digest == same.census.after_digest,
            f"changed: {same.census.changed[:5]}" if same.census.changed else None,
        ),
        "census_starts_from_the_subject_weights": engine_says(same.census.before_digest == subject_weights),
        "no_recapture": engine_says(_counts(d1) == _counts(d0) and _counts(d2) == _counts(d0)),
        "no_graph_address_moved": engine_says(all(not m for m in moved.values())),
        "output_same_after_same_reload": observed(coh_same["agrees"], coh_same.get("summary")),
        "other_weights_loaded_in_place": engine_says(
            other.census.addresses_unchanged and bool(other.census.changed)
        ),
        # Tokens the harness compared itself: new weights must change what the engine generates...
        "other_weights_change_output": observed(changed_output),
        # ...and replayed graphs must agree with an eager step on them (graphs are not stale).
        "other_weights_replay_equals_eager": observed(coh_other["agrees"], coh_other.get("summary")),
        "reload_back_restores_weights": engine_says(
            back.census.after_digest == same.census.before_digest and back.census.addresses_unchanged
        ),
        "weights_at_end_are_the_subject": engine_says(d2.engine.weights_digest == subject_weights),
        "restored_output_equals_first": observed(coh_back["agrees"], coh_back.get("summary")),
        "replay_after_reload_equals_fresh_eager": observed(coh_fresh["agrees"], coh_fresh.get("summary")),
    }
    if ctx.captured:
        conditions["every_comparison_replayed_graphs"] = engine_says(
            all(m == "graph" for m in replay_modes), f"modes used {replay_modes}"
        )
    return fail_unless(conditions, evidence)


CHECK = Check("reload", run, timeout_s=240.0)
