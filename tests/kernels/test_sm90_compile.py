"""Every Triton kernel compiles for the H200 (sm_90) on this CPU machine, through Triton's own ptxas
(bench/sm90.py): the interpreter runs a kernel's Python but never compiles it, so a kernel the interpreter
tests pass can still fail to build on the GPU (it did, 2026-12-04: a name redefined with another shape
inside an `if`). The decode step's fused glue (kernels/fused.py) is held to no spills as well, and each
projection kind's weight loop to linear_small's: what a launch folds in must not slow the loop that streams
the weights (it did, 2026-12-04: prologues in the loop read the weights at 0.7-1 TB/s against 3.5)."""

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


def test_every_kernel_compiles_for_sm90_and_the_decode_step_does_not_spill(tmp_path: Path) -> None:
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # jit must build, not interpret
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sm90.py"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["kernels"]}
    assert all(r["registers"] > 0 for r in rows.values())
    groups = {g: [r for r in rows.values() if r["group"] == g] for g in ("decode", "prefill", "fused")}
    # two rows more (1 and 32 rows) for each add-and-norm weight shape that kernels.fused.KIND_SHAPES gives
    # its own launch shape: the plain projection at it (bench/sm90.py)
    from kernels import fused

    at_kind_shapes = 2 * sum(
        kd == "add_norm" and (n, k) in {(4096, 8192), (4096, 4096)} for kd, n, k in fused.KIND_SHAPES
    )
    n_fused = 33 + at_kind_shapes
    assert [len(v) for v in groups.values()] == [5, 25, n_fused], {g: len(v) for g, v in groups.items()}
    for T in (1, 4):
        split = rows[f"decode T={T} split"]  # the serving path at every batch (kernels/kda/decode.py)
        assert split["spill_stores"] == 0 and split["spill_loads"] == 0, split
    # the whole-row launches too (bench/kda.py's sweep): 254-255 registers, so a weight held across the PDL
    # wait made the verify launch spill 8 bytes (2026-12-05)
    assert not [r["kernel"] for r in groups["decode"] if r["spill_stores"] or r["spill_loads"]]
    # the prefill's passes and each variant bench/kda_prefill.py times (kernels/kda/chunk.py): a variant
    # that spills is known before any device time is spent on it
    assert not [r["kernel"] for r in groups["prefill"] if r["spill_stores"] or r["spill_loads"]]
    # each prefill pass's static SASS by family (bench/sm90.py's sass_mix); the diagonal pass's variant
    # that takes the substitution's rows from the registers loads less from global memory than the default
    assert all(r["sass"]["instructions"] > 0 for r in groups["prefill"])
    diag = "prefill diagonal pass with the off-diagonal blocks, "
    default = rows[diag + "2 warps, 2 stage(s)"]
    in_regs = rows[diag + "the substitution's rows from the registers"]
    assert in_regs["sass"]["global_memory"] < default["sass"]["global_memory"], (in_regs, default)
    assert in_regs["registers"] <= default["registers"]
    # _EXP_FTZ: ex2.approx.ftz is one MUFU where sm_90's ex2.approx without ftz adds a compare and two
    # predicated multiplies for denormal results; fewer instructions at no more registers, in both passes
    pairs = (
        (default, rows[diag + "exponentials flushing denormals"]),
        (
            rows["prefill W/U, X's lower triangle"],
            rows["prefill W/U, X's lower triangle, exponentials flushing denormals"],
        ),
    )
    for base, ftz in pairs:
        assert ftz["sass"]["instructions"] < 0.95 * base["sass"]["instructions"], (ftz, base)
        assert ftz["registers"] <= base["registers"] and ftz["sass"]["special"] == base["sass"]["special"]
    # _GCUM_LOG2 with it: no multiply by log2(e) before each MUFU.EX2
    log2 = rows[diag + "Gamma in log2 units, ftz"]
    ftz = rows[diag + "exponentials flushing denormals"]
    assert log2["sass"]["fp32"] < ftz["sass"]["fp32"] and log2["registers"] <= ftz["registers"], (log2, ftz)
    # and the gate pass's sigmoid by ex2.approx.ftz and rcp.approx.ftz
    fast_gate, gate = rows["prefill gate, Gamma in log2 units, fast sigmoid"], rows["prefill gate"]
    assert fast_gate["sass"]["instructions"] < 0.9 * gate["sass"]["instructions"], (fast_gate, gate)
    # and the key norms from the K slices under a 168-register cap: no spill (checked above), fewer
    # instructions, six programs of 2 warps per SM as without them
    capped = rows[diag + "Gamma in log2 units, ftz, norms from slices"]
    assert capped["maxnreg"] == 168 and capped["registers"] <= 168, capped
    assert capped["sass"]["instructions"] < log2["sass"]["instructions"], (capped, log2)
    # those are the module's settings since 2026-12-06 (its grid sub-chunks first, below); in natural units
    # the pass runs more instructions (the multiply by log2(e) before each MUFU.EX2), at the same cap
    natural = rows[diag + "ftz, norms from slices, Gamma in natural units"]
    assert natural["maxnreg"] == 168 and natural["registers"] <= 168, natural
    assert capped["sass"]["instructions"] < natural["sass"]["instructions"] < ftz["sass"]["instructions"]
    # its grid sub-chunks first (the default): the same pass but for which program id names what, under
    # the same cap
    swapped = rows[diag + "Gamma in log2 units, ftz, norms from slices, sub-chunks side by side"]
    assert (
        swapped["registers"] <= 168 and swapped["sass"]["instructions"] <= capped["sass"]["instructions"] + 8
    )
    # Programmatic dependent launch (kernels/fused.py, kernels/kda/decode.py): every kernel of the decode
    # step waits once and releases once, and before its wait reads through no pointer but a weight's, which
    # no kernel of a step writes (a load of anything else may see the previous kernel's output unfinished).
    weights = {"w", "A_log", "dt_bias", "norm_weight"}
    pdl = {name: r["pdl"] for name, r in rows.items() if "pdl" in r}
    assert {r["kernel"] for r in groups["decode"]} <= set(pdl), sorted(pdl)
    assert len(pdl) == 5 + n_fused, sorted(set(rows) - set(pdl))
    # The KDA decode also reads the step's metadata before its wait: the host stages it before the step's
    # graph is launched and no kernel of a step writes it (kernels/kda/decode.py).
    metadata = {"num_live", "state_indices", "num_accepted"}
    for name, p in pdl.items():
        assert (p["waits"], p["releases"]) == (1, 1), (name, p)
        allowed = weights | (metadata if name.startswith("decode T=") else set())
        assert set(p["read_before_wait"]) <= allowed and not p["written_before_wait"], (name, p)
    # the batch-1 decode normalizes in its own launch (ONE_LAUNCH): the norm's weight too; a verify does not
    assert pdl["decode T=1 split"]["read_before_wait"] == [
        "A_log", "dt_bias", "norm_weight", "num_live", "state_indices"
    ]  # fmt: skip
    assert pdl["decode T=4 split"]["read_before_wait"] == [
        "A_log", "dt_bias", "num_accepted", "num_live", "state_indices"
    ]  # fmt: skip
    assert pdl["decode gated norm"]["read_before_wait"] == ["norm_weight"]
    # kernels/fused.py: every glue kernel and projection prologue of the decode step, at 1 and 32 rows
    spilled = [r["kernel"] for r in groups["fused"] if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled
    # kernels/fused.py's projections: each kind computes what it folds in after its weight loop, so the
    # loop is linear_small's at the same launch shape (K, BN, BK, warps, stages, split, row tile): the same
    # async copies into shared memory, ldmatrix loads, barriers and tensor-core ops, and none of what a
    # prologue in the loop brought there (2026-12-04, 16-row tile): a synchronous load of the norm's weight
    # with a shared-memory conversion and shuffles (278 instructions against linear_small's 88), or SiLU
    # for the whole x tile in every warp (2023 against 164, 256 of them MUFU). norm_head keeps its
    # prologue (its normed row rounds as the norm's kernel rounds it) and is not compared.
    projections = [r for r in groups["fused"] if "projection" in r]
    key = lambda p: (p["K"], tuple(p["launch_shape"]), p["BM"])  # noqa: E731
    plain = {
        key(r["projection"]): r["weight_loop"] for r in projections if r["projection"]["kind"] == "plain"
    }
    compared = 0
    for r in projections:
        p, loop = r["projection"], r["weight_loop"]
        if p["kind"] == "head":
            continue
        assert loop["instructions"] > 0 and loop["HMMA"] > 0 and loop["LDGSTS"] > 0, r
        assert all(loop[op] == 0 for op in ("LDG", "STG", "STS", "MUFU", "SHFL")), r
        base = plain[key(p)]
        assert all(loop[op] == base[op] for op in ("LDGSTS", "LDSM", "BAR", "HMMA")), (r, base)
        assert loop["instructions"] <= 1.25 * base["instructions"], (r, base)
        compared += p["kind"] != "plain"
    assert compared == 12, compared  # deferred norm, SwiGLU, add and norm twice both ways: at both row tiles
