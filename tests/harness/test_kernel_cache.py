"""The harness's kernel cache (qualify/launch/kernels.py): filled only by the reference engine's warm step,
kept with a digest, and copied (never shared) into each engine process's scratch dir, so that what the
engine under test writes into its copy reaches neither the harness's cache nor a reference engine's. An
engine under test that started before the step was done gets the cache late, into its running scratch
dir, through descriptors that never follow what it planted there; what each engine compiled itself is
counted at its stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qualify.launch import kernels, local
from qualify.launch.base import EngineOptions
from qualify.launch.kernels import (
    CACHE_SUBDIR,
    EXIT_NO_ROOM,
    MANIFEST,
    KernelCache,
    KernelCacheError,
    compiled_itself,
    give,
    give_live,
    keep,
)
from qualify.launch.local import DEFAULT_ENGINE_MODULE, ENGINE_MODULE_ENV, HandedWeights, LocalLauncher

from .conftest import ROOT


def _step_cache(root: Path) -> Path:
    """What a warm step leaves: Triton's layout (a folder per key, its files), plus a link to a secret."""
    cache = root / "home" / CACHE_SUBDIR
    for key, names in {"AAAA": ["k.cubin", "k.json"], "BBBB": ["m.cubin", "m.json", "__grp__m.json"]}.items():
        (cache / key).mkdir(parents=True)
        for n in names:
            (cache / key / n).write_bytes(f"{key}/{n}".encode() * 10)
    secret = root / "secret"
    secret.write_text("the operator's key")
    (cache / "AAAA" / "leak.json").symlink_to(secret)  # never followed, never copied
    return cache


def test_a_kept_cache_is_copied_file_by_file_with_its_digest_and_no_links(tmp_path: Path) -> None:
    kept = tmp_path / "harness-cache" / "tiny-key"
    kept.parent.mkdir()
    m = keep(_step_cache(tmp_path / "step"), kept, {"reference_code": "sha256:x"})
    assert m["files"] == 5 and m["digest"].startswith("sha256:") and m["reference_code"] == "sha256:x"
    assert not (kept / "AAAA" / "leak.json").exists()
    home = tmp_path / "engine-scratch" / "home"
    home.mkdir(parents=True)
    got = give(kept, home, None)
    assert got["digest"] == m["digest"] and got["files"] == 5
    copy = home / CACHE_SUBDIR
    assert (copy / "BBBB" / "m.cubin").read_bytes() == b"BBBB/m.cubin" * 10
    assert not (copy / MANIFEST).exists()  # the manifest stays the harness's
    with pytest.raises(KernelCacheError, match="exists already"):
        give(kept, home, None)  # only into a new scratch dir


