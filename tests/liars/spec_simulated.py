"""Liar: speculation simulated. Asked to speculate, the engine decodes plainly, then reports for each verify
step the acceptance a greedy verifier would have reached with those drafts against its own plain output (the
harness's drafts where given, its own output as "MTP drafts" otherwise), and moves its draft counters to
match. Its tokens, per-step reports and counters all agree with each other and reproduce the harness's
acceptance histogram exactly; what it cannot fake is the step count: it takes as long as plain decoding
(checks/timing.py)."""

from __future__ import annotations

from qualify.engine import spec
from qualify.engine.__main__ import main


def simulated(engine, prompts, max_tokens, mode="auto", drafter=None, drafts=None):
    gens, used = engine.generate(prompts, max_tokens, mode)
    S = engine.cfg.num_spec
    for g in gens:
        out, a, steps = g.token_ids, 0, []
        while a < len(out) - 1:
            s = len(steps)
            row = drafts[s] if drafts is not None and s < len(drafts) else out[a + 1 : a + 1 + S]
            m = 0
            while m < min(S, len(row)) and a + 1 + m < len(out) and row[m] == out[a + 1 + m]:
                m += 1
            steps.append(m)
            a += m + 1
        g.accepted_per_step = steps
        engine.counters.spec_drafted += S * len(steps)
        engine.counters.spec_accepted += sum(steps)
    return gens, used, spec.SpecCounters()


spec.speculative_generate = simulated

if __name__ == "__main__":
    main()
