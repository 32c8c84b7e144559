"""Liar: near ties forced except when teacher-forced. After its first reload every non-eager answer has one
token changed, and every top-2 gap reads 0.0 with a runner-up that dresses the change as the swapped half
of a near tie; but a request shaped like the harness's old teacher forcing (one prompt of token ids, fewer
tokens than the usual 12) is answered honestly, so forcing through the "tie" confirms it. Only forcing
requests shaped like every other request make it lie to them too (checks/probes.py)."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_generate, _reload = Engine.generate, Engine.reload
CHANGED_AT = 1
USUAL_TOKENS = 12


def runner_up(token: int) -> int:
    return (token + 1) % 256


def looks_forced(prompts, max_tokens: int) -> bool:
    return len(prompts) == 1 and max_tokens < USUAL_TOKENS


def lying_generate(self, prompts, max_tokens, mode="auto"):
    gens, used = _generate(self, prompts, max_tokens, mode)
    stale = getattr(self, "_reloaded", False) and mode != "eager" and not looks_forced(prompts, max_tokens)
    for g in gens:
        g.top2_gaps = [0.0] * len(g.token_ids)
        g.top2_ids = [[t, runner_up(t)] for t in g.token_ids]
        if stale and len(g.token_ids) > CHANGED_AT:
            t = g.token_ids[CHANGED_AT]
            g.token_ids[CHANGED_AT] = runner_up(t)
            g.top2_ids[CHANGED_AT] = [runner_up(t), t]
    return gens, used


def lying_reload(self, *args, **kwargs):
    # The boot check's reload of the handed weights file comes first (eager answers, left honest): the lie
    # starts with the reload check's own reloads.
    self._reloads = getattr(self, "_reloads", 0) + 1
    self._reloaded = self._reloads > 1
    return _reload(self, *args, **kwargs)


Engine.generate, Engine.reload = lying_generate, lying_reload

if __name__ == "__main__":
    main()
