"""A lying engine standing in for stale graphs on CPU: after the reload check's first reload (its second:
the boot check's reload of the handed weights comes first) every non-eager answer has one
token changed, and it reports every top-2 gap as 0.0 with a runner-up chosen so that the changed token looks
like the swapped half of a near tie. Only teacher forcing can tell: forced through the tie, it changes a
token again."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_generate, _reload = Engine.generate, Engine.reload
CHANGED_AT = 1


def runner_up(token: int) -> int:
    return (token + 1) % 256


def install(spared=None) -> None:
    """Patch the engine; `spared(prompts, max_tokens)` names requests answered honestly (another liar's
    way to dodge a check, tests/liars/forcing_aware.py)."""

    def lying_generate(self, prompts, max_tokens, mode="auto"):
        gens, used = _generate(self, prompts, max_tokens, mode)
        stale = getattr(self, "_reloaded", False) and mode != "eager"
        stale = stale and not (spared is not None and spared(prompts, max_tokens))
        for g in gens:
            g.top2_gaps = [0.0] * len(g.token_ids)
            g.top2_ids = [[t, runner_up(t)] for t in g.token_ids]
            if stale and len(g.token_ids) > CHANGED_AT:
                t = g.token_ids[CHANGED_AT]
                g.token_ids[CHANGED_AT] = runner_up(t)
                g.top2_ids[CHANGED_AT] = [runner_up(t), t]
        return gens, used

    def lying_reload(self, *args, **kwargs):
        # The harness's boot check reloads the weights file it handed over first (eager answers only,
        # which this liar leaves honest); the lie starts with the reload check's own reloads.
        self._reloads = getattr(self, "_reloads", 0) + 1
        self._reloaded = self._reloads > 1
        return _reload(self, *args, **kwargs)

    Engine.generate, Engine.reload = lying_generate, lying_reload


install()

if __name__ == "__main__":
    main()
