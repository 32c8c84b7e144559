"""generation: raw greedy generation is coherent (coherence rule): replay vs eager when graphs were
captured, before vs after a same-weights reload, speculative vs plain when --spec; and deterministic."""

from __future__ import annotations

from qualify.checks.base import PROMPTS, Check, Context, Outcome, coherence, fail_unless, tokens, well_formed


def run(ctx: Context) -> Outcome:
    comparisons: dict = {}
    conditions: dict[str, bool] = {}
    plain = ctx.generate()
    again = ctx.generate()
    # One answer per prompt, each with tokens: an empty answer would make every comparison vacuous.
    conditions["tokens_generated"] = well_formed(plain, len(PROMPTS)) and well_formed(again, len(PROMPTS))
    conditions["deterministic"] = conditions["tokens_generated"] and tokens(plain) == tokens(again)
    if ctx.captured:
        eager = ctx.generate(mode="eager")
        graph = ctx.generate(mode="graph")
        comparisons["replay_vs_eager"] = coherence(eager, graph)
        comparisons["replay_vs_eager"]["modes_used"] = [eager.mode_used, graph.mode_used]
        conditions["replay_vs_eager"] = comparisons["replay_vs_eager"]["agrees"]
        conditions["replay_ran_graphs"] = eager.mode_used == "eager" and graph.mode_used == "graph"
    elif ctx.target == "gpu":  # a GPU target must replay graphs; no capture is no comparison, not a pass
        comparisons["replay_vs_eager"] = {"missing": "no graphs were captured on a gpu target"}
        conditions["replay_vs_eager"] = False
    else:
        comparisons["replay_vs_eager"] = {"not_applicable": "no graphs were captured on this target"}
    reload_cmp = ctx.facts.get("before_vs_after_reload")
    if reload_cmp is None:
        comparisons["before_vs_after_reload"] = {"missing": "the reload check did not produce a comparison"}
        conditions["before_vs_after_reload"] = False
    else:
        comparisons["before_vs_after_reload"] = reload_cmp
        conditions["before_vs_after_reload"] = reload_cmp["agrees"]
    if ctx.request.num_spec > 0:
        spec = ctx.generate(speculative=True)
        comparisons["speculative_vs_plain"] = coherence(plain, spec)
        conditions["speculative_vs_plain"] = comparisons["speculative_vs_plain"]["agrees"]
    else:
        comparisons["speculative_vs_plain"] = {"not_applicable": "--spec none"}
    evidence = {
        "prompts": len(plain.choices),
        "tokens_per_prompt": [len(t) for t in tokens(plain)],
        "mode_used": plain.mode_used,
        "comparisons": comparisons,
    }
    return fail_unless(conditions, evidence)


CHECK = Check("generation", run, timeout_s=240.0)
