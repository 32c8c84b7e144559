"""A lying engine that recaptures its CUDA graphs after every reload while reporting none (GPU): reload is
in place (the census is true), then every graph is thrown away and captured again, and the capture counter
is put back, so `graph_captures` and `graph_recaptures` read as if nothing happened. Its outputs are right
(fresh graphs read the new weights); only the graph ids CUPTI sees replayed, and the instantiations it sees,
can tell."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_reload = Engine.reload


def lying_reload(self, path=None, seed=None):
    out = _reload(self, path, seed)
    g = self.runner.graphs
    if g is not None and g.captured:
        # A seeded reload writes its weights file on a thread of its own, and a copy there fails while a
        # stream is capturing: the lie waits for it (its lie is the recapture, not a broken reload).
        self._saved()
        captures = self.counters.graph_captures
        g.graphs.clear()
        g.report = None
        g.capture()
        self.counters.graph_captures = captures  # as if nothing was captured
    return out


Engine.reload = lying_reload

if __name__ == "__main__":
    main()
