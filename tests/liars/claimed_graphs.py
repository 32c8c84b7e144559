"""Liar: graphs claimed, never captured. `/qualify/capture` answers a full report (every size, plans, a
pool, an address digest) and moves the capture counter; every step runs eagerly, and any answer not asked
for eagerly says `mode_used: "graph"` and moves the replay counter. Every replay-vs-eager comparison is then
an eager-vs-eager one. On a CPU target (no CUDA at all) the claim itself is false; on a GPU only the
harness's timing of graph steps against eager steps can tell (checks/capture.py)."""

from __future__ import annotations

import hashlib

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main
from qualify.engine.graphs import CaptureEnvelope

Engine = engine_module.Engine
_generate = Engine.generate


def claimed_capture(self) -> dict:
    env = CaptureEnvelope.from_config(self.cfg)
    T = env.tokens_per_request
    plans = [[size // T, T] for size in env.sizes]
    self.counters.graph_captures += len(plans)
    self._claims_graphs = True
    digest = "sha256:" + hashlib.sha256(repr(plans).encode()).hexdigest()
    return {"captured": True, "reason": None, "sizes": list(env.sizes), "pool_bytes": 1 << 20,
            "seconds": 0.05, "address_digest": digest, "plans": plans}  # fmt: skip


def eager_called_graph(self, prompts, max_tokens, mode="auto"):
    gens, used = _generate(self, prompts, max_tokens, "eager")
    if mode != "eager" and getattr(self, "_claims_graphs", False):
        self.counters.graph_replays += max_tokens
        return gens, "graph"
    return gens, used


Engine.capture, Engine.generate = claimed_capture, eager_called_graph

if __name__ == "__main__":
    main()
