"""Triton's key for a kernel must not depend on the order in which a process first asks for kernels' keys.
Triton 3.6 merges a called @jit function's constexpr globals into its caller's key before it has computed
them, so a helper's constexpr global entered the key of the kernel asked for second and not of the one asked
for first: the warm step's compile workers and the engines asked in different orders and the engines missed
kernels the workers had compiled (on an H100, 2026-12-05, ten fused projection kernels each boot; on CPU,
tests/engine/precompile_probe.py reproduced it with two kernels). Each kernel module's keys are computed in
processes of their own in definition order and in reverse, and must agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.engine.precompile import KERNEL_MODULES

ROOT = Path(__file__).resolve().parents[2]
MODULES = list(KERNEL_MODULES)  # every module the warm step's workers compile from

_PROBE = r"""
import importlib, json, sys
from triton.runtime.jit import JITFunction
mod = importlib.import_module(sys.argv[1])
fns = [(n, v) for n, v in vars(mod).items() if isinstance(v, JITFunction) and v.__module__ == mod.__name__]
if sys.argv[2] == "reverse":
    fns.reverse()
print(json.dumps({n: f.cache_key for n, f in fns}))
"""


def _keys(module: str, order: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, module, order], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_a_kernels_key_does_not_depend_on_the_order_keys_are_asked_for(module: str) -> None:
    forward, reverse = _keys(module, "forward"), _keys(module, "reverse")
    assert forward and forward == reverse, sorted(n for n in forward if forward[n] != reverse.get(n))


def test_every_row_block_the_fused_kernels_declare_is_the_modules_rb_rows() -> None:
    from kernels import fused

    src = (ROOT / "kernels" / "fused.py").read_text()
    declared = [line.split("=")[1].split("#")[0].strip() for line in src.splitlines()
                if line.strip().startswith("RB: tl.constexpr =")]  # fmt: skip
    assert len(declared) >= 6 and set(declared) == {str(fused.RB_ROWS)}
