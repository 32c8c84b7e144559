"""The engine started beside the seeding of its weights (LocalLauncher.begin_weights; the launch document's
weights.wait_s, docs/PROTOCOL.md): the engine imports and lays out its caches while the harness receives
and hashes the seeded file, waits for the file, and loads the one the harness kept; a seeding that fails
or is refused stops that engine, bounded, and leaves no folder behind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from qualify.client import EngineClient
from qualify.launch import local
from qualify.launch.base import EngineOptions, harness_identity
from qualify.launch.local import HANDOFF_OWNER, HANDOFF_PREFIX, LocalLauncher
from qualify.launch.sandbox import WEIGHTS_DIR, Sandbox

from .conftest import LAYOUT, Home, check

pytestmark = pytest.mark.slow


def _launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandboxed: bool, backend: str = "torch"
) -> LocalLauncher:
    """A launcher of the tiny preset whose launch document tells the engine to wait for its handed weights,
    with a weights cache of its own (cold: the seeding runs)."""
    from qualify.engine.__main__ import manifest
    from qualify.protocol import EngineManifest
    from qualify.run import launch
    from qualify.run.request import RunRequest

    monkeypatch.setattr(local, "cache_dir", lambda: tmp_path / "cache")
    env = Home(tmp_path / "home").env()  # the shared test cache: the sandbox's bytecode and digests
    sandbox = Sandbox.for_engine("qualify.engine", gpu=False, env=env) if sandboxed else None
    launcher = LocalLauncher(EngineOptions("tiny", "torch"), tmp_path / "run", env=env, sandbox=sandbox)
    launcher.plan_weights(dtype="float32")
    weights, scratch = launcher.launch_paths("unused")
    req = RunRequest(layout=None, kda_backend=backend, spec="none", num_spec=0, preset="tiny",
                     launcher="local", image=None, gpus=None, timeout_s=60, mem_limit=None,
                     db_url="sqlite://", key_path="", json_output=True)  # fmt: skip
    doc = launch.build(
        req, EngineManifest.model_validate(manifest()), "cpu", weights_path=weights, scratch_dir=scratch,
        weights_create=False, weights_wait_s=launcher.weights_wait_s,
    )  # fmt: skip
    launcher.options = dataclasses.replace(launcher.options, launch=doc.model_dump_json())
    return launcher


def _handoffs(tmp_path: Path) -> list[Path]:
    """The hand-off folders and their owner files in the weights cache."""
    return list((tmp_path / "cache" / "weights").glob(f"{HANDOFF_PREFIX}*"))


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])
def test_an_engine_starts_beside_the_seeding_and_loads_the_file_the_harness_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandboxed: bool
) -> None:
    launcher = _launcher(tmp_path, monkeypatch, sandboxed=sandboxed)
    launcher.begin_weights(120, dtype="float32")
    assert launcher.weights is None  # the seeding runs on: start() takes its outcome
    # the sandbox's read-only folder (and its owner file beside it); unsandboxed, the cache file's own path
    folders = [p for p in _handoffs(tmp_path) if p.is_dir()]
    assert len(folders) == int(sandboxed) and len(_handoffs(tmp_path)) == 2 * int(sandboxed)
    try:
        url = launcher.start(120)
        handed = launcher.weights
        assert handed is not None
        data = handed.path.read_bytes()
        assert handed.digest == "sha256:" + hashlib.sha256(data).hexdigest()
        if sandboxed:
            assert handed.engine_path == f"{WEIGHTS_DIR}/{handed.path.name}"
            # the file the engine loaded is the harness's kept file, linked (not copied) into its folder
            assert (folders[0] / handed.path.name).stat().st_ino == handed.path.stat().st_ino
        else:
            assert handed.engine_path == str(handed.path)
        client = EngineClient(lambda: url, netns=launcher.netns)
        assert client.describe().engine.weights_path == handed.engine_path
        assert launcher.weights_phases["start_waited_for_seeding"] >= 0
        startup = next(ln for ln in launcher.logs_tail(200).splitlines() if "engine startup (s)" in ln)
        assert "weights_wait" in json.loads(startup.split(": ", 1)[1])  # it was told to wait, and did
    finally:
        launcher.stop()
    assert not _handoffs(tmp_path) and handed.path.is_file()


def test_a_seeding_that_fails_beside_the_start_stops_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(tmp_path, monkeypatch, sandboxed=True)

    def seed(cached: Path, serve: list[str], timeout_s: float) -> bool:
        time.sleep(2.0)  # the engine is up by now, waiting for its file
        raise RuntimeError("the harness could not seed the engine's weights (killed by signal 9): gone")

    monkeypatch.setattr(launcher, "_seed", seed)
    launcher.begin_weights(120, dtype="float32")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not seed the engine's weights"):
        launcher.start(120)
    assert time.monotonic() - t0 < 30
    st = launcher.stop()
    assert not st.alive and st.detail["boots"] == 1 and st.restart_count == 0
    assert launcher.weights is None and not _handoffs(tmp_path)


@pytest.mark.parametrize("backend", ["torch", "bogus"])
def test_a_refused_seeding_takes_the_engines_own_answer_or_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The reference engine's seeding step refused the configuration: an engine that refuses it too at
    construction is reported as refusing (as without a seeding beside); one that does not is stopped after
    REFUSAL_ANSWER_WAIT_S instead of waiting the document's wait_s for a file that never comes."""
    launcher = _launcher(tmp_path, monkeypatch, sandboxed=False, backend=backend)
    monkeypatch.setattr(local, "REFUSAL_ANSWER_WAIT_S", 3.0)
    (tmp_path / "run").mkdir(parents=True)
    (tmp_path / "run" / "weights-step.log").write_text("the configuration is refused\n")
    monkeypatch.setattr(launcher, "_seed", lambda cached, serve, timeout_s: False)
    launcher.begin_weights(120, dtype="float32")
    t0 = time.monotonic()
    want = "refused its configuration at construction" if backend == "bogus" else "did not refuse it"
    with pytest.raises(RuntimeError, match=want):
        launcher.start(120)
    assert time.monotonic() - t0 < 60
    st = launcher.stop()
    assert not st.alive and st.restart_count == 0 and launcher.weights is None


