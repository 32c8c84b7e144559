"""Liar: asked for N distributed DCP ranks, the engine folds every shard into one process, starts N - 1 idle
children to stand in for the other ranks, and reports itself distributed: each "rank" with a child's pid and
per-rank decoy allocations laid out exactly as a rank's share of the asked-for geometry, which kv-handles,
kv-fill and kv-echo (with their rank) act on. Its output is a folded engine's, so it equals the DCP 1
reference's."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace

from qualify.engine import __main__ as engine_main
from qualify.engine import kv_export, server
from qualify.engine.engine import Engine
from qualify.engine.layout import allocate_group, release_group

IDLE = (
    "import ctypes, signal, time\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"  # die with the engine
    "time.sleep(7 * 24 * 3600)\n"
)
_asked = {"ranks": 1}
_honest_fields = engine_main._config_fields
_honest_build = Engine._build
_honest_describe = Engine.describe
_honest_close = Engine.close


def _fields(args):
    fields = _honest_fields(args)
    _asked["ranks"] = fields.get("dcp_ranks", 1)
    return {**fields, "dcp_ranks": 1}  # fold every shard into this process


def _build(self, cfg) -> None:
    _honest_build(self, cfg)
    n = _asked["ranks"]
    self.children = [
        subprocess.Popen([sys.executable, "-c", IDLE], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(n - 1)
    ]
    rank_cfg = cfg.model_copy(update={"dcp_ranks": n})  # a rank's share: one shard per block
    self.private = self.allocations
    self.decoys = [[allocate_group(a.group, rank_cfg, self.device) for a in self.private] for _ in range(n)]
    self.allocations = self.decoys[0]


def _close(self) -> None:
    _honest_close(self)
    for a in getattr(self, "private", []):
        release_group(a)
    for rank in getattr(self, "decoys", [])[1:]:
        for a in rank:
            release_group(a)
    for c in getattr(self, "children", []):
        with contextlib.suppress(ProcessLookupError):
            c.kill()


def _rank(engine, rank: int):
    if not 0 <= rank < len(engine.decoys):
        raise ValueError(f"rank {rank} does not exist")
    return SimpleNamespace(allocations=engine.decoys[rank], device=engine.device)


def _record(engine, rank: int) -> dict:
    import os

    n = len(engine.decoys)
    return {
        "rank": rank,
        "world": n,
        "local_shards": 1,
        "pid": os.getpid() if rank == 0 else engine.children[rank - 1].pid,
        "device": str(engine.device),
        "groups": [a.record() for a in engine.decoys[rank]],
    }


def _describe(self) -> dict:
    d = _honest_describe(self)
    n = len(self.decoys)
    if n > 1:
        d["config"]["dcp_ranks"] = n
        d["dcp_mode"] = "distributed"
        d["dcp"] = _record(self, 0)
        d["dcp_ranks"] = [_record(self, r) for r in range(n)]
    return d


def _kv_handles(engine) -> dict:
    every = [kv_export.kv_handles(_rank(engine, r)) for r in range(len(engine.decoys))]
    out = dict(every[0])
    if len(every) > 1:
        out["ranks"] = [{"rank": r, "groups": h["groups"]} for r, h in enumerate(every)]
    return out


engine_main._config_fields = _fields
Engine._build = _build
Engine.describe = _describe
Engine.close = _close
server.VERBS["kv_handles"] = _kv_handles
server.VERBS["kv_fill"] = lambda e, rank, *a: kv_export.kv_fill(_rank(e, rank), *a)
server.VERBS["kv_echo"] = lambda e, rank, *a: kv_export.kv_echo(_rank(e, rank), *a)

if __name__ == "__main__":
    engine_main.main()
