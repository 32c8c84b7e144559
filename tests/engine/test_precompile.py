"""The warm step's parallel compile (qualify/engine/precompile.py): a recording pass of the engine's work
compiles nothing and launches nothing, worker processes compile what it recorded, and a process that then
runs the same work through Triton's JIT finds every kernel and every launcher in the cache (the JIT's own
keys), where one with an empty cache finds none. Driven on CPU tensors with a stand-in for an H200's
driver (tests/engine/precompile_probe.py); the room rule the step applies before it builds anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.engine.__main__ import room_reason

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Triton's bundled ptxas ships for Linux"
)


def _probe(mode: str, cache: Path, tmp_path: Path, libcuda: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the JIT must compile
    env.update(TRITON_CACHE_DIR=str(cache), QUALIFY_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    if libcuda is not None:
        env["TRITON_LIBCUDA_PATH"] = str(libcuda)
    run = subprocess.run(
        [sys.executable, "-m", "tests.engine.precompile_probe", mode],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _stub_libcuda(tmp_path: Path) -> Path | None:
    """A libcuda.so.1 with no symbols: Triton builds each launcher against it (the module is cached), it
    just cannot load it here. None without a C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    d = tmp_path / "libcuda"
    d.mkdir()
    (d / "stub.c").write_text("void qualify_stub(void) {}\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "stub.c")], check=True)
    return d


def test_recorded_specializations_compiled_by_workers_are_the_ones_the_jit_then_finds(tmp_path: Path) -> None:
    cache = tmp_path / "triton-cache"
    libcuda = _stub_libcuda(tmp_path)
    rec = _probe("record", cache, tmp_path, libcuda)
    assert rec["jobs"] == 2 and rec["failed"] == [] and rec["record_error"] is None
    assert rec["specializations"] == rec["compiled"] >= 6
    # every request decoded (an unloaded engine runs to max_tokens: an EOS after prefill once skipped it)
    assert [len(t) for t in rec["tokens"]] == [2] * 4, rec["tokens"]
    assert {"_rmsnorm_kernel", "_attn_decode_kernel", "_rope_kv_kernel"} <= set(rec["kernels"])
    assert rec["record_s"] is not None and rec["seconds"] >= rec["wait_after_record_s"]
    # the step's clock: its marks, when the specializations were recorded, and the compiles that ended last
    first, last = rec["recorded_at_s"]
    assert 0 <= rec["marks"]["before_recording"] <= first <= last <= rec["seconds"]
    done = rec["finished_last"]
    assert 1 <= len(done) <= min(8, rec["specializations"])
    assert [d["done_at_s"] for d in done] == sorted((d["done_at_s"] for d in done), reverse=True)
    assert all(first <= d["at_s"] <= d["done_at_s"] <= rec["seconds"] for d in done)
    # a manual warmup inside the pass (b12x keeps and launches what its .warmup() returns) goes to the
    # workers like any launch, and its caller gets a stand-in whose launch runs nothing
    assert rec["warmup_returned"] == "DeferredKernel" and rec["deferred"] == ["_warmup_probe_kernel"]
    assert "_warmup_probe_kernel" in rec["kernels"] and rec["launch_wrote"] is False
    jit = _probe("jit", cache, tmp_path)
    assert jit["compiles"], "the JIT compiled nothing: the work ran no Triton kernel"
    # every kernel the work launches was compiled by the workers under the JIT's own key
    assert all(c["cache_hit"] for c in jit["compiles"]), jit["compiles"]
    assert len(jit["compiles"]) == rec["specializations"]
    if libcuda is not None:  # and so was every launcher module, from the same signature and constants
        assert jit["launchers_in_cache"] and all(jit["launchers_in_cache"])
    # the control: the same work over an empty cache finds nothing
    cold = _probe("jit", tmp_path / "empty-cache", tmp_path)
    assert cold["compiles"] and not any(c["cache_hit"] for c in cold["compiles"])
    assert not any(cold["launchers_in_cache"])


def test_the_room_rule_compares_the_weights_with_the_smallest_gpu() -> None:
    assert room_reason(15 << 30, [140 << 30, 80 << 30], 4) is None  # 4 x 15 GiB fits the 80 GiB GPU
    why = room_reason(30 << 30, [140 << 30, 80 << 30], 4)
    assert why is not None and "30.0 GiB" in why and "80 GiB GPU" in why
    assert room_reason(30 << 30, [], 4) is None  # no GPU seen: nothing to decide


def test_the_warm_step_exits_before_building_anything_on_a_gpu_without_room(monkeypatch, capsys) -> None:
    from types import SimpleNamespace

    import torch

    from qualify.engine import __main__ as main
    from qualify.engine.config import EngineConfig

    cfg = EngineConfig(preset="tiny", device="cpu").model_copy(update={"device": "cuda"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    totals = {0: 1 << 30, 1: 8 << 20}  # the tiny preset's weights are about 1.3 MiB
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=totals[i])
    )
    with pytest.raises(SystemExit) as stop:
        main._check_room(cfg, 8)
    assert stop.value.code == main.EXIT_NO_ROOM
    assert "no room" in capsys.readouterr().err
    main._check_room(cfg, 4)  # 4 x 1.3 MiB fits the smallest: the step goes on


@pytest.mark.slow
def test_a_recording_pass_runs_every_kind_of_the_warm_steps_work_on_poisoned_memory(tmp_path: Path) -> None:
    """The whole of Engine.warm in recording mode (nothing launched, every empty buffer NaN or -1, weights
    not loaded) reaches every kind of work and records every kernel family the checks launch: host code
    that read a kernel's output as an index or a count would stop it here, as it would on a GPU."""
    got = _probe("census", tmp_path / "cache", tmp_path)
    sizes = (1, 2, 3, 8)
    assert {f"eager b={b} n=6" for b in sizes} | {f"speculative b={b} n=6" for b in sizes} <= set(got["ran"])
    assert len(got["ran"]) == 18 and got["ran"][0] == "census"
    assert "eager and speculative steps b in [4, 5, 6, 7]" in got["ran"]
    families = {
        "_gate_kernel", "diag_kernel", "merge_kernel", "wu_kernel", "_state_kernel",
        "_gated_norm_kernel", "_kda_decode_kernel", "_gated_rmsnorm_kernel", "_conv_gates_decode_kernel",
        "_rope_kv_kernel", "_conv_prefill_kernel",
        "_pool_kernel", "_select_kernel", "_attn_decode_kernel", "_rmsnorm_kernel", "_silu_mul_kernel",
    }  # fmt: skip
    assert families <= set(got["kernels"]), sorted(families - set(got["kernels"]))
    # 28 specializations since each prompt is prefilled on its own (30 with batched prefills)
    assert sum(got["kernels"].values()) >= 28


def test_an_engine_logs_each_kernel_it_compiles_itself_with_its_specialization(tmp_path: Path) -> None:
    # a real compile for sm_90 (Triton's ptxas, no GPU) through a listener set before: it still runs, a
    # cache miss is one line naming the kernel's constexprs and 16-divisible arguments, a hit none
    from qualify.engine.precompile import OWN_COMPILE_LINE

    got = _probe("ownlog", tmp_path / "cache", tmp_path)
    assert got["earlier"] == [False, True]
    assert len(got["lines"]) == 1 and got["lines"][0].startswith(OWN_COMPILE_LINE)
    rec = json.loads(got["lines"][0][len(OWN_COMPILE_LINE) :])
    assert rec["kernel"] == "_gated_rmsnorm_kernel" and rec["module"] == "kernels.kda.decode"
    assert rec["constexprs"] == got["constexprs"] and rec["num_warps"] == got["warps"]
    assert "out" in rec["divisible_by_16"] and rec["signature"]["out"] == "*bf16"


def test_the_harness_and_the_warm_step_agree_on_the_steps_exit_and_its_workers() -> None:
    # The sandboxed engine imports nothing of the harness's, so each side keeps its own copy: the step's
    # "no room" exit status and the rule for how many compile workers it runs.
    from qualify.engine import __main__ as main
    from qualify.engine.precompile import default_jobs
    from qualify.launch import kernels

    assert kernels.EXIT_NO_ROOM == main.EXIT_NO_ROOM
    assert kernels.precompile_jobs() == default_jobs()