def test_what_one_engine_writes_into_its_copy_reaches_no_other(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    m = keep(_step_cache(tmp_path / "step"), kept, {})
    a, b = tmp_path / "a" / "home", tmp_path / "b" / "home"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    give(kept, a, None)
    # The engine under test rewrites a kernel binary and plants one of its own in its copy...
    (a / CACHE_SUBDIR / "AAAA" / "k.cubin").write_bytes(b"planted")
    (a / CACHE_SUBDIR / "CCCC").mkdir()
    (a / CACHE_SUBDIR / "CCCC" / "x.cubin").write_bytes(b"planted")
    # ...and a reference engine started after it gets the warm step's bytes, checked against the digest.
    assert give(kept, b, None)["digest"] == m["digest"]
    assert (b / CACHE_SUBDIR / "AAAA" / "k.cubin").read_bytes() == b"AAAA/k.cubin" * 10
    assert not (b / CACHE_SUBDIR / "CCCC").exists()
    assert (kept / "AAAA" / "k.cubin").read_bytes() == b"AAAA/k.cubin" * 10


def test_a_kept_cache_changed_after_the_warm_step_is_not_given(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    keep(_step_cache(tmp_path / "step"), kept, {})
    (kept / "BBBB" / "m.cubin").write_bytes(b"changed in the harness's cache")
    cache = KernelCache(kept)
    assert cache.ready
    home = tmp_path / "s" / "home"
    home.mkdir(parents=True)
    record = cache.give("engine", home, None)
    assert record["given"] is False and "does not match its manifest" in record["reason"]
    assert not (home / CACHE_SUBDIR).exists()
    assert cache.evidence()["given"]["engine"] == record


def test_a_warm_step_cache_beyond_the_bounds_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "MAX_FILES", 3)
    with pytest.raises(KernelCacheError, match="more than 3 files"):
        keep(_step_cache(tmp_path / "step"), tmp_path / "kept", {})
    assert not (tmp_path / "kept").exists()


def test_a_failed_warm_step_leaves_the_run_without_a_cache_and_says_why(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "kept")
    cleaned = []
    cache.start(lambda: (None, "exited with code 2: no GPU", {}), cleanup=lambda: cleaned.append(1))
    assert cache.wait(10) and not cache.ready and cleaned == [1]
    home = tmp_path / "s" / "home"
    home.mkdir(parents=True)
    assert cache.give("engine", home, None) == {
        "given": False,
        "reason": "the warm step left no kernel cache: exited with code 2: no GPU",
    }
    ev = cache.evidence()
    assert ev["origin"] is None and ev["digest"] is None and ev["warm_step_s"] is not None


class _FakeSandbox:
    """A GPU sandbox as far as the launcher asks (the warm step's process is faked below)."""

    gpu = True
    root = False

    @staticmethod
    def engine_env(env, extra=None):
        return {**env, **(extra or {})}

    @staticmethod
    def prepare_scratch(scratch: Path) -> None:
        (scratch / "home").mkdir(parents=True, exist_ok=True)


def test_the_cache_is_filled_by_the_reference_engine_even_when_a_liar_is_under_test(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "harness-cache"))
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"w")
    handed = HandedWeights(weights, "sha256:w", 1, "/w", "test")
    env = {ENGINE_MODULE_ENV: "tests.liars.spec_ignored"}
    launcher = LocalLauncher(
        EngineOptions("tiny", "torch"), tmp_path / "run", env=env, sandbox=_FakeSandbox(), weights=handed
    )
    ran: list[list[str]] = []

    said = {
        "warm": {"ran": ["eager b=1 n=6"], "seconds_each": {"eager b=1 n=6": 0.5, "capture": 2.0}},
        "precompile": {"jobs": 3, "specializations": 1},
    }

    def popen(argv, scratch, env, **kw):  # the warm step: it compiles into its scratch's Triton cache
        ran.append(argv)
        made = scratch / "home" / CACHE_SUBDIR / "KEY"
        made.mkdir(parents=True)
        (made / "k.cubin").write_bytes(b"compiled")
        kw["stdout"].write(f"compiling\n{json.dumps(said)}\n")
        return subprocess.Popen([sys.executable, "-c", "pass"]), None

    monkeypatch.setattr(launcher, "_popen", popen)
    monkeypatch.setattr(local, "precompile_jobs", lambda: 3)
    cache = launcher.prepare_kernels()
    assert cache.wait(30) and cache.ready and cache.filled_this_run
    assert len(ran) == 1 and ran[0][1:4] == ["-m", DEFAULT_ENGINE_MODULE, "warm"]  # never the liar
    assert ran[0][-4:] == ["--jobs", "3", "--room-factor", str(kernels.WARM_MEMORY_FACTOR)]
    assert "--weights" not in ran[0]  # the step records shapes: it loads no weights
    assert cache.evidence()["precompile"] == said["precompile"]  # what the step said of its compile
    assert cache.evidence()["warm_seconds_each"] == said["warm"]["seconds_each"]  # and where its time went
    assert not (tmp_path / "run" / "warm-step").exists()  # the step's scratch is removed once kept
    # The engine under test and a reference engine each get a copy of their own.
    launcher._give_kernels(launcher.scratch)
    ref = launcher.sibling(launcher.options, "fresh-reference")
    assert ref.kernels is cache and ref.module == "tests.liars.spec_ignored"
    ref._give_kernels(ref.scratch)
    ev = cache.evidence()
    assert set(ev["given"]) == {"engine", "fresh-reference"}
    assert all(g["given"] and g["digest"] == ev["digest"] for g in ev["given"].values())
    assert (ref.scratch / "home" / CACHE_SUBDIR / "KEY" / "k.cubin").read_bytes() == b"compiled"
    # A second run of the same build on this host finds the kept cache: no warm step.
    again = LocalLauncher(
        EngineOptions("tiny", "torch"), tmp_path / "run2", env=env, sandbox=_FakeSandbox(), weights=handed
    )
    monkeypatch.setattr(again, "_popen", popen)
    assert again.prepare_kernels().ready and len(ran) == 1
    assert again.kernels is not None and not again.kernels.filled_this_run
    # So does the next build of the engine under test, with weights of its own (the same configuration):
    # no compile reads the weights' bytes.
    other = tmp_path / "w2.safetensors"
    other.write_bytes(b"other weights")
    next_build = LocalLauncher(
        EngineOptions("tiny", "torch"), tmp_path / "run3", env=env, sandbox=_FakeSandbox(),
        weights=HandedWeights(other, "sha256:w2", len(b"other weights"), "/w2", "test"),
    )  # fmt: skip
    monkeypatch.setattr(next_build, "_popen", popen)
    assert next_build.prepare_kernels().ready and len(ran) == 1
    # Another configuration (a backend, a preset, a launch document) is another key: a warm step of its own.
    other_config = LocalLauncher(
        EngineOptions("tiny", "triton"), tmp_path / "run4", env=env, sandbox=_FakeSandbox(), weights=handed
    )
    monkeypatch.setattr(other_config, "_popen", popen)
    assert other_config.prepare_kernels().wait(30) and len(ran) == 2


