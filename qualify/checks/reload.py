"""reload: in-place reload keeps every parameter and arena address and recaptures nothing; output after it
equals output before; different weights change the output (graphs are not stale); then reload back."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, coherence, fail_unless, tokens
from qualify.protocol import ReloadRequest

OTHER_SEED_OFFSET = 7919  # any other seed gives other random weights


def run(ctx: Context) -> Outcome:
    d0 = ctx.client.describe()
    base = ctx.generate()
    same = ctx.client.reload(ReloadRequest())
    d1 = ctx.client.describe()
    after_same = ctx.generate()
    coh_same = coherence(base, after_same)
    ctx.facts["before_vs_after_reload"] = coh_same

    seed = int(d0.config.get("seed", 0)) + OTHER_SEED_OFFSET
    other = ctx.client.reload(ReloadRequest(seed=seed))
    with_other = ctx.generate()
    changed_output = tokens(with_other) != tokens(base)

    back = ctx.client.reload(ReloadRequest(path=same.weights_path))
    d2 = ctx.client.describe()
    restored = ctx.generate()
    eager_restored = ctx.generate(mode="eager")
    coh_back = coherence(base, restored)
    coh_fresh = coherence(eager_restored, restored)

    def counts(d):  # type: ignore[no-untyped-def]
        return {"graph_captures": d.counters.graph_captures, "graph_recaptures": d.counters.graph_recaptures}

    arenas0 = {k: v.address for k, v in d0.arenas.items()}
    evidence = {
        "same_weights": same.model_dump(mode="json"),
        "other_weights": {"seed": seed, **other.model_dump(mode="json")},
        "reload_back": back.model_dump(mode="json"),
        "before_vs_after_same_reload": coh_same,
        "output_changed_with_other_weights": changed_output,
        "restored_vs_first": coh_back,
        "replay_after_reload_vs_eager": coh_fresh,
        "counters": {"before": counts(d0), "after_same": counts(d1), "end": counts(d2)},
        "mode_used": after_same.mode_used,
    }
    return fail_unless(
        {
            "same_reload_keeps_parameter_addresses": same.census.addresses_unchanged,
            "same_reload_keeps_arena_addresses": same.census.arena_addresses_unchanged
            and {k: v.address for k, v in d1.arenas.items()} == arenas0,
            "same_reload_changes_no_weight": not same.census.changed
            and same.census.before_digest == same.census.after_digest,
            "no_recapture": counts(d1) == counts(d0) and counts(d2) == counts(d0),
            "output_same_after_same_reload": coh_same["agrees"],
            "other_weights_loaded_in_place": other.census.addresses_unchanged and bool(other.census.changed),
            "other_weights_change_output": changed_output,
            "reload_back_restores_weights": back.census.after_digest == same.census.before_digest
            and back.census.addresses_unchanged,
            "restored_output_equals_first": coh_back["agrees"],
            "replay_after_reload_equals_eager": coh_fresh["agrees"],
        },
        evidence,
    )


CHECK = Check("reload", run, timeout_s=240.0)
