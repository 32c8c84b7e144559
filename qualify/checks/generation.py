"""generation: raw greedy generation is coherent (coherence rule): replay vs eager when graphs were
captured, before vs after a same-weights reload, speculative vs plain when --spec (with speculation proved:
checks/speculation.py); and deterministic."""

from __future__ import annotations

from qualify.checks.base import (
    Check,
    Cond,
    Context,
    Outcome,
    coherence,
    engine_says,
    fail_unless,
    observed,
    tokens,
    well_formed,
)
from qualify.checks.speculation import prove


def run(ctx: Context) -> Outcome:
    comparisons: dict = {}
    conditions: dict[str, Cond] = {}
    # Prompts the engine has not seen, asked twice in requests of other composition, order and size: an
    # answer cached on the request cannot make them agree (checks/probes.py).
    prompts = ctx.fresh()
    plain = ctx.ask(prompts)
    again = ctx.ask(prompts)
    # One answer per prompt, each with tokens: an empty answer would make every comparison vacuous.
    formed = well_formed(plain, len(prompts)) and well_formed(again, len(prompts))
    conditions["tokens_generated"] = observed(formed)
    conditions["deterministic"] = observed(formed and tokens(plain) == tokens(again))
    if ctx.captured:
        replayed = ctx.fresh()
        eager = ctx.ask(replayed, mode="eager")
        graph = ctx.ask(replayed, mode="graph")
        comparisons["replay_vs_eager"] = coherence(eager, graph, reask=ctx.reask(mode="graph"))
        comparisons["replay_vs_eager"]["modes_used"] = [eager.mode_used, graph.mode_used]
        conditions["replay_vs_eager"] = observed(
            comparisons["replay_vs_eager"]["agrees"], comparisons["replay_vs_eager"].get("summary")
        )
        conditions["replay_ran_graphs"] = engine_says(
            eager.mode_used == "eager" and graph.mode_used == "graph",
            f"modes used {eager.mode_used}, {graph.mode_used}",
        )
    elif ctx.target == "cpu":  # no CUDA graph exists on a cpu target: an answer "graph" there is false
        comparisons["replay_vs_eager"] = {"not_applicable": "no graphs on a cpu target"}
        modes = [plain.mode_used, again.mode_used]
        conditions["eager_on_a_cpu_target"] = engine_says(
            all(m == "eager" for m in modes), f"modes used {modes}"
        )
    elif ctx.target == "gpu":  # a GPU target must replay graphs; no capture is no comparison, not a pass
        comparisons["replay_vs_eager"] = {"missing": "no graphs were captured on a gpu target"}
        conditions["replay_vs_eager"] = observed(False, "no graphs were captured on a gpu target")
    reload_cmp = ctx.facts.get("before_vs_after_reload")
    if reload_cmp is None:
        comparisons["before_vs_after_reload"] = {"missing": "the reload check did not produce a comparison"}
        conditions["before_vs_after_reload"] = observed(False, "the reload check made no comparison")
    else:
        comparisons["before_vs_after_reload"] = reload_cmp
        conditions["before_vs_after_reload"] = observed(reload_cmp["agrees"], reload_cmp.get("summary"))
    speculation: dict = {}
    if ctx.request.num_spec > 0:
        spec_conditions, speculation = prove(ctx, plain, prompts)
        conditions.update(spec_conditions)
        comparisons["speculative_vs_plain"] = speculation.pop("speculative_vs_plain")
        comparisons["speculative_drafts"] = speculation.pop("speculative_drafts")
        comparisons["speculative_drafts_set_aside"] = speculation.pop("speculative_drafts_set_aside")
    else:
        comparisons["speculative_vs_plain"] = {"not_applicable": "--spec none"}
    evidence = {
        "prompts": len(plain.choices),
        "probes": "recorded after the run",  # the seed and counts, once the engine has stopped
        "tokens_per_prompt": [len(t) for t in tokens(plain)],
        "mode_used": plain.mode_used,
        "comparisons": comparisons,
        **speculation,  # acceptance histograms and the engine's draft counters, with --spec
    }
    return fail_unless(conditions, evidence)


CHECK = Check("generation", run, timeout_s=240.0, times_engine=True)
