"""The run: boot the engine, start the watchers, run the checks in order within their time budgets, stop,
judge, and always write a receipt — also when a check hangs, the engine dies, or SIGINT, SIGTERM, SIGHUP or
SIGQUIT arrives. The run directory holds the request and the results so far under the harness's lock, so a
run whose harness is SIGKILLed is closed by the next `qualify run` or `qualify gc` (qualify.run.recover)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from qualify import __version__, settings
from qualify.checks import checks_for
from qualify.checks.base import Check, Context, Outcome
from qualify.checks.boot import sent_config
from qualify.checks.faults import LOG_LINES
from qualify.client import EngineClient, EngineError, EngineUnreachable
from qualify.launch.base import EngineOptions, Launcher, LaunchError, LaunchStatus, describe_exit
from qualify.launch.local import DEFAULT_ENGINE_MODULE
from qualify.protocol import dcp_ranks_lost
from qualify.run import receipt as rc
from qualify.run.geometry import geometry_for
from qualify.run.operator import OperatorKey
from qualify.run.request import RunRequest
from qualify.run.rundir import RunDir
from qualify.run.verdict import judge
from qualify.watch.kmsg import KmsgWatcher
from qualify.watch.nvml import NvmlWatcher
from qualify.watch.oom import cgroup_oom_kills, kernel_oom
from qualify.watch.procs import ProcessWatch
from qualify.watch.xid import XidEvent, table_evidence
from receipts.statement import Faults, config_digest
from receipts.store import Store

# Tests only: treat this host as a GPU host (target gpu) so the Xid-watch rules of a GPU target can be driven
# through `qualify run` on a CPU machine; the receipt's Xid watch reason records that it was set.
SIMULATE_GPU_HOST_ENV = "QUALIFY_TEST_SIMULATE_GPU_HOST"
RECOVERY_WAIT_S = 30.0  # how long to wait for a restarted engine before the next check
# One request's limit; every request is further bounded by its check's budget and the run's --timeout.
# Generous because on a GPU the first profiled step, the capture warm-up and a reload that generates and
# hashes 2.9 GB of proxy weights each take seconds to tens of seconds (cold Triton cache, slow disk).
REQUEST_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL; an engine that stopped answering gets the short one
STOP_GRACE_UNRESPONSIVE_S = 1.0
APPEND_GRACE_S = 0.05  # the store's lock wait once the run's --timeout is spent (a free lock is taken)
# The end of a run (stopping the engine, signing and storing the receipt) happens within --timeout: the
# checks end this much before it (at most a quarter of the run).
FINISH_RESERVE_S = 3.0


def process_elapsed_s() -> float:
    """Seconds since this process started (Linux /proc; 0.0 where it cannot be read): --timeout counts
    the interpreter's start and the store's opening too."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Reporter(Protocol):
    def check_started(self, name: str) -> None: ...
    def check_finished(self, name: str, status: str, seconds: float, reason: str | None) -> None: ...
    def note(self, message: str) -> None: ...


# Signals that end a run with an aborted receipt (SIGINT raises KeyboardInterrupt). SIGKILL cannot be caught:
# the engine watches a pipe from this process instead, and the next run closes the run directory.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class RunInterrupted(BaseException):
    """A stop signal arrived: stop, and still write the receipt. A BaseException, like KeyboardInterrupt, so
    no `except Exception` on the way (a Docker call, a check) can turn an interruption into a failure."""


@dataclass
class RunResult:
    verdict: str
    reasons: list[str]
    target: str
    checks: list[dict[str, Any]]
    receipt_id: str
    log_idx: int
    subjects: list[dict[str, Any]]
    faults: dict[str, Any]
    run_dir: str
    seconds: float
    keyid: str
    started_at: str
    finished_at: str
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "receipt_id": self.receipt_id,
            "log_index": self.log_idx,
            "verdict": self.verdict,
            "reasons": self.reasons,
            "target": self.target,
            "checks": [{k: c[k] for k in ("name", "status", "seconds", "reason")} for c in self.checks],
            "faults": self.faults,
            "subjects": self.subjects,
            "keyid": self.keyid,
            "run_dir": self.run_dir,
            "seconds": round(self.seconds, 3),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


