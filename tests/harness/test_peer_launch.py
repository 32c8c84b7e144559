"""The harness's side of launching the KV-transfer peer: bounded in time, its report bounded in size and
parsed strictly, and run from the harness's own peer module whatever engine module is under test."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.launch.base import MAX_PEER_REPORT_BYTES, PEER_FILE, EngineOptions, PeerOutcome
from qualify.launch.local import LocalLauncher
from qualify.launch.sandbox import SANDBOX_GID, SANDBOX_UID, Bwrap, CodeSet, Sandbox


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the interpreter: it gets the peer's argv (-m MODULE --spec S --out O)."""
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def _launcher(tmp_path: Path, python: str, **env: str) -> LocalLauncher:
    return LocalLauncher(EngineOptions("tiny", "auto"), tmp_path / "run", python=python, env=env)


def test_a_peer_that_does_not_finish_is_killed_at_its_deadline(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    out = _launcher(tmp_path, _fake_python(tmp_path, "sleep 30")).run_peer(spec, 1.0)
    assert out.exit_code is None and out.report is None
    assert "did not finish within" in out.error and out.seconds < 10


def test_the_peer_is_the_harness_module_not_the_engine_under_test(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    # The fake interpreter writes its argv and environment as the report.
    body = (
        'printf \'{"argv": "%s", "module": "%s", "path": "%s", "cwd": "%s"}\' '
        '"$*" "$QUALIFY_ENGINE_MODULE" "$PYTHONPATH" "$PWD" > "$6"'
    )
    launcher = _launcher(
        tmp_path, _fake_python(tmp_path, body), QUALIFY_ENGINE_MODULE="tests.liars.x", PYTHONPATH="/evil"
    )
    out = launcher.run_peer(spec, 10.0)
    assert out.error is None and out.exit_code == 0, out
    # -I: no PYTHONPATH, no user site, no working-directory or script-folder imports (nothing the engine
    # could write); the harness's own peer file, run as a script (no installed qualify needed)
    assert out.report["argv"].startswith(f"-I {PEER_FILE} --spec {spec}")
    assert out.report["module"] == ""  # the liar's module name does not reach the peer
    assert out.report["path"] == "" and out.report["cwd"] == "/"
    assert PEER_FILE.is_file() and PEER_FILE.parent.name == "engine"


def test_reports_are_parsed_strictly_and_bounded_in_size() -> None:
    def parse(raw: bytes | None, code: int | None = 0) -> PeerOutcome:
        return PeerOutcome.from_output(["peer"], code, 0.5, raw, "")

    assert parse(json.dumps({"groups": []}).encode()).report == {"groups": []}
    assert "without a report" in parse(None, 1).error
    assert "not JSON" in parse(b"{nope").error
    assert "not a JSON object" in parse(b"[1, 2]").error
    big = b'{"x": "' + b"a" * MAX_PEER_REPORT_BYTES + b'"}'
    assert "over" in parse(big).error and parse(big).report is None


def test_the_layout_check_fails_closed_when_no_peer_can_be_launched() -> None:
    import httpx

    from qualify.checks import layout

    from .test_checks_evidence import Engine, _context

    class NoPeerEngine(Engine):
        def handle(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/qualify/kv-handles":
                return httpx.Response(200, json={"groups": []})
            return super().handle(request)

    # The test launcher keeps the contract's default run_peer: it cannot launch a peer.
    out = layout.run(_context(NoPeerEngine()))
    assert out.status == "fail"
    peer = {k: c for k, c in out.conditions.items() if k.startswith("peer_")}
    assert peer and not any(c.holds for c in peer.values())
    assert all(c.source == "observed" for c in peer.values())
    assert "cannot launch a peer" in out.conditions["peer_ran"].detail


def test_the_peer_takes_the_engines_uid_only_while_it_holds_cuda_handles(tmp_path: Path) -> None:
    """--cuda-as: the NVIDIA driver opens a legacy CUDA IPC handle only for the exporter's real uid
    (scripts/ipc-matrix on the H200); the peer reads its spec and writes its report with its own ids, and
    its saved uid never changes (the engine's uid cannot trace it, and it returns to root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only a root harness gives its engine another uid")
    probe = (
        "import os, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); import peer; "
        "seen = []; "
        "peer.run = lambda spec: seen.append((os.getresuid(), os.getresgid(), os.getgroups())) or "
        "{'pid': 0, 'spans': [], 'groups': [], 'unexpected': [], 'error': None}; "
        "rc = peer.main(['--spec', sys.argv[2], '--out', sys.argv[3], '--cuda-as', sys.argv[4]]); "
        "print(seen, os.getresuid(), os.getresgid())"
    )
    spec, out = tmp_path / "spec.json", tmp_path / "report.json"
    spec.write_text("{}")
    os.chmod(tmp_path, 0o700)  # the engine's uid could not read the spec nor write the report here
    ids = f"{SANDBOX_UID}:{SANDBOX_GID}"
    r = subprocess.run(
        [sys.executable, "-c", probe, str(PEER_FILE), str(spec), str(out), ids],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    u, g = SANDBOX_UID, SANDBOX_GID
    assert r.stdout.split("] ", 1)[0] + "]" == f"[(({u}, {u}, 0), ({g}, {g}, 0), [])]"
    assert r.stdout.strip().endswith("(0, 0, 0) (0, 0, 0)")
    assert json.loads(out.read_text())["error"] is None and out.stat().st_uid == 0


def test_only_a_root_harness_with_a_gpu_sandbox_asks_the_peer_for_the_engines_uid(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, "/bin/true")
    assert launcher.peer_identity() == []  # unsandboxed: the engine has the harness's own uid
    code = CodeSet((), (), (), (), "qualify.engine", ())
    for userns, gpu, want in ((False, True, True), (False, False, False), (True, True, False)):
        launcher.sandbox = Sandbox(Bwrap("/usr/bin/bwrap", None, "0.8", userns), code, gpu)
        assert launcher.peer_identity() == (["--cuda-as", f"{SANDBOX_UID}:{SANDBOX_GID}"] if want else [])


def test_the_recorded_h200_runs_are_why_the_peer_takes_the_engines_real_uid() -> None:
    """tests/data/ipc-matrix: on the H200 a sandboxed engine's handle opened only for importers of its uid,
    a root exporter's from any root importer, and the peer with only the engine's effective uid failed to
    open any. peer_identity's choice rests on these recordings."""
    data = Path(__file__).parents[1] / "data/ipc-matrix"
    rec = json.loads((data / "h200-2026-12-02.json").read_text())
    rows = {
        r["exporter"]: {k: v["result"].startswith("OK") for k, v in r["imports"].items()}
        for r in rec["results"]
    }
    assert {k for k, ok in rows["sandbox"].items() if ok} == {"ns-uid", "mnt-uid"}
    assert not rows["sandbox"]["ns-euid"] and not rows["sandbox"]["ns"]  # ns-euid: root there (README)
    assert all(rows["sandbox-root"].values()) and rows["none"]["host"]
    run = json.loads((data / "peer-effective-uid-run-c99e569.json").read_text())
    assert run["provenance"]["commit"].startswith("c99e569") and run["target"] == "gpu"
    assert run["conditions"]["layout"]["peer_found_every_group"][0] is False
    shown = (data / "peer-effective-uid-run-c99e569.receipts-show.txt").read_text()
    assert (
        "peer_echo_round_trip (observed): kda0: AcceleratorError: CUDA error: mapping of buffer object"
        in shown
    )


def test_peers_started_ahead_take_their_spec_on_stdin_and_unused_ones_exit_at_stop(tmp_path: Path) -> None:
    """prepare_peers starts peers that import torch and wait; run_peer hands one its spec through the pipe
    (the real peer file: an empty spec is refused in its report), and stop ends those never used."""
    launcher = _launcher(tmp_path, sys.executable)
    launcher.run_dir.mkdir(parents=True)
    assert launcher.prepare_peers(2) == 0  # no engine running: nothing to start beside
    launcher._pid = os.getpid()  # an engine "running" (unsandboxed: the peers start as the harness's)
    assert launcher.prepare_peers(2) == 2
    spares = [p for p, _ in launcher._spare_peers]
    spec = launcher.run_dir / "peer-spec.json"
    spec.write_text("{}")
    out = launcher.run_peer(spec, 60.0)
    assert out.report is not None and "KeyError" in (out.report.get("error") or ""), out
    # its own account of its seconds: the wait for the order, then the work (no CUDA on this host)
    assert set(out.report["seconds_each"]) == {"waited_for_order", "work"}
    assert out.exit_code == 1 and "--wait" in out.command and str(spec) in out.command[-1]
    assert (launcher.run_dir / "peer-spec.log").is_file()  # the spare's log, under the spec's name
    assert not (launcher.run_dir / "peer-spare-0.log").exists()
    assert spares[0].poll() is not None and spares[1].poll() is None
    assert launcher.prepare_peers(2) == 2  # topped up
    launcher._drop_spare_peers()  # as stop() does
    assert spares[1].poll() is not None and launcher._spare_peers == []
    assert spares[1].returncode == 0  # EOF before a spec: it was not needed


def test_a_waiting_peer_that_reads_eof_exits_quietly() -> None:
    done = subprocess.run(
        [sys.executable, "-I", str(PEER_FILE), "--wait"], input=b"", capture_output=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == b""


def test_the_layout_checks_peers_start_when_the_engine_answers_and_a_failure_there_is_not_boots() -> None:
    """The pipeline hands boot (Context.engine_up) the prepare of every check marked prepare_at_ready: the
    layout check's, which starts its peers on a GPU target; an exception there is swallowed (the call
    after boot tries again) rather than failing boot."""
    from types import SimpleNamespace

    from qualify.checks import layout
    from qualify.run.pipeline import Pipeline

    assert layout.CHECK.prepare_at_ready and layout.CHECK.prepare is layout.prefetch
    asked: list[int] = []
    launcher = SimpleNamespace(prepare_peers=asked.append)
    pipeline = object.__new__(Pipeline)
    pipeline.req = SimpleNamespace(dcp=None)
    ctx = SimpleNamespace(target="gpu", launcher=launcher)
    pipeline._at_ready(ctx, float("inf"))()  # type: ignore[arg-type]
    assert asked == [layout.PEERS_AHEAD]
    ctx.target = "cpu"  # a CPU target's peer needs no torch: none ahead
    pipeline._at_ready(ctx, float("inf"))()  # type: ignore[arg-type]
    assert asked == [layout.PEERS_AHEAD]

    def broken(n: int) -> int:
        raise OSError("no room for another process")

    ctx.target, launcher.prepare_peers = "gpu", broken
    pipeline._at_ready(ctx, float("inf"))()  # type: ignore[arg-type]  # nothing raised


def test_the_fresh_reference_boots_once_boot_passes_and_a_timed_check_waits_for_that_boot() -> None:
    """reload.prefetch boots the fresh reference as soon as boot has passed, on a GPU target where NVML says
    the GPU has room for it (early_room); a check that times the engine first waits, bounded, for that boot
    to end (settle_prepared), and the reference's evidence records the wait; a second prefetch starts
    nothing more."""
    import threading
    import time
    from types import SimpleNamespace

    from qualify.checks import reload
    from qualify.run.pipeline import settle_prepared

    release = threading.Event()
    started: list[float] = []

    class Ref:
        netns = None

        def start(self, bound: float) -> str:
            started.append(bound)
            release.wait(10.0)
            return "http://127.0.0.1:1"

        def stop(self, timeout: float) -> None:
            release.set()

    options = reload.EngineOptions(preset="tiny", kda_backend="auto")
    status = SimpleNamespace(detail={"pid": 4242})
    launcher = SimpleNamespace(
        sibling=lambda options, name: Ref(), options=options, kind="local", status=lambda: status
    )
    gib = 1 << 30
    free = {0: (70 * gib, 80 * gib)}
    ctx = SimpleNamespace(
        target="gpu", prepared={}, facts={}, launcher=launcher, remaining=lambda: 60.0,
        gpu_free=lambda: free, gpu_memory=lambda: {4242: {0: 6 * gib}, 7: {0: gib}},
    )  # fmt: skip
    # Room on the GPU is asked first: too little free (a GPU shared by other runs), or NVML silent, and
    # the reference boots with the reload check instead.
    for free_now, held in (
        ((30 * gib, 80 * gib), {4242: {0: 6 * gib}}),  # too little free
        ((46 * gib, 80 * gib), {4242: {0: 5 * gib}}),  # room, but most of the memory in use is others'
        ((70 * gib, 80 * gib), None),  # NVML silent
    ):
        ctx.gpu_free, ctx.gpu_memory = (lambda f=free_now: {0: f}), (lambda h=held: h)
        reload.prefetch(ctx, 30.0)  # type: ignore[arg-type]
        assert "reload" not in ctx.prepared and ctx.facts["fresh_reference_early"]["booted_early"] is False
    ctx.gpu_free, ctx.gpu_memory = (lambda: free), (lambda: {4242: {0: 6 * gib}, 7: {0: gib}})
    reload.prefetch(ctx, 30.0)  # type: ignore[arg-type]
    assert ctx.facts["fresh_reference_early"]["booted_early"] is True
    first = ctx.prepared["reload"]
    reload.prefetch(ctx, 30.0)  # type: ignore[arg-type]
    assert ctx.prepared["reload"] is first
    t0 = time.monotonic()
    settle_prepared(ctx.prepared, 0.2)  # the boot is still going: the wait is bounded
    assert 0.15 <= time.monotonic() - t0 < 5.0 and first.url is None
    release.set()
    settle_prepared(ctx.prepared, 5.0)
    assert first.url == "http://127.0.0.1:1" and started == [30.0]
    assert first.settled_s >= 0.15
    settle_prepared({"other": object()}, 1.0)  # nothing to settle: nothing happens
    first.close()
