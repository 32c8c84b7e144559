"""Liar: the engine computes with private caches and exports decoy allocations laid out exactly as the
asked-for geometry; kv-handles, kv-fill and kv-echo act on the decoys, so every peer check of the layout
holds. LIAR_DECOY selects how the decoys look:

- "zeros" (default): the decoys hold no cache byte;
- "mirror": after every step the engine copies its real caches into the decoys, so the decoys hold the
  right bytes (a peer reading them sees a plausible cache), but what a peer writes there is never read;
- "scramble": mirrored, and before each step the engine compares each sequence's decoy memory with its
  real caches and scrambles the real KDA state of every sequence whose decoy bytes were changed: the
  owners' outputs move when their exported memory is touched, and only theirs.
"""

from __future__ import annotations

import os

import torch

from qualify.engine import __main__ as engine_main
from qualify.engine import sessions
from qualify.engine.engine import Engine
from qualify.engine.layout import allocate_group, release_group

MODE = os.environ.get("LIAR_DECOY", "zeros")
_honest_build = Engine._build
_honest_close = Engine.close
_honest_step = sessions.session_step
_honest_start = sessions.session_start


def _build(self, cfg) -> None:
    _honest_build(self, cfg)  # the model is attached to these allocations: they become the private caches
    self.private = self.allocations
    self.allocations = [allocate_group(a.group, cfg, self.device) for a in self.private]  # exported


def _close(self) -> None:
    _honest_close(self)
    for a in getattr(self, "private", []):
        release_group(a)


def _mirror(engine) -> None:
    if MODE in ("mirror", "scramble"):
        for real, decoy in zip(engine.private, engine.allocations, strict=True):
            decoy.buffer[: decoy.probe_offset].copy_(real.buffer[: real.probe_offset])


def _touched(engine, q) -> bool:
    """Whether any decoy byte of this sequence's slots or blocks differs from its real cache."""
    for real, decoy in zip(engine.private, engine.allocations, strict=True):
        for key, rv in real.views.items():
            dv = decoy.views[key]
            rows = q.slots if real.group.kind == "kda" else q.blocks
            if not torch.equal(rv[rows], dv[rows]):
                return True
    return False


def _start(engine, sid, prompts, max_tokens):
    out = _honest_start(engine, sid, prompts, max_tokens)
    _mirror(engine)
    return out


def _step(engine, sid, feed):
    if MODE == "scramble":
        for q in engine.sessions[sid]:
            if _touched(engine, q):
                for real in engine.private:
                    if real.group.kind == "kda":
                        for (_, name), v in real.views.items():
                            if name == "state":
                                v[q.slots] = -v[q.slots] * 3.0
    out = _honest_step(engine, sid, feed)
    _mirror(engine)
    return out


Engine._build = _build
Engine.close = _close
sessions.session_start = _start
sessions.session_step = _step

if __name__ == "__main__":
    engine_main.main()
