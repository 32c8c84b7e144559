"""Liar: asked for `auto` on a CPU, the engine runs the torch reference but reports the triton backend as
resolved ("auto: triton"), and its profiled step names `kda::triton` labels in place of torch's. Every
backend condition that rests on its word holds; a triton kernel cannot run on a CPU without the
interpreter, which the harness never switched on (checks/backend.py)."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

Engine = engine_module.Engine
_describe, _probe = Engine.describe, Engine.probe


def lying_describe(self) -> dict:
    d = _describe(self)
    d["backend"].update(resolved="triton", reason="auto: triton", prefill_path="triton chunked prefill")
    return d


def lying_probe(self) -> dict:
    out = _probe(self)
    out["kernel_names"] = [n.replace("kda::torch", "kda::triton") for n in out["kernel_names"]]
    out["backend"] = "triton"
    return out


Engine.describe, Engine.probe = lying_describe, lying_probe

if __name__ == "__main__":
    main()