def test_a_cpu_target_gives_no_cache_and_says_why(tmp_path: Path) -> None:
    class Cpu(_FakeSandbox):
        gpu = False

    launcher = LocalLauncher(EngineOptions("tiny", "torch"), tmp_path / "run", env={}, sandbox=Cpu())
    assert launcher.prepare_kernels().evidence()["reason"] == "a cpu target: its engines compile no kernels"


@pytest.mark.slow
def test_the_reference_engines_warm_verb_runs_each_kind_of_request_and_exits(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QUALIFY_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "qualify.engine", "warm", "--preset", "tiny", "--num-spec", "2"]
    done = subprocess.run(argv + ["--device", "cpu"], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])["warm"]
    assert "eager b=1 n=6" in out["ran"] and "speculative b=8 n=128" in out["ran"]
    each = out["seconds_each"]  # seconds per kind of work, and the capture's
    assert set(each) == {*out["ran"], "capture"} and all(v >= 0 for v in each.values())
    assert out["captured"]["captured"] is False  # no CUDA: nothing captured, and why
    assert out["captured"]["reason"]


def test_the_harness_keeps_only_the_newest_caches(tmp_path: Path) -> None:
    folder = tmp_path / "kernels"
    folder.mkdir()
    for i in range(5):
        kept = folder / f"proxy-{i}"
        keep(_step_cache(tmp_path / f"step{i}"), kept, {})
        os.utime(kept / MANIFEST, (1000 + i, 1000 + i))
    (folder / "not-a-cache").mkdir()  # no manifest: not the harness's to remove
    assert sorted(kernels.prune(folder, keep_entries=2)) == ["proxy-0", "proxy-1", "proxy-2"]
    assert sorted(p.name for p in folder.iterdir()) == ["not-a-cache", "proxy-3", "proxy-4"]


def test_a_warm_step_that_finds_no_room_on_its_gpu_leaves_no_cache_and_says_why(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "harness-cache"))
    launcher = _gpu_launcher(tmp_path)
    line = "no room: the weights (40.0 GiB) leave no room for a second engine beside the engine under test"

    def popen(argv, scratch, env, **kw):
        kw["stdout"].write(line + "\n")
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({EXIT_NO_ROOM})"]), None

    monkeypatch.setattr(launcher, "_popen", popen)
    cache = launcher.prepare_kernels()
    assert cache.wait(30) and not cache.ready
    ev = cache.evidence()
    assert ev["reason"] == f"the warm step left no kernel cache: {line}" and ev["origin"] is None


def _gpu_launcher(tmp_path: Path, name: str = "run") -> LocalLauncher:
    """A launcher of a GPU sandbox whose weights are planned (the warm step starts before they exist)."""
    launcher = LocalLauncher(EngineOptions("tiny", "torch"), tmp_path / name, env={}, sandbox=_FakeSandbox())
    launcher.plan_weights()
    return launcher


