"""Liar: the engine really runs with another KV geometry (LIAR_GEOMETRY, JSON of EngineConfig fields;
default {"dcp_size": 2}) than the one the harness asked for, and its describe reports the asked-for
config and layout ([2304, 2304, 2304, 9216]) as if it were right."""

from __future__ import annotations

import json
import math
import os

from qualify.engine import __main__ as engine_main
from qualify.engine.engine import Engine

REAL = json.loads(os.environ.get("LIAR_GEOMETRY", '{"dcp_size": 2}'))
_honest_fields = engine_main._config_fields
_honest_describe = Engine.describe
_asked: dict = {}


def _lying_fields(args):
    fields = _honest_fields(args)
    _asked.update(block_size=fields.get("block_size", 2304), dcp_size=fields.get("dcp_size", 4))
    return {**fields, **REAL}


def _lying_describe(self) -> dict:
    d = _honest_describe(self)
    spans = []
    for g in d["layout"]["groups"]:
        g["span"] = _asked["block_size"] * (_asked["dcp_size"] if g["kind"] == "attention" else 1)
        spans.append(g["span"])
    chunk = math.lcm(*spans)
    d["layout"].update(spans=spans, chunk=chunk, ratios=[chunk // s for s in spans])
    d["config"].update(_asked)
    return d


engine_main._config_fields = _lying_fields  # serve() looks both up when it runs
# The honest engine refuses a launch document whose kv_groups it would lay out otherwise; a liar does not.
engine_main._launch_layout_differs = lambda engine, path: None
Engine.describe = _lying_describe

if __name__ == "__main__":
    engine_main.main()
