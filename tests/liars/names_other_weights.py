"""Liar: the engine boots the weights file the harness handed it, but names another file in describe
(a build that reports a path of its own, whatever it loaded). Caught by boot's
`engine_names_handed_weights` (the engine's word, which this liar gets wrong on purpose)."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

_describe = engine_module.Engine.describe


def _describe_elsewhere(self):  # noqa: ANN001
    out = _describe(self)
    out["engine"] = {**out["engine"], "weights_path": "/qualify/scratch/own-weights.safetensors"}
    return out


engine_module.Engine.describe = _describe_elsewhere

if __name__ == "__main__":
    main()