def _running_engine_home(tmp_path: Path) -> Path:
    home = tmp_path / "engine-scratch" / "home"
    home.mkdir(parents=True)
    return home


def test_a_cache_given_to_a_running_engine_arrives_whole_and_leaves_what_it_compiled_its_own(
    tmp_path: Path,
) -> None:
    kept = tmp_path / "kept"
    m = keep(_step_cache(tmp_path / "step"), kept, {})
    home = _running_engine_home(tmp_path)
    own = home / CACHE_SUBDIR / "BBBB"  # the engine compiled this one itself before the cache came
    own.mkdir(parents=True)
    (own / "m.cubin").write_bytes(b"its own")
    got = give_live(kept, home, None)
    assert got["digest"] == m["digest"] and got["entries"] == 1 and got["entries_it_had"] == 1
    assert (home / CACHE_SUBDIR / "AAAA" / "k.cubin").read_bytes() == b"AAAA/k.cubin" * 10
    assert (own / "m.cubin").read_bytes() == b"its own" and not (own / "m.json").exists()
    assert not list((home / CACHE_SUBDIR).glob(".qualify-given*"))
    assert not (home / CACHE_SUBDIR / MANIFEST).exists()


def test_links_a_running_engine_plants_never_move_a_late_give_out_of_its_scratch(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    keep(_step_cache(tmp_path / "step"), kept, {})
    outside = tmp_path / "operator-dir"
    outside.mkdir()
    # Its whole Triton folder a link to a folder of the operator's: nothing is written through it.
    home = _running_engine_home(tmp_path)
    (home / ".triton").symlink_to(outside)
    with pytest.raises(OSError):
        give_live(kept, home, None)
    assert list(outside.iterdir()) == []
    # A link where an entry, or the harness's name for an entry being built, goes: left alone.
    home2 = tmp_path / "other" / "home"
    cache = home2 / CACHE_SUBDIR
    cache.mkdir(parents=True)
    (cache / "AAAA").symlink_to(outside)
    (cache / ".qualify-given.BBBB").symlink_to(outside)
    got = give_live(kept, home2, None)
    assert got["entries"] == 0 and got["entries_it_had"] == 2
    assert list(outside.iterdir()) == []
    assert (cache / "AAAA").is_symlink()  # the rename replaced nothing of the operator's either


def test_the_engine_under_test_gets_the_cache_late_when_the_step_is_not_done_at_its_start(
    tmp_path: Path, monkeypatch
) -> None:
    import threading

    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "harness-cache"))
    launcher = _gpu_launcher(tmp_path)
    release = threading.Event()

    def popen(argv, scratch, env, **kw):  # a warm step that finishes only when released
        made = scratch / "home" / CACHE_SUBDIR / "KEY"
        made.mkdir(parents=True)
        (made / "k.cubin").write_bytes(b"compiled")
        release.wait(30)
        return subprocess.Popen([sys.executable, "-c", "pass"]), None

    monkeypatch.setattr(launcher, "_popen", popen)
    cache = launcher.prepare_kernels()
    launcher._give_kernels(launcher.scratch)  # the engine under test starts while the step runs
    assert cache.evidence()["given"]["engine"]["given"] is False
    timer = threading.Timer(0.3, release.set)
    timer.start()
    record = launcher.give_kernels_late(30)
    assert record is not None and record["given"] is True
    assert record["late"]["waited_s"] >= 0.2 and record["late"]["entries"] == 1
    assert "still running" in record["at_start"]
    assert (launcher.scratch / "home" / CACHE_SUBDIR / "KEY" / "k.cubin").read_bytes() == b"compiled"
    assert launcher.give_kernels_late(30) is None  # once given, never again
    # What the engine compiled beyond what it was given is counted when it stops.
    extra = launcher.scratch / "home" / CACHE_SUBDIR / "MINE"
    extra.mkdir()
    (extra / "_missed_kernel.cubin").write_bytes(b"x")
    (extra / "__grp___missed_kernel.json").write_bytes(b"{}")
    launcher._boots = 1
    launcher.stop(0.1)
    own = cache.evidence()["given"]["engine"]["compiled_itself"]
    assert own == {"entries": 1, "kernels": ["_missed_kernel"]}


