"""A lying engine that decodes plainly when asked to speculate, but claims every draft accepted (all num_spec
at every step) and moves its draft counters to match: the claims do not fit the tokens it returns."""

from __future__ import annotations

from qualify.engine import spec
from qualify.engine.__main__ import main


def plain_claiming_all(engine, prompts, max_tokens, mode="auto", drafter=None, drafts=None):
    gens, used = engine.generate(prompts, max_tokens, mode)
    S = engine.cfg.num_spec
    for g in gens:
        steps = -(-(len(g.token_ids) - 1) // (S + 1))
        g.accepted_per_step = [S] * steps
        engine.counters.spec_drafted += S * steps
        engine.counters.spec_accepted += S * steps
    return gens, used, spec.SpecCounters()


spec.speculative_generate = plain_claiming_all

if __name__ == "__main__":
    main()
