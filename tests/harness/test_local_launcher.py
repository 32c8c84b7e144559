"""The local launcher supervises a real engine subprocess: address from its ready line, an on-failure
restart policy with a counter, logs in the run dir, and a clean stop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from qualify.launch.base import EngineOptions
from qualify.launch.local import LocalLauncher

pytestmark = pytest.mark.slow


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"}
    return {**env, "QUALIFY_HOME": str(tmp_path / "home"), **extra}


def test_crashing_engine_is_restarted_up_to_the_limit_at_the_same_address(tmp_path: Path) -> None:
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="auto"),
        tmp_path / "run",
        max_restarts=1,
        env=_env(tmp_path, QUALIFY_ENGINE_FAULT="crash-after-boot:1.5"),
    )
    url = launcher.start(60)
    assert httpx.get(url + "/health").json()["ready"] is True
    assert launcher.status().alive and launcher.status().restart_count == 0
    # The engine crashes 1.5 s after each boot: one restart (same port), then the policy gives up.
    assert launcher.wait_ready(60)
    deadline = time.monotonic() + 60
    while launcher.status().alive or launcher.status().restart_count < 1:
        assert time.monotonic() < deadline, launcher.status()
        time.sleep(0.1)
    while launcher.status().detail["boots"] < 2 or launcher.status().alive:
        assert time.monotonic() < deadline, launcher.status()
        time.sleep(0.1)
    st = launcher.stop()
    assert st.restart_count == 1 and not st.alive
    assert st.exit_code == 3 and st.detail["exit_codes"] == [3, 3]
    assert launcher.url() == url
    log = (tmp_path / "run" / "engine.log").read_text()
    assert log.count("QUALIFY_ENGINE_READY") == 2


def test_stop_terminates_a_healthy_engine(tmp_path: Path) -> None:
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="torch"), tmp_path / "run", env=_env(tmp_path)
    )
    launcher.start(60)
    pid = launcher.status().detail["pid"]
    st = launcher.stop()
    assert not st.alive and st.restart_count == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_bogus_backend_is_refused_at_construction(tmp_path: Path) -> None:
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="auto"), tmp_path / "run", env=_env(tmp_path)
    )
    out = launcher.run_refusal("bogus", 60)
    assert out.exit_code not in (None, 0)
    assert "bogus" in out.output and all(c in out.output for c in ("auto", "b12x", "triton", "torch"))


def test_on_spawn_is_called_once_when_the_first_process_exists_before_it_answers(tmp_path: Path) -> None:
    """Boot's Context.engine_spawned (the layout check's peers started ahead on a GPU target) runs once the
    engine's first process exists, its pid known, before the engine is ready; not again on a restart."""
    launcher = LocalLauncher(
        EngineOptions(preset="tiny", kda_backend="torch"),
        tmp_path / "run",
        max_restarts=1,
        env=_env(tmp_path, QUALIFY_ENGINE_FAULT="crash-after-boot:1.5"),
    )
    seen: list[tuple[int | None, bool]] = []
    launcher.on_spawn = lambda: seen.append((launcher.status().detail["pid"], launcher._ready.is_set()))
    try:
        launcher.start(60)
        deadline = time.monotonic() + 60
        while launcher.status().detail["boots"] < 2:  # the crash and its restart
            assert time.monotonic() < deadline, launcher.status()
            time.sleep(0.1)
    finally:
        st = launcher.stop()
    assert seen == [(st.detail["pids"][0], False)]