@pytest.mark.parametrize("changed_after", [False, True])
def test_an_engine_that_starts_while_the_step_runs_gets_its_finished_entries_first(
    tmp_path: Path, monkeypatch, changed_after: bool
) -> None:
    """Only entries the step has finished come early (a kernel once its group file names every file there,
    a launcher's one library), never through a link; the rest come late; and the record says whether the
    early files are what the step left in the end."""
    import threading

    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "harness-cache"))
    launcher = _gpu_launcher(tmp_path)
    release, written = threading.Event(), threading.Event()
    secret = tmp_path / "secret"
    secret.write_text("the operator's key")

    def popen(argv, scratch, env, **kw):  # a warm step part way through its compiles
        cache = scratch / "home" / CACHE_SUBDIR
        done = cache / "DONE"
        done.mkdir(parents=True)
        (done / "k.cubin").write_bytes(b"compiled")
        (done / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": str(done / "k.cubin")}}))
        (cache / "LAUNCHER").mkdir()
        (cache / "LAUNCHER" / "__triton_launcher.so").write_bytes(b"\x7fELF")
        (cache / "HALF").mkdir()
        (cache / "HALF" / "h.cubin").write_bytes(b"no group yet")
        (cache / "LINK").mkdir()
        (cache / "LINK" / "__triton_launcher.so").symlink_to(secret)
        (cache / "ELSEWHERE").symlink_to(tmp_path)
        written.set()
        release.wait(30)
        (cache / "HALF" / "__grp__h.json").write_text(json.dumps({"child_paths": {}}))
        if changed_after:
            (done / "k.cubin").write_bytes(b"recompiled")
        return subprocess.Popen([sys.executable, "-c", "pass"]), None

    monkeypatch.setattr(launcher, "_popen", popen)
    cache = launcher.prepare_kernels()
    assert written.wait(30)
    launcher._give_kernels(launcher.scratch)  # the engine under test starts while the step runs
    given = launcher.scratch / "home" / CACHE_SUBDIR
    assert sorted(p.name for p in given.iterdir()) == ["DONE", "LAUNCHER"]
    early = cache.evidence()["given"]["engine"]
    assert early["given"] is False and early["early"]["entries"] == 2 and early["early"]["files"] == 3
    release.set()
    record = launcher.give_kernels_late(30)
    assert record is not None and record["given"] is True
    assert (given / "HALF" / "h.cubin").read_bytes() == b"no group yet"  # came late
    assert not (given / "LINK").exists() and not (given / "ELSEWHERE").exists()
    assert record["early"]["matches_kept"] is (not changed_after)
    launcher._boots = 1
    launcher.stop(0.1)
    assert cache.evidence()["given"]["engine"]["compiled_itself"]["entries"] == 0  # early ones were given


def test_what_an_engine_compiled_itself_is_counted_by_name_without_following_links(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cache = home / CACHE_SUBDIR
    for key, names in {
        "GIVEN": ["a.cubin"],
        "NEW1": ["k1.json", "k1.cubin"],
        "NEW2": ["__triton_launcher.so"],
    }.items():
        (cache / key).mkdir(parents=True)
        for n in names:
            (cache / key / n).write_bytes(b"x")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "operator.key").write_bytes(b"k")
    (cache / "LINK").symlink_to(secret)
    assert compiled_itself(home, {"GIVEN"}) == {"entries": 2, "kernels": ["__triton_launcher", "k1"]}
    assert compiled_itself(tmp_path / "nothing", set()) == {"entries": 0}


def test_a_step_still_running_ends_with_the_launcher(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "harness-cache"))
    launcher = _gpu_launcher(tmp_path)
    started: list[subprocess.Popen] = []

    def popen(argv, scratch, env, **kw):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        started.append(proc)
        return proc, None

    monkeypatch.setattr(launcher, "_popen", popen)
    cache = launcher.prepare_kernels()
    for _ in range(100):
        if launcher._steps:
            break
        time.sleep(0.05)
    launcher.stop(0.1)
    assert started and started[0].poll() is not None  # gone with the run, not left compiling
    assert cache.wait(10) and not cache.ready
