"""The harness talks to the engine over HTTP only: importing all of it loads no torch, triton or engine, nor
the CUDA activity monitor the engine's interpreter runs (qualify/monitor) or CUPTI."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT

HARNESS = [
    "qualify.commands.run",
    "qualify.run.pipeline",
    "qualify.run.receipt",
    "qualify.checks",
    "qualify.client",
    "qualify.launch.local",
    "qualify.launch.docker",
    "qualify.watch.kmsg",
    "qualify.watch.nvml",
    "qualify.watch.cupti",
    "qualify.launch.monitor",
    "qualify.checks.monitor",
]


def test_harness_never_imports_torch_triton_or_the_engine() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in HARNESS)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
        " or m.startswith('qualify.engine'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
