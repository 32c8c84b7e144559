"""What the harness can know before boot, it refuses before boot (exit 2, one line, nothing written): spans no
engine registers, a backend the run's CPU target cannot run, --gpus for a local engine on a host without a
GPU. Where the local launcher does use GPUs, --gpus becomes the engine's CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.commands.run import host_has_cuda_gpu
from qualify.run.pipeline import make_launcher
from qualify.run.request import MAX_SPAN, RunRequest
from tests.harness.conftest import refused

CPU_HOST = not host_has_cuda_gpu()


@pytest.mark.parametrize("span", ["99999999999999999999999999", str(MAX_SPAN + 1)])
def test_a_span_beyond_any_engine_is_bad_input(span: str, empty_home: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    line = refused(["--layout", f"2304,{span}"], empty_home, capsys)
    assert "span 2" in line and str(MAX_SPAN) in line and len(line) < 200


@pytest.mark.skipif(not CPU_HOST, reason="the CPU target is what is refused")
def test_b12x_on_a_cpu_target_is_refused_before_boot(empty_home: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert "b12x needs a CUDA GPU" in refused(["--kda-backend", "b12x"], empty_home, capsys)


@pytest.mark.skipif(not CPU_HOST, reason="the CPU target is what is refused")
def test_triton_on_a_cpu_target_without_the_interpreter_is_refused_before_boot(
    empty_home: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" in refused(["--kda-backend", "triton"], empty_home, capsys)


@pytest.mark.skipif(not CPU_HOST, reason="a GPU host applies --gpus")
def test_local_gpus_on_a_host_without_a_gpu_is_refused(empty_home: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert "no CUDA GPU" in refused(["--gpus", "0"], empty_home, capsys)


@pytest.mark.slow
def test_local_gpus_reach_the_engine_as_cuda_visible_devices(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("QUALIFY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QUALIFY_ENGINE_FAULT", raising=False)
    req = RunRequest(
        layout=None, kda_backend="auto", spec="none", num_spec=0, preset="tiny", launcher="local",
        image=None, gpus="1", timeout_s=60, mem_limit=None, db_url="sqlite://", key_path="",
        json_output=True,
    )  # fmt: skip
    launcher = make_launcher(req, tmp_path / "run")
    try:
        launcher.start(60)
        pid = launcher.status().detail["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=1" in environ
    finally:
        launcher.stop()
