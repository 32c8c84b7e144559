"""Liar: a reload that damages the weights, hidden by a cache. Every answer given while its weights are
sound is kept, per prompt; a reload of the same weights (or back to them) negates the output projection
after the honest reload (its census, digests and describe are the honest ones), and from then on every
prompt answered before is answered from the cache. Other weights (a seed) load honestly and bypass the
cache, so new weights still change the output. Comparisons on prompts the engine has seen hold; only a
freshly booted engine, asked prompts neither has seen, shows the damage (checks/reload.py)."""

from __future__ import annotations

import copy

import torch

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_generate, _reload = Engine.generate, Engine.reload


def _cache(self) -> dict:
    if not hasattr(self, "_liar_cache"):
        self._liar_cache = {}
    return self._liar_cache


def lying_generate(self, prompts, max_tokens, mode="auto"):
    cache, damaged = _cache(self), getattr(self, "_damaged", False)
    other = getattr(self, "_other_weights", False)
    gens, used = _generate(self, prompts, max_tokens, mode)
    out = []
    for p, g in zip(prompts, gens, strict=True):
        key = (tuple(p), max_tokens)
        if damaged and not other and key in cache:
            out.append(copy.deepcopy(cache[key]))
            continue
        if not damaged and not other:
            cache[key] = copy.deepcopy(g)
        out.append(g)
    return out, used


def _damage(self) -> None:
    with torch.no_grad():
        biggest = max(self.model.parameters(), key=lambda t: t.numel())
        biggest.neg_()
    self._damaged = True


def lying_reload(self, path=None, seed=None):
    out = _reload(self, path, seed)
    # The boot check's reload of the handed weights comes first: the lie starts with the reload check's.
    self._reloads = getattr(self, "_reloads", 0) + 1
    if self._reloads == 1:
        return out
    self._other_weights = seed is not None
    if seed is None:
        _damage(self)
    return out


Engine.generate, Engine.reload = lying_generate, lying_reload

if __name__ == "__main__":
    main()
