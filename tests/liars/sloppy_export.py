"""Liar: its exported table overstates and its echo does not bound-check. kv-handles says every allocation
lives on a CUDA device (they are shared-memory files) and exports one allocation twice, the second time
under a group name the layer pattern does not have; kv-echo clamps a range past an allocation's end
instead of refusing it. The layout check's observed peer conditions that cannot be satisfied by a table
must each fail (peer_device, peer_found_every_group, echo_refuses_out_of_bounds)."""

from __future__ import annotations

import copy

from qualify.engine import __main__ as engine_main
from qualify.engine import kv_export

_honest_handles = kv_export.kv_handles
_honest_echo = kv_export.kv_echo


def _handles(engine) -> dict:
    out = _honest_handles(engine)
    for g in out["groups"]:
        g["device"] = {"type": "cuda", "index": 0, "uuid": "GPU-liar"}
    extra = copy.deepcopy(out["groups"][0])
    extra["name"] = "kda9"
    out["groups"].append(extra)
    return out


def _echo(engine, group: str, offset: int, length: int) -> dict:
    a = kv_export._group(engine, group)
    start = max(0, min(offset, a.nbytes - length))  # clamped into the allocation, never refused
    out = _honest_echo(engine, group, start, length)
    return {**out, "offset": offset}


kv_export.kv_handles = _handles
kv_export.kv_echo = _echo

# The honest engine refuses a launch document whose kv_groups its own export differs from; a liar does not.
engine_main._launch_layout_differs = lambda engine, path: None

if __name__ == "__main__":
    engine_main.main()
