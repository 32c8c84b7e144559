"""generation: raw greedy generation is coherent (coherence rule): replay vs eager when graphs were
captured, before vs after a same-weights reload, speculative vs plain when --spec; and deterministic."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, coherence, fail_unless, tokens


def run(ctx: Context) -> Outcome:
    comparisons: dict = {}
    conditions: dict[str, bool] = {}
    plain = ctx.generate()
    again = ctx.generate()
    conditions["deterministic"] = tokens(plain) == tokens(again)
    conditions["tokens_generated"] = all(len(t) > 0 for t in tokens(plain))
    if ctx.captured:
        eager = ctx.generate(mode="eager")
        graph = ctx.generate(mode="graph")
        comparisons["replay_vs_eager"] = coherence(eager, graph)
        conditions["replay_vs_eager"] = comparisons["replay_vs_eager"]["agrees"]
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