def make_launcher(req: RunRequest, run_dir: Path) -> Launcher:
    # The KV geometry is asked for explicitly, so the peer's reading of it is the config the harness sent.
    opts = EngineOptions(
        preset=req.preset,
        kda_backend=req.kda_backend,
        num_spec=req.num_spec,
        extra_args=geometry_for(req).engine_args(),
    )
    if req.launcher == "docker":
        from qualify.launch.docker import DockerLauncher

        assert req.image is not None
        return DockerLauncher(
            opts, req.image, run_dir, gpus=req.gpus, mem_limit=req.mem_limit, engine_env=dict(req.engine_env)
        )
    from qualify.launch.local import ENGINE_MODULE_ENV, LocalLauncher
    from qualify.launch.sandbox import Sandbox

    env = dict(os.environ)
    if req.gpus and req.gpus != "all":
        env["CUDA_VISIBLE_DEVICES"] = req.gpus  # the local engine sees only the GPUs asked for
    module = env.get(ENGINE_MODULE_ENV) or DEFAULT_ENGINE_MODULE
    hidden = env.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    gpu = os.path.exists("/dev/nvidiactl") and not hidden
    if not req.sandbox:
        env.update(dict(req.engine_env))
        return LocalLauncher(opts, run_dir, env=env, sandbox=None)
    sandbox = Sandbox.for_engine(module, gpu=gpu, operator_env=dict(req.engine_env), env=env)
    return LocalLauncher(opts, run_dir, env=env, sandbox=sandbox)


