"""Liar: a distributed DCP engine whose rank r stores (and attends over) the tokens of shard (r + 1) mod N
instead of shard r. Every rank still holds one shard in allocations of exactly the asked-for shape, the
partials merge by log-sum-exp whatever their order, so its output equals the DCP 1 reference's; only where
each token's K/V lives differs from the geometry."""

from __future__ import annotations

import subprocess

from qualify.engine import __main__ as engine_main
from qualify.engine import dcp
from qualify.engine.model import attention

_honest_init = attention.AttentionRuntime.__init__


def _init(self, cfg, device, dcp=None):
    _honest_init(self, cfg, device, dcp)
    geo = self.geometry
    if geo.rank is not None:
        geo.rank = (geo.rank + 1) % geo.dcp  # this rank's storage holds the next rank's shard
        self.kpos, self.kcol, self.koff = geo.context_tables(device)


def _followers_init(self, world: int, init_method: str, argv: list[str]) -> None:
    """dcp.Followers, spawning this module as the follower ranks (they must store the rotated shard too)."""
    self.procs = {}
    for rank in range(1, world):
        cmd = [dcp.sys.executable, "-m", __spec__.name, "follow", "--dcp-rank", str(rank),
               "--dcp-init", init_method, *argv]  # fmt: skip
        self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    self._stopping = False


attention.AttentionRuntime.__init__ = _init
dcp.Followers.__init__ = _followers_init

if __name__ == "__main__":
    engine_main.main()
