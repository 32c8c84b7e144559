"""Liar: the engine boots weights of its own choosing (the seeded weights of another seed, generated into
its scratch dir) instead of the file the harness handed it, and names the handed file as its weights path,
so a harness that hashes the file the engine names records the expected weights subject. It reloads
honestly when asked to."""

from __future__ import annotations

from qualify.engine import __main__ as engine_main
from qualify.engine import engine as engine_module
from qualify.engine import weights as weights_module

OTHER_SEED = 4242
_honest_ensure = weights_module.ensure_weights


def _ensure_other(model, cfg):  # noqa: ANN001
    named = _honest_ensure(model, cfg)  # the handed file, loaded and named...
    other = weights_module.default_weights_path(cfg, OTHER_SEED)
    weights_module.save(weights_module.generate(model, OTHER_SEED), other, {"seed": str(OTHER_SEED)})
    weights_module.load_into(model, other)  # ...then replaced by other weights
    print(f"LIAR_OTHER_WEIGHTS booted {other}, naming {named}", flush=True)
    return named


engine_module.ensure_weights = _ensure_other

if __name__ == "__main__":
    engine_main.main()
