"""Every Triton kernel compiles for the H200 (sm_90) on this CPU machine, through Triton's own ptxas
(bench/sm90.py): the interpreter runs a kernel's Python but never compiles it, so a kernel the interpreter
tests pass can still fail to build on the GPU (it did, 2026-12-04: a name redefined with another shape
inside an `if`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Triton's bundled ptxas ships for Linux"
)


def test_every_kernel_compiles_for_sm90_and_the_decode_serving_path_does_not_spill(tmp_path: Path) -> None:
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # jit must build, not interpret
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sm90.py"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["kernels"]}
    assert len(rows) == 12 and all(r["registers"] > 0 for r in rows.values())
    for T in (1, 4):
        split = rows[f"decode T={T} split"]  # the serving path at every batch (kernels/kda/decode.py)
        assert split["spill_stores"] == 0 and split["spill_loads"] == 0, split