def test_qualify_run_on_a_cold_weights_cache_starts_the_engine_beside_the_seeding(
    home: Home, tmp_path: Path
) -> None:
    """Through `qualify run`: the shared test cache's bytecode and digests, but no weights, so the run
    seeds; the engine waits for the file, loads it, and the receipt's weights subject is its digest."""
    shared, cache = Path(os.environ["QUALIFY_CACHE_DIR"]), tmp_path / "cache"
    cache.mkdir()
    for p in shared.glob("*"):
        if p.name.startswith("pycache-"):
            subprocess.run(["cp", "-al", str(p), str(cache / p.name)], check=True)
        elif p.name.startswith("code-digests-"):
            shutil.copy(p, cache / p.name)
    ran = home.qualify("run", "--layout", LAYOUT, "--json", env=home.env(QUALIFY_CACHE_DIR=str(cache)))
    assert ran.code == 0, ran.stderr[-2000:]
    (p,) = home.predicates()
    assert p["verdict"] == "qualified"
    boot = check(p, "boot")["evidence"]
    phases = boot["phases"]
    assert (
        "prepare_weights_seeding_begun_at" in phases and "prepare_weights_seeded_and_hashed_at" not in phases
    )
    assert phases["prepare_weights_start_waited_for_seeding_s"] >= 0
    assert boot["launch"]["document"]["weights"]["wait_s"] == local.WEIGHTS_WAIT_S
    (kept,) = (cache / "weights").glob("seeded-*.safetensors")
    digest = hashlib.sha256(kept.read_bytes()).hexdigest()
    assert (
        boot["weights_file"]["digest"] == f"sha256:{digest}"
        and boot["weights_file"]["engine_names_handed_file"]
    )
    assert not list((cache / "weights").glob(f"{HANDOFF_PREFIX}*"))
    run_dir = Path(ran.summary()["run_dir"])
    startup = next(ln for ln in (run_dir / "engine.log").read_text().splitlines() if "engine startup" in ln)
    assert "weights_wait" in json.loads(startup.split(": ", 1)[1])


def test_the_hand_off_folders_of_a_killed_harness_are_swept_and_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each folder's owner file names the harness that made it (launch/base.py's harness identity): gone,
    or its pid now another process's (another start time), the folder is swept; alive, or on another host
    sharing the cache, it is kept."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = harness_identity()
    owners = {
        "dead": {**me, "pid": str(gone.pid)},
        "reused": {**me, "start": "1"},  # this process's pid, another process's start
        "live": me,
        "elsewhere": {**me, "host": "another-host", "pid": str(gone.pid)},
    }
    weights = tmp_path / "cache" / "weights"
    folders = {}
    for name, ident in owners.items():
        folders[name] = weights / f"{HANDOFF_PREFIX}{ident['pid']}-1-{name}"
        folders[name].mkdir(parents=True)
        (folders[name] / "seeded.safetensors").write_bytes(b"linked")
        (weights / f"{folders[name].name}{HANDOFF_OWNER}").write_text(json.dumps(ident))
    launcher = _launcher(tmp_path, monkeypatch, sandboxed=False)
    monkeypatch.setattr(launcher, "_seed", lambda cached, serve, timeout_s: False)
    launcher.begin_weights(60, dtype="float32")
    left = {p.name for p in _handoffs(tmp_path)}
    for name in ("dead", "reused"):
        assert folders[name].name not in left and f"{folders[name].name}{HANDOFF_OWNER}" not in left
    for name in ("live", "elsewhere"):
        assert folders[name].is_dir() and f"{folders[name].name}{HANDOFF_OWNER}" in left
    launcher.stop()