@contextlib.contextmanager
def _signals_raise(received: list[str] | None = None) -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGQUIT raise RunInterrupted in the main thread (SIGINT: KeyboardInterrupt), and
    each is also appended to `received`: an exception raised while the main thread runs a callback (a
    weakref's, an import lock's, a finalizer) is printed and dropped by Python, so the pipeline also stops
    at the next check boundary when a signal came and nothing was raised."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if received is not None:
            received.append(name)
        raise RunInterrupted(f"received {name}")

    old = {s: signal.signal(s, on_term) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While the engine stops and the receipt is written, further signals wait: nothing is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _launch_record(ctx: Context) -> dict[str, Any]:
    """The receipt's record of what boot sent and read: the launch document and its digest, the engine's
    manifest, and the protocol version the engine reported (docs/PROTOCOL.md)."""
    doc, manifest = ctx.facts.get("launch_document"), ctx.facts.get("manifest")
    out: dict[str, Any] = {"protocol_version": ctx.describe.protocol_version if ctx.describe else None}
    if doc is not None:
        from qualify.run.launch import document_digest

        out.update(launch=doc.model_dump(mode="json"), launch_digest=document_digest(doc))
    if manifest is not None:
        out["manifest"] = manifest.model_dump(mode="json")
    return out


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def settle_prepared(prepared: dict[str, Any], timeout_s: float) -> None:
    """Before a check that times the engine: wait (each bounded by timeout_s) for what later checks started
    early and say may still be busy (`settle`: the reload check's fresh reference booting), which would share
    the GPU and the host's cores with the timed steps; each records its own wait in its evidence."""
    for early in list(prepared.values()):
        settle = getattr(early, "settle", None)
        if settle is not None:
            with contextlib.suppress(Exception):
                settle(timeout_s)


class Pipeline:
    def __init__(
        self,
        req: RunRequest,
        store: Store,
        key: OperatorKey,
        reporter: Reporter,
        launcher: Launcher | None = None,
    ) -> None:
        self.req = req
        self.store = store
        self.key = key
        self.reporter = reporter
        self.started = datetime.now(UTC)
        stamp = self.started.strftime("%Y%m%dT%H%M%SZ")
        self.run_dir = settings.data_dir() / "runs" / f"{stamp}-{uuid.uuid4().hex[:6]}"
        self.rundir = RunDir(self.run_dir)
        self.launcher = launcher or make_launcher(req, self.run_dir)
        self.kmsg = KmsgWatcher()
        self.nvml = NvmlWatcher()
        self.results: list[dict[str, Any]] = []
        self.interrupted: str | None = None
        self.signalled: list[str] = []  # stop signals received (each also raised RunInterrupted)
        self.unresponsive = False  # a request timed out: the engine may not honour SIGTERM either
        self.cgroup_oom_before = cgroup_oom_kills()
        self._ctx: Context | None = None  # set once the run starts: what progress.json records
        self._code_subject: tuple[str | None, str] | None = None
        self._code_thread: threading.Thread | None = None  # computing the code subject (_start_code_subject)
        self._code_error: BaseException | None = None
        self._sandbox_info: dict[str, Any] | None = None
        self.run_deadline = float("inf")

    # ------------------------------------------------------------ the run
    def run(self) -> RunResult:
        t0 = time.monotonic() - process_elapsed_s()
        self.run_deadline = t0 + self.req.timeout_s
        run_deadline = self.run_deadline - min(FINISH_RESERVE_S, self.req.timeout_s / 4)
        client = EngineClient(
            lambda: self.launcher.url(), timeout_s=REQUEST_TIMEOUT_S, netns=self.launcher.netns
        )
        ctx = Context(
            request=self.req,
            launcher=self.launcher,
            client=client,
            xid_events=self._xid_events,
            xid_watch=self._xid_watch,
            gpu_pids=self.nvml.compute_pids,
            gpu_memory=self.nvml.compute_memory,
            gpu_free=self.nvml.device_memory,
        )
        if self.launcher.kind == "local":  # a container's processes are docker's to count
            ctx.procs = ProcessWatch(self._launched_pid, self.nvml.compute_pids)
        try:
            with _signals_raise(self.signalled):
                # where the harness's seconds before its first check go: the process's start and imports up
                # to here, then each step (a diagnostic kept in boot's phases)
                marks = {"process_start_and_imports": round(time.monotonic() - t0, 3)}
                t_mark = time.monotonic()

                def mark(name: str) -> None:
                    nonlocal t_mark
                    now = time.monotonic()
                    marks[name] = round(now - t_mark, 3)
                    t_mark = now

                self.rundir.claim(self.req.request_info(), self.req.db_url, self.started, __version__)
                mark("run_dir")
                self._start_code_subject()
                mark("code_digest_started")
                self.kmsg.start()
                mark("kernel_log_watch")
                self.nvml.start()
                mark("nvml_watch")
                ctx.target = self._expected_target()
                self._ctx = ctx
                self._progress(None)
                mark("target_and_progress")
                # the harness's own seconds before its first check (the code digest goes on beside boot)
                ctx.facts["before_first_check_s"] = round(time.monotonic() - t0, 3)
                ctx.facts["before_first_check_each"] = marks
                if not self.req.fail_fast:
                    ctx.engine_up = self._at_ready(ctx, run_deadline)
                    ctx.engine_spawned = self._at_ready(ctx, run_deadline, spawned=True)
                self._checks(ctx, run_deadline)
                self._stop_if_signalled()  # a signal whose exception was dropped after the last check
        except (KeyboardInterrupt, RunInterrupted) as exc:
            self.interrupted = str(exc) or "interrupted (SIGINT)"
            if isinstance(exc, KeyboardInterrupt):
                self.interrupted = "interrupted (SIGINT)"
        finally:
            with _signals_deferred():
                try:
                    result = self._finish(ctx, client, t0)
                finally:
                    self.rundir.release()
        return result

    def _stop_if_signalled(self) -> None:
        if self.signalled:
            raise RunInterrupted(f"received {self.signalled[0]}")

    def _at_ready(self, ctx: Context, run_deadline: float, spawned: bool = False) -> Callable[[], None]:
        """What boot calls once the engine answers: the `prepare` of every check marked prepare_at_ready
        (spawned: what the launcher calls once the engine's first process exists, those marked
        prepare_at_spawn). Work started early to save time: a failure here is not boot's, and the call
        after boot retries."""
        early = [
            c.prepare
            for c in checks_for(self.req)
            if (c.prepare_at_spawn if spawned else c.prepare_at_ready) and c.prepare is not None
        ]

        def engine_up() -> None:
            for prepare in early:
                with contextlib.suppress(Exception):
                    prepare(ctx, max(1.0, run_deadline - time.monotonic()))

        return engine_up

    def _checks(self, ctx: Context, run_deadline: float) -> None:
        engine_down: str | None = None
        for check in checks_for(self.req):
            self._stop_if_signalled()
            now = time.monotonic()
            if now >= run_deadline:
                self.interrupted = (
                    f"run timeout: --timeout {self.req.timeout_s:g} s reached before {check.name}"
                )
                return
            if engine_down and check.needs_engine:
                self._record(check.name, Outcome("error", {}, engine_down), 0.0)
                continue
            ctx.deadline = min(run_deadline, now + check.timeout_s)
            ctx.client.deadline = ctx.deadline
            settle = getattr(self.launcher, "settle", None)
            if check.times_engine and settle is not None:
                # A warm step still compiling beside the engine (launch/kernels.py) would share the GPU
                # with the steps this check times. The wait is in the receipt.
                settle(max(0.0, ctx.deadline - time.monotonic()) / 4)
            if check.times_engine:
                settle_prepared(ctx.prepared, max(0.0, ctx.deadline - time.monotonic()) / 4)
            ctx.client.take_waited()
            outcome, seconds, trouble = self._one(check, ctx)
            waited = ctx.client.take_waited()
            if waited:
                # The harness's wait on the engine under test, per endpoint, inside this check's seconds
                # (other engines a check boots, and the harness's own work, are the rest).
                outcome.evidence.setdefault("time_waited_on_engine", waited)
            if ctx.procs is not None:
                with contextlib.suppress(Exception):
                    ctx.procs.sample()  # at every check boundary, besides the background samples
            self._record(check.name, outcome, seconds)
            if outcome.status != "pass" and time.monotonic() >= run_deadline:
                # The run's limit ended this check (a boot slower than --timeout): the run was cut short,
                # which says nothing against the build.
                self.interrupted = (
                    f"run timeout: --timeout {self.req.timeout_s:g} s reached during {check.name}"
                )
                return
            if check.name == "boot" and outcome.status != "pass" and ctx.describe is None:
                return  # nothing to check without an engine; the verdict names the checks not run
            if self.req.fail_fast and outcome.status in ("fail", "error"):
                return  # --fail-fast: the verdict names the checks not run
            if check.name == "boot" and outcome.status == "pass" and not self.req.fail_fast:
                for later in checks_for(self.req):
                    if later.prepare is not None:
                        later.prepare(ctx, max(1.0, run_deadline - time.monotonic()))
            if trouble is not None:
                self.unresponsive = self.unresponsive or trouble.timed_out
                if trouble.timed_out and time.monotonic() >= run_deadline:
                    self.interrupted = (
                        f"run timeout: --timeout {self.req.timeout_s:g} s reached during {check.name}"
                    )
                    return
                wait = min(RECOVERY_WAIT_S, max(0.0, run_deadline - time.monotonic()))
                if not self._recovered(ctx, wait):
                    engine_down = f"the engine stopped answering during {check.name}: {trouble}"

    def _one(self, check: Check, ctx: Context) -> tuple[Outcome, float, EngineUnreachable | None]:
        self.reporter.check_started(check.name)
        self._progress(check.name)
        t = time.monotonic()
        trouble: EngineUnreachable | None = None
        try:
            outcome = check.run(ctx)
        except EngineUnreachable as exc:
            trouble = exc
            outcome = Outcome("error", {"path": exc.path, "timed_out": exc.timed_out}, str(exc))
        except EngineError as exc:
            outcome = Outcome("error", {"path": exc.path, "status": exc.status, "type": exc.type}, str(exc))
        except LaunchError as exc:
            outcome = Outcome("error", {}, str(exc))
        except (KeyboardInterrupt, RunInterrupted) as exc:
            reason = "interrupted (SIGINT)" if isinstance(exc, KeyboardInterrupt) else str(exc)
            self._record(check.name, Outcome("error", {}, reason), time.monotonic() - t)
            raise
        except Exception as exc:  # a harness or protocol bug must still end in a receipt
            outcome = Outcome(
                "error", {"exception": type(exc).__name__}, f"{type(exc).__name__}: {exc}"[:500]
            )
        return outcome, time.monotonic() - t, trouble

    def _launched_pid(self) -> int | None:
        pid = self.launcher.status().detail.get("pid")
        return pid if isinstance(pid, int) else None

    def _recovered(self, ctx: Context, wait_s: float) -> bool:
        """After a lost connection: did the (maybe restarted) engine answer /health within `wait_s`?"""
        end = time.monotonic() + wait_s
        waiter = getattr(self.launcher, "wait_ready", None)
        if waiter is not None and not waiter(wait_s):
            return False
        with contextlib.suppress(Exception):
            self.launcher.url(refresh=True)
        ctx.client.deadline = None
        while True:
            try:
                ctx.client.health(timeout_s=2.0)
                return True
            except (EngineUnreachable, EngineError):
                if time.monotonic() >= end:
                    return False
                time.sleep(0.2)

    def _record(self, name: str, outcome: Outcome, seconds: float) -> None:
        if any(r["name"] == name for r in self.results):
            return
        self.results.append(
            {
                "name": name,
                "status": outcome.status,
                "conditions": {k: c.as_json() for k, c in outcome.conditions.items()},
                "evidence": _json_safe(outcome.evidence),
                "seconds": round(seconds, 3),
                "reason": outcome.reason,
            }
        )
        self.reporter.check_finished(name, outcome.status, seconds, outcome.reason)
        self._progress(None)

    def _progress(self, current: str | None) -> None:
        """What a later process needs to close this run if its harness is killed (qualify.run.recover)."""
        ctx = self._ctx
        if ctx is None:
            return
        engine: dict[str, Any] | None = None
        weights = None
        if self._code_ready():  # before boot: what was asked, and the image or code on disk
            engine, weights = self._engine(ctx)
        restarts = 0
        with contextlib.suppress(Exception):
            restarts = self.launcher.status().restart_count
        self.rundir.progress(
            {
                "current": current,
                "checks": self.results,
                "target": ctx.target,
                "engine": engine,
                "weights_digest": weights,
                "identity": self._identity(),
                "backend": ctx.facts.get("backend"),
                "layout": ctx.facts.get("layout"),
                "restart_count": restarts,
            }
        )

    # ------------------------------------------------------------ the end
    def _xid_events(self) -> list[XidEvent]:
        return self.kmsg.snapshot() + self.nvml.snapshot()

    def _host_has_gpu(self) -> bool:
        if os.environ.get(SIMULATE_GPU_HOST_ENV) == "1":
            return True  # tests only: the receipt's Xid watch reason says the GPU host was simulated
        files = any(os.path.exists(p) for p in ("/dev/nvidia0", "/proc/driver/nvidia/version"))
        return files or bool(self.nvml.devices)

    def _expected_target(self) -> str:
        """What the engine must run on, from the host and the launch, decided before it boots: docker sees a
        GPU only when --gpus asks for one; a local engine sees the host's GPUs unless CUDA_VISIBLE_DEVICES
        hides them all."""
        if self.launcher.kind == "docker":
            return "gpu" if self.req.gpus else "cpu"
        env = getattr(self.launcher, "env", None) or os.environ
        hidden = env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
        return "gpu" if self._host_has_gpu() and not hidden else "cpu"

    def _xid_watch(self) -> dict[str, Any]:
        """active: a live source watched (NVML registered on every GPU with its event loop running, or the
        kernel log being read); replayed: a file named by QUALIFY_KMSG_SOURCE was read (tests, CPU targets:
        never a live watch); not_applicable: no NVIDIA GPU here; unavailable: a GPU host where no live source
        was watched, or the one that was failed (`since` says when). Asked again after stop, it covers the
        whole run."""
        nv, km = self.nvml, self.kmsg
        simulated = os.environ.get(SIMULATE_GPU_HOST_ENV) == "1"
        note = f" (GPU host simulated by {SIMULATE_GPU_HOST_ENV}=1, tests only)" if simulated else ""
        since = km.lost_at or nv.lost_at
        nv_text = f"NVML {nv.status}" + (f" ({nv.reason})" if nv.reason else "")
        if km.kind == "file":
            return {
                "state": "replayed",
                "reason": f"kernel log replayed from {km.source}, not a live watch; {nv_text}{note}",
            }
        tail = (
            f"kernel log {km.source} {km.status}: {km.lines_read} lines"
            + (f" ({km.reason})" if km.reason else "")
            if km.source
            else f"kernel log unavailable: {km.reason}"
        )
        if nv.live():
            n = len(nv.devices)
            return {
                "state": "active",
                "reason": f"NVML Xid events registered on all {n} GPU(s); {tail}{note}",
            }
        # Reading the kernel log on a host with no NVIDIA GPU watches for nothing: not_applicable, not active.
        if not self._host_has_gpu():
            return {"state": "not_applicable", "reason": f"no NVIDIA GPU: {nv_text}; {tail}"}
        if km.live():
            return {"state": "active", "reason": f"{tail}; {nv_text}{note}"}
        return {
            "state": "unavailable",
            "reason": f"GPU host, but no live Xid source: {nv_text}; {tail}{note}",
            "since": since,
        }

    def _finish(self, ctx: Context, client: EngineClient, t0: float) -> RunResult:
        pre: LaunchStatus | None = None
        with contextlib.suppress(Exception):
            pre = self.launcher.status()
        if ctx.procs is not None:
            ctx.procs.stop()  # the last sample of the tree, before the harness ends it
        for early in ctx.prepared.values():  # started for a check that did not run
            with contextlib.suppress(Exception):
                early.close()
        ctx.prepared.clear()
        grace = STOP_GRACE_UNRESPONSIVE_S if self.unresponsive else STOP_GRACE_S
        # Within --timeout: what is left of it, less a second for the receipt (at least the short grace).
        left = self.run_deadline - time.monotonic() - 1.0
        final = self.launcher.stop(min(grace, max(STOP_GRACE_UNRESPONSIVE_S, left)))
        self._reveal_probes(ctx)
        self.kmsg.stop()
        self.nvml.stop()
        client.close()
        finished = datetime.now(UTC)
        # Faults are read after the engine stopped, so the verdict covers the whole run: a restart, Xid, OOM
        # or death that arrives after the faults check still rejects it.
        faults = self._with_exit_evidence(self._faults(ctx, final, pre), final)
        required = [c.name for c in checks_for(self.req)]
        j = judge(self.results, ctx.target, self.interrupted, Faults(**faults).blocking(ctx.target), required)
        engine, weights = self._engine(ctx)
        d = ctx.describe
        versions = {k: str(v) for k, v in (d.versions.model_dump() if d else {}).items() if v is not None}
        versions.update(harness=__version__, xid_table=table_evidence()["version"])
        predicate = rc.build_predicate(
            request=self.req.request_info(),
            engine=engine,
            backend=ctx.facts.get("backend"),
            layout=ctx.facts.get("layout"),
            checks=self.results,
            faults=faults,
            verdict=j.verdict,
            target=ctx.target,
            gpu=self._gpus(ctx),
            driver=(d.device.driver if d else None) or self.nvml.driver,
            versions=versions,
            started_at=self.started,
            finished_at=finished,
        )
        subjects = rc.subjects(engine, self._identity(), weights)
        # --timeout bounds the append too: a writer lock held elsewhere is waited on only for what is left
        # of the run (a short grace once it is spent); the signed receipt is saved in the run dir first.
        self.store.lock_timeout_s = max(APPEND_GRACE_S, self.run_deadline - time.monotonic())
        record, _ = rc.sign_and_append(
            self.store, self.key.key, predicate, subjects, save_to=self.run_dir / "receipt.dsse.json"
        )
        return RunResult(
            verdict=j.verdict,
            reasons=j.reasons,
            target=ctx.target,
            checks=self.results,
            receipt_id=record.id,
            log_idx=record.log_idx,
            subjects=[{"name": s.name, "digest": s.digest} for s in subjects],
            faults=predicate.faults.model_dump(mode="json"),
            run_dir=str(self.run_dir),
            seconds=time.monotonic() - t0,
            keyid=self.key.key.keyid,
            started_at=self.started.isoformat(),
            finished_at=finished.isoformat(),
        )

    def _reveal_probes(self, ctx: Context) -> None:
        """The prompts' seed, written only now that the engine has stopped (checks/probes.py): into the
        generation check's evidence (or the last check's, when generation did not run)."""
        if not self.results or not ctx.probes.learned:
            return
        record = next((r for r in self.results if r["name"] == "generation"), self.results[-1])
        record["evidence"]["probes"] = _json_safe(ctx.probes.evidence())

    def _identity(self) -> dict[str, Any]:
        try:
            return self.launcher.identity()
        except Exception:
            return {"launcher": self.launcher.kind}

    def _engine(self, ctx: Context) -> tuple[dict[str, Any], str | None]:
        """The engine's identity as the harness knows it: the config it sent (digested here; the engine's own
        account is kept beside it), the code it hashed (local) or the image docker names, and the weights
        file it hashed (local; None when it could not)."""
        d = ctx.describe
        image = self._identity().get("image_id")
        sent = sent_config(ctx)
        # Local: the sandbox's tree digest of the code mounts. Boot's own-tree check of a foreign engine's
        # claim (ctx.facts["code_identity"]) is evidence; where no tree digest exists it names the engine.
        code, scope = self._code(d) if hasattr(self.launcher, "code_subject") else (None, "")
        if code is None:
            code, scope = ctx.facts.get("code_identity") or self._code(d)
        if code is None and image is None:  # nothing else identifies it: the code on disk, and say so
            code = rc.engine_code_digest_on_disk()
            scope = "the harness's digest of the engine code on disk; the engine never identified itself"
        weights = ctx.facts.get("weights_file") or {}
        handed = getattr(self.launcher, "weights", None)
        return {
            "name": d.engine.name if d else "qualify-engine",
            "version": d.engine.version if d else None,
            "image_digest": image,
            "code_digest": code,
            "code_scope": scope,
            "config_digest": config_digest(sent),
            "config": sent,
            "described_config": _json_safe(d.config) if d else None,
            "sandbox": self._sandbox(),
            **_launch_record(ctx),
        }, weights.get("digest") or (handed.digest if handed is not None else None)

    def _sandbox(self) -> dict[str, Any] | None:
        """The launcher's account of where the engine ran (EngineInfo.sandbox)."""
        info = getattr(self.launcher, "sandbox_info", None)
        if info is not None:
            with contextlib.suppress(Exception):
                self._sandbox_info = _json_safe(info())
        return self._sandbox_info

    def _start_code_subject(self) -> None:
        """The local code subject (a stat of every file the engine can import, tens of thousands on a GPU
        host, and bytecode for any source changed since) on a thread of its own from the run's start, beside
        the manifest, the seeding and the engine's boot instead of before them: a progress record written
        before it is done names no engine (a run recovered from then names the code on disk, as one killed
        before its first progress record does), and the receipt waits for it."""
        code = getattr(self.launcher, "code_subject", None)
        if self.launcher.kind != "local" or code is None or self._code_subject is not None:
            return

        def work() -> None:
            try:
                self._code_subject = code()
            except BaseException as exc:  # noqa: BLE001 - raised where the subject is needed
                self._code_error = exc

        self._code_thread = threading.Thread(target=work, name="code-subject", daemon=True)
        self._code_thread.start()

    def _code_ready(self) -> bool:
        return self._code_thread is None or not self._code_thread.is_alive()

    def _code(self, d: Any) -> tuple[str | None, str]:
        """Local: the harness's tree digest of every file the engine can import in its sandbox (the
        interpreter, the installed distributions, the engine's packages and, for QUALIFY_ENGINE_MODULE, the
        module's whole package), computed once per run; docker: the engine's own report (the image digest
        is the identity there)."""
        code = getattr(self.launcher, "code_subject", None)
        if self.launcher.kind == "local" and code is not None:
            if self._code_thread is not None:
                self._code_thread.join()
                self._code_thread = None
                if self._code_error is not None:
                    raise self._code_error
            if self._code_subject is None:
                self._code_subject = code()
            return self._code_subject
        if self.launcher.kind != "local":
            own = rc.bare_hex(d.engine.code_digest) if d else None
            return (
                f"sha256:{own}" if own else None
            ), "the engine's own report; the image digest identifies it"
        base = rc.engine_code_digest_on_disk()
        scope = "qualify/engine, qualify/protocol.py and kernels, hashed by the harness"
        module = getattr(self.launcher, "module", DEFAULT_ENGINE_MODULE)
        if module == DEFAULT_ENGINE_MODULE:
            return base, scope
        digest, where = rc.module_source_digest(module)
        if digest is None:
            return base, f"{scope}; NOT the engine module actually run: {where}"
        combined = hashlib.sha256(f"{base}\0{module}\0{digest}".encode()).hexdigest()
        return f"sha256:{combined}", f"{scope}, plus {where}: {digest}"

    def _faults(self, ctx: Context, final: LaunchStatus, pre: LaunchStatus | None) -> dict[str, Any]:
        """Read after the engine stopped, so it covers the whole run: a restart, Xid, OOM or death after the
        faults check, or an engine that exited on its own (or not by its stop signal) is here too."""
        events = self._xid_events()
        w = self._xid_watch()
        cuda_oom = int(ctx.facts.get("cuda_oom", 0))
        # Dead when the faults check found it not answering, or the launcher saw it gone before the stop.
        dead = bool(ctx.facts.get("engine_dead")) or not (pre.alive if pre is not None else False)
        # Workers re-forked under the launched process (seen in /proc) are restarts the launcher cannot see.
        hidden = len(ctx.procs.restarts()) if ctx.procs is not None else 0
        return {
            "restart_count": max(final.restart_count, pre.restart_count if pre else 0) + hidden,
            "xid_events": [
                {
                    "code": e.code,
                    "fatal": e.fatal,
                    "source": e.source,
                    "line": e.line or e.message or None,
                    "time": e.seen_at,
                }
                for e in events
            ],
            "xid_watch": w["state"],
            "xid_watch_reason": w.get("reason"),
            "xid_watch_lost_at": w.get("since"),
            "oom": {
                "container": bool(final.oom_killed or (pre.oom_killed if pre else False)),
                "cuda_oom_count": cuda_oom,
            },
            "engine_dead": dead,
            "stop_exit_code": final.exit_code if pre is not None and pre.alive else None,
        }

    def _with_exit_evidence(self, faults: dict[str, Any], final: LaunchStatus) -> dict[str, Any]:
        """Adds how each engine ended (`engine_exits`) and, for a SIGKILL, whether the kernel's OOM killer
        sent it (`oom.kernel`: observed only from the kernel's own record, since a person's kill -9 and an
        OOM kill exit alike). Both are optional fields of the receipt's Faults."""
        codes = [int(c) for c in final.detail.get("exit_codes", [])]
        pids = [int(p) for p in final.detail.get("pids", [])]
        kernel = kernel_oom(codes, pids, self.kmsg.oom_kills(), self.cgroup_oom_before, cgroup_oom_kills())
        if kernel is not None and self.launcher.kind == "docker" and final.oom_killed:
            kernel = "observed"  # the daemon's OOMKilled / `oom` event is the kernel's record for its cgroup
        faults["oom"]["kernel"] = kernel
        faults["engine_exits"] = [describe_exit(c) for c in codes]
        if self.req.dcp is not None:
            # A DCP engine whose follower rank died exits naming it (qualify/engine/dcp.py): whatever check
            # was running then, the receipt says which rank was lost.
            lost = dcp_ranks_lost(self.launcher.logs_tail(LOG_LINES))
            faults["engine_exits"] += [f"lost DCP {rank}" for rank in lost]
        return faults

    def _gpus(self, ctx: Context) -> list[dict[str, Any]]:
        if self.nvml.devices:
            return [{"name": g["name"], "index": g["index"]} for g in self.nvml.devices]
        d = ctx.describe
        if d is not None and d.device.type == "cuda":
            mem = d.device.total_memory
            return [
                {
                    "name": d.device.name,
                    "compute_capability": d.device.compute_capability,
                    "memory_mib": mem // (1 << 20) if mem else None,
                }
            ]
        return []
