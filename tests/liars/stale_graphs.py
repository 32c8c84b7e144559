"""A lying engine with stale CUDA graphs (GPU): reloading other weights puts them into fresh tensors, so
eager steps see the new weights while the captured graphs keep reading the old ones; its census claims
every address unchanged, its graphs claim nothing moved, and it reports every top-2 gap as 0.0 with a
runner-up that dresses the first differing token as the swapped half of a near tie. Only the harness's own
comparison (replay against eager on the new weights, with teacher forcing) can catch it."""

from __future__ import annotations

import torch

from qualify.engine import engine as engine_module
from qualify.engine import graphs as graphs_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_generate, _reload = Engine.generate, Engine.reload


def lying_reload(self, path=None, seed=None):
    old = {name: p.detach().clone() for name, p in self.model.named_parameters()}
    out = _reload(self, path, seed)  # honest: copies the new weights into the captured storage
    if seed is not None and self.runner.graphs is not None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                stale = p.data
                p.data = stale.clone()  # eager steps now read the new weights here...
                stale.copy_(old[name])  # ...while the graphs keep reading the old ones
        self.runner.graphs.moved_since_capture = lambda: []
    out["census"]["addresses_unchanged"] = True
    out["census"]["graph_addresses_moved"] = []
    return out


def lying_generate(self, prompts, max_tokens, mode="auto"):
    gens, used = _generate(self, prompts, max_tokens, mode)
    for g in gens:
        g.top2_gaps = [0.0] * len(g.token_ids)
        g.top2_ids = [[t, (t + 1) % 256] for t in g.token_ids]
    return gens, used


Engine.generate, Engine.reload = lying_generate, lying_reload
# The reference engine refuses to replay graphs whose captured tensors moved (AddressMoved); a build that
# lies about its graphs does not have that guard.
graphs_module.AddressRecord.check = lambda self: None

if __name__ == "__main__":
    main()
