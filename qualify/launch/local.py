"""Local launcher: the engine as a supervised subprocess with an on-failure restart policy.

The engine's address comes from its ready line; after the first boot its port is pinned, so a restarted
engine answers at the same URL. Logs of every incarnation go to one file in the run directory. Every engine
holds the read end of a pipe only this harness writes to: it exits when the harness dies, even by SIGKILL.
After each exit the supervisor sweeps the shared-memory files a crashed engine could not release.

Every engine process runs in the launcher's Sandbox (qualify/launch/sandbox.py: bubblewrap) unless the
operator asked for none (--no-sandbox); the launcher tracks the engine's host pid, not bwrap's. Before the
first boot the harness seeds the configuration's weights once (the reference engine, sandboxed), keeps and
hashes the file in its cache, and every engine gets exactly that file, read-only (`--weights`). On a GPU
target the reference engine's warm step compiles its kernels beside the first boot; every later engine
process gets a copy of the Triton cache it left (launch/kernels.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from qualify.launch.base import (
    DEFAULT_MAX_RESTARTS,
    EXIT_REFUSED,
    FAULT_ENV,
    HARNESS_FD_ENV,
    MAX_PEER_REPORT_BYTES,
    PEER_FILE,
    READY_RE,
    EngineOptions,
    Launcher,
    LaunchStatus,
    PeerOutcome,
    RefusalOutcome,
    describe_exit,
    harness_alive,
    harness_identity,
)
from qualify.launch.kernels import (
    CACHE_SUBDIR,
    EXIT_NO_ROOM,
    WARM_MEMORY_FACTOR,
    WARM_STEP_TIMEOUT_S,
    KernelCache,
    precompile_jobs,
)
from qualify.launch.monitor import EngineMonitor, monitor_command, monitor_enabled
from qualify.launch.sandbox import (
    SANDBOX_GID,
    SANDBOX_UID,
    SCRATCH,
    DigestCache,
    Sandbox,
    cache_dir,
    engine_pid,
    ns_pids,
    read_info,
    tree_digest,
)
from qualify.netns import Netns, NetnsError
from qualify.shm import sweep_stale_shm

STOP_GRACE_S = 5.0
# The module run as the engine (`python -m MODULE serve ...`); the reference engine by default. Another
# module that serves the same protocol (a wrapper, a patched build) is qualified the same way; the receipt's
# launcher identity names it.
ENGINE_MODULE_ENV = "QUALIFY_ENGINE_MODULE"
DEFAULT_ENGINE_MODULE = "qualify.engine"
WEIGHTS_STEP_TIMEOUT_S = 600.0  # seeding the proxy's 2.9 GB on a GPU takes tens of seconds
# An engine started beside the seeding of its weights waits this long for the file at most (the launch
# document's weights.wait_s); the harness stops it sooner where the seeding fails.
WEIGHTS_WAIT_S = WEIGHTS_STEP_TIMEOUT_S
# Where the seeding step refused the configuration while the engine under test was already starting: how
# long the harness waits for that engine's own answer (a refusal at construction) before stopping it.
REFUSAL_ANSWER_WAIT_S = 60.0
HANDOFF_PREFIX = "handoff-"  # a launcher's folder in the weights cache: the file, linked in once kept
HANDOFF_OWNER = ".owner.json"  # beside each such folder (not in it): the harness that made it
REFERENCE_ENGINE = Path(__file__).resolve().parents[1] / "engine"
REFERENCE_KERNELS = Path(__file__).resolve().parents[2] / "kernels"


@dataclass(frozen=True)
class HandedWeights:
    """The weights file the harness hashed and hands the engine read-only: the weights subject."""

    path: Path  # the harness's copy (its cache)
    digest: str
    bytes: int
    engine_path: str  # where the engine sees it (and is told to load it from: --weights)
    origin: str  # how the harness got it

    def evidence(self) -> dict[str, object]:
        return {
            "hashed": True,
            "path": str(self.path),
            "engine_path": self.engine_path,
            "digest": self.digest,
            "bytes": self.bytes,
            "origin": self.origin,
        }


COPY_BLOCK = 1 << 24
MAX_HEADER_BYTES = 64 << 20  # a safetensors header (names, shapes, offsets): far below this
MAX_WEIGHTS_BYTES = 1 << 40  # what the harness takes from a seeding step at most
PIPE_BYTES = 1 << 20  # the stream's pipe: Linux's default ceiling for an unprivileged F_SETPIPE_SZ


def _read_exact(src: IO[bytes], n: int) -> bytes:
    data = src.read(n)
    if data is None or len(data) != n:
        raise ValueError(f"the weights stream ended after {0 if data is None else len(data)} of {n} bytes")
    return data


def receive_weights(src: IO[bytes], tmp: Path, times: dict[str, float] | None = None) -> tuple[str, int]:
    """Keep the safetensors file a seeding step streams (`src`: the read end of its pipe) as `tmp`, hashing
    it as it is written: a file of the harness's own, never one the step wrote (so nothing the step runs
    can change it afterwards), hashed once. Exactly the length its header declares (8-byte length, JSON
    header, data to the largest end offset), then the end of the stream; a short, malformed or overlong
    stream raises ValueError. The next block is read while this one is hashed (hashlib releases the GIL)
    and written. (sha256 hex, bytes); `times`, where given, gets the seconds the stream's data spent in
    each stage (_write_hashing's)."""
    head = _read_exact(src, 8)
    n = int.from_bytes(head, "little")
    if not 0 < n <= MAX_HEADER_BYTES:
        raise ValueError(f"the weights stream's header is {n} bytes long")
    text = _read_exact(src, n)
    try:
        header = json.loads(text)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"the weights stream's header is not a safetensors header: {exc}") from exc
    if not all(isinstance(e, int) and 0 <= e <= MAX_WEIGHTS_BYTES for e in ends):
        raise ValueError("the weights stream's header names offsets out of bounds")
    h = hashlib.sha256(head)
    h.update(text)

    def blocks() -> Iterator[bytes]:
        left = max(ends, default=0)
        while left:
            block = _read_exact(src, min(COPY_BLOCK, left))
            left -= len(block)
            yield block

    with open(tmp, "xb") as dst:
        dst.write(head)
        dst.write(text)
        _write_hashing(blocks(), dst, h, times)
    if src.read(1):
        raise ValueError("the weights stream went on past the end its header declares")
    return h.hexdigest(), 8 + n + max(ends, default=0)


def keep_seeded(made: Path, cached: Path) -> str:
    """Copy the file a seeding step wrote into the harness's cache, read-only: a file of the harness's own,
    not the one the step (the engine's code) wrote and could still change. The bytes are hashed as they
    are copied (a second thread hashes block k while block k is written), and the digest is what the
    harness wrote, so it goes into the digest cache under the copy's own stat: no second read. Returns
    the sha256 hex."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    h = hashlib.sha256()
    with open(made, "rb") as src, open(tmp, "wb") as dst:
        _write_hashing(iter(lambda: src.read(COPY_BLOCK), b""), dst, h)
    keep_weights(tmp, cached, h.hexdigest())
    return h.hexdigest()


def _timed(fn: Any, spent: list[float]) -> Any:
    def call(arg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(arg)
        finally:
            spent[0] += time.perf_counter() - t0

    return call


def _write_hashing(
    blocks: Iterable[bytes], dst: IO[bytes], h: Any, times: dict[str, float] | None = None
) -> None:
    """Write each block to `dst` and hash it into `h`, the two side by side on two threads while the next
    block is read (hashlib and file writes release the GIL): a block's hash and write run in order, one
    block at a time, so the digest is of the bytes in order and the file is written in order. (On H100
    hosts, 2026-12-05, the seeding's stream ran at 0.7-0.8 GB/s both before this, when the write came
    between the reads, and after. One core's sha256 may be that limit: this 2-core machine's, with SHA
    instructions, hashes 0.9 GB/s.) `times`, where given, gets the seconds spent waiting for blocks
    (`read`), hashing (`hash`) and writing (`write`): whichever is near the whole is the limit."""
    read, hashed, wrote = [0.0], [0.0], [0.0]
    update, write = _timed(h.update, hashed), _timed(dst.write, wrote)
    it = iter(blocks)
    with ThreadPoolExecutor(2, "weights-hash-write") as pool:
        pending: list[Any] = []
        while True:
            t0 = time.perf_counter()
            block = next(it, None)
            read[0] += time.perf_counter() - t0
            if block is None:
                break
            for f in pending:  # the previous block is hashed and written before this one starts
                f.result()
            pending = [pool.submit(update, block), pool.submit(write, block)]
        for f in pending:
            f.result()
    if times is not None:
        times.update(read=round(read[0], 3), hash=round(hashed[0], 3), write=round(wrote[0], 3))


def keep_weights(tmp: Path, cached: Path, digest: str) -> None:
    """The received file into the harness's cache, read-only, its digest recorded under its own stat (the
    harness hashed what it wrote: nothing reads it again)."""
    os.chmod(tmp, 0o444)
    os.replace(tmp, cached)
    digests = DigestCache(cache_dir() / "weights-digests.json")
    digests.store(str(cached), cached.stat(), digest)
    digests.save()


def hand_over(cached: Path, engine_path: str, origin: str) -> HandedWeights:
    """The harness's cached seeded weights, hashed (through its digest cache), as the engine will see them."""
    digests = DigestCache(cache_dir() / "weights-digests.json")
    digest = "sha256:" + digests.digest(cached, cached.stat())
    digests.save()
    return HandedWeights(cached, digest, cached.stat().st_size, engine_path, origin)


def _owner_file(handoff: Path) -> Path:
    return handoff.with_name(handoff.name + HANDOFF_OWNER)


def remove_handoff(handoff: Path) -> None:
    """A hand-off folder (the link into it: the cache keeps the file) and its owner file."""
    shutil.rmtree(handoff, ignore_errors=True)
    _owner_file(handoff).unlink(missing_ok=True)


def sweep_handoffs(folder: Path) -> None:
    """Remove the hand-off folders (handoff_dir) of harnesses that are gone (a killed run): their owner files'
    harness identity (launch/base.py: pid, start time and boot, so a reused pid is not taken for its owner)
    says so; a folder made on another host is left to that host."""
    for owner in folder.glob(f"{HANDOFF_PREFIX}*{HANDOFF_OWNER}"):
        try:
            ident = json.loads(owner.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(ident, dict) and harness_alive(ident) is False:
            remove_handoff(owner.with_name(owner.name.removesuffix(HANDOFF_OWNER)))


def handoff_dir(cached: Path) -> Path:
    """A new, empty folder beside the weights cache file (the same file system: the kept file is linked in,
    not copied) that the engine's sandbox binds read-only where its weights file will be, before the file
    exists. Its owner file (written first, beside it: nothing the engine sees) names this harness."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    made = cached.parent / f"{HANDOFF_PREFIX}{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    _owner_file(made).write_text(json.dumps(harness_identity()))
    made.mkdir(mode=0o755)
    return made


@dataclass
class _Seeding:
    """A seeding step running beside the engine's start (LocalLauncher.begin_weights), of the planned file."""

    thread: threading.Thread
    handoff: Path | None  # the sandbox's weights folder (None unsandboxed: the engine reads the cache file)
    result: dict[str, Any]


class LocalLauncher(Launcher):
    kind = "local"
    # How long this launcher's engine may be asked to wait for a handed weights file (begin_weights): the
    # launch document's weights.wait_s where the harness seeds the reference engine's weights.
    weights_wait_s = WEIGHTS_WAIT_S

    def __init__(
        self,
        options: EngineOptions,
        run_dir: Path,
        *,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        sandbox: Sandbox | None = None,
        weights: HandedWeights | None = None,
    ) -> None:
        """`sandbox`: where every engine process of this launcher runs (None: unsandboxed, as the
        operator's own process: `qualify run --no-sandbox`). `weights`: a file already handed over (a
        reference engine shares its parent's); else the harness seeds one at start."""
        self.options = options
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.sandbox = sandbox
        self.weights = weights
        # False: this engine writes its own weights (a foreign engine, its launch document's create true)
        self.hand_weights = True
        # Where preparing the weights went (seconds): the sandboxed seeding step (the harness receiving and
        # hashing its stream beside it), keeping the received file.
        self.weights_phases: dict[str, float] = {}
        # The harness's cache file the weights will be kept as, named before they are seeded (plan_weights):
        # the launch document names it, and the warm step starts before the file exists.
        self._planned: tuple[Path, str, list[str]] | None = None
        self._seeding: _Seeding | None = None  # a seeding step running beside the engine's start
        # Called (on a thread of its own) once the engine's first process exists: boot's Context.
        # engine_spawned, work that needs only the engine's namespaces (the layout check's peers ahead)
        self.on_spawn: Callable[[], None] | None = None
        self._steps: set[subprocess.Popen[Any]] = set()  # the reference engine's steps running now
        # The compiled kernels every engine process gets a copy of (launch/kernels.py); a reference engine
        # shares its parent's (and waits for its warm step), the first launcher starts one.
        self.kernels: KernelCache | None = None
        self.kernels_name = "engine"
        self._kernels_wait = False
        self.log_path = run_dir / "engine.log"
        self.scratch = run_dir / "scratch"
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stopping = False
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._port: int | None = None
        self._pid: int | None = None  # the engine's host pid (inside the sandbox: bwrap's child's child)
        self._sandbox_pid: int | None = None  # bwrap's own pid, the process the harness started
        self._ns_pid: list[int] | None = None
        self._netns: Netns | None = None  # the engine's own network namespace (its sandbox's), held open
        self._exit_code: int | None = None
        self._exit_codes: list[int] = []
        self._pids: list[int] = []
        self._restarts = 0
        self._boots = 0
        self._refused = False
        self._swept: list[str] = []
        # Non-inheritable by default: only the engines get the read end (pass_fds), nobody the write end.
        self._watch_r, self._watch_w = os.pipe()
        # Peers started ahead of time (prepare_peers), each waiting for its spec on stdin: (process, log).
        self._spare_peers: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._spares_started = 0
        # The harness's CUDA activity monitor, started inside every boot of the engine (launch/monitor.py).
        self.monitor = EngineMonitor(run_dir, enabled=monitor_enabled(self.env))

    # ------------------------------------------------------------ commands
    @property
    def module(self) -> str:
        return self.env.get(ENGINE_MODULE_ENV) or DEFAULT_ENGINE_MODULE

    def command(self, port: int, kda_backend: str | None = None) -> list[str]:
        """The engine's own argv (inside the sandbox when there is one)."""
        launch = self._launch_file(kda_backend)
        handed = self.weights is not None and launch is None  # a launch document names the file itself
        weights = ["--weights", self.weights.engine_path] if handed and self.weights is not None else []
        args = [*self.options.serve_args(kda_backend, launch), *weights, "--port", str(port)]
        if self.monitor.enabled and kda_backend is None:  # the refusal probe's engine is not monitored
            return monitor_command(self.python, self.module, args)
        return [self.python, "-m", self.module, *args]

    def _popen(
        self, argv: list[str], scratch: Path, env: dict[str, str], **kw: object
    ) -> tuple[subprocess.Popen[str], int | None]:
        """Start `argv` in this launcher's sandbox (or bare, unsandboxed): the process and, in a sandbox,
        the engine's host pid (bwrap's --info-fd names the sandbox's pid 1; the engine is its child)."""
        fds = tuple(kw.pop("pass_fds", ()))  # type: ignore[arg-type]
        if self.sandbox is None:
            proc = subprocess.Popen(argv, env=env, pass_fds=fds, **kw)  # type: ignore[call-overload]
            return proc, proc.pid
        self.sandbox.prepare_scratch(scratch)
        info_r, info_w = os.pipe()
        try:
            weights = self.weights.path if self.weights is not None else None
            seeding = self._seeding
            # Before the seeded file is kept, the engine gets the (empty) folder it will be linked into.
            folder = seeding.handoff if weights is None and seeding is not None else None
            cmd = self.sandbox.command(
                argv, scratch, env, weights=weights, weights_folder=folder, info_fd=info_w
            )
            proc = subprocess.Popen(  # type: ignore[call-overload]
                cmd, env=self.sandbox.bwrap.exec_env(), pass_fds=(*fds, info_w), **kw
            )
        finally:
            os.close(info_w)
        try:
            info = read_info(info_r)
        finally:
            os.close(info_r)
        init = info.get("child-pid") if isinstance(info, dict) else None
        return proc, engine_pid(int(init)) if isinstance(init, int) else None

    def _env_for(self, env: dict[str, str]) -> dict[str, str]:
        """What the engine's environment holds: in a sandbox only what Sandbox.engine_env lets through."""
        full = self._engine_env(env)
        if self.sandbox is None:
            return full
        return self.sandbox.engine_env(env, {HARNESS_FD_ENV: full[HARNESS_FD_ENV]})

    def engine_environment(self) -> dict[str, str]:
        """The engine's environment as the receipt records it (the pipe's fd number aside)."""
        env = self._env_for(self.env)
        env.pop(HARNESS_FD_ENV, None)
        return env

    # ------------------------------------------------------------ weights
    def plan_weights(self, dtype: str | None = None) -> str:
        """The path the engine will see the handed weights at (the harness's cache file of this
        configuration's seeded weights, whether or not it exists yet): what the launch document names."""
        if self.weights is not None:
            return self.weights.engine_path
        code, _ = tree_digest([str(REFERENCE_ENGINE), str(REFERENCE_KERNELS)])
        serve = self.options.serve_args(kda_backend="auto")  # the backend changes no weight
        if dtype is not None:  # the launch document's: weights of another dtype would be refused
            serve += ["--dtype", dtype]
        key_src = json.dumps([serve, code, self.sandbox.gpu if self.sandbox else None])
        key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
        cached = cache_dir() / "weights" / f"seeded-{self.options.preset}-{key}.safetensors"
        engine_path = Sandbox.weights_path(cached) if self.sandbox is not None else str(cached)
        self._planned = (cached, engine_path, serve)
        return engine_path

    def prepare_weights(
        self, timeout_s: float = WEIGHTS_STEP_TIMEOUT_S, dtype: str | None = None
    ) -> HandedWeights | None:
        """The seeded weights of this configuration in the harness's cache (written once, by the reference
        engine in a sandboxed first step that streams them to the harness), hashed by the harness: the file
        every engine of this run loads. None when the reference engine refuses the configuration itself
        (the engine under test will be asked, and its refusal is the answer; without a handed file the
        boot check fails closed)."""
        if self.weights is not None:
            return self.weights
        if self._planned is None:
            self.plan_weights(dtype)
        assert self._planned is not None
        cached, _, serve = self._planned
        if not cached.is_file() and not self._seed(cached, serve, timeout_s):
            return None
        return self._hand_planned()

    def _hand_planned(self) -> HandedWeights:
        """The planned cache file, seeded and kept, handed over (its digest through the digest cache)."""
        assert self._planned is not None
        cached, engine_path, _ = self._planned
        origin = f"seeded by the reference engine (python -m {DEFAULT_ENGINE_MODULE} weights), cached"
        self.weights = hand_over(cached, engine_path, origin)
        return self.weights

    def begin_weights(self, timeout_s: float = WEIGHTS_STEP_TIMEOUT_S, dtype: str | None = None) -> None:
        """prepare_weights without waiting for a seeding: a cached file is handed over at once; otherwise the
        seeding step runs on a thread of its own, start() starts the engine beside it (the launch document's
        weights.wait_s has the engine wait for the file, which appears whole: renamed into the cache, then
        linked into the sandbox's folder), and start() takes the step's outcome (_join_seeding). The engine
        imports, reaches its device and lays out its caches while the harness receives and hashes."""
        if self.weights is not None or self._seeding is not None:
            return
        if self._planned is None:
            self.plan_weights(dtype)
        assert self._planned is not None
        cached, _, serve = self._planned
        sweep_handoffs(cached.parent)
        if cached.is_file() or self._document_wait_s() <= 0:  # cached, or the engine is not told to wait
            self.prepare_weights(timeout_s, dtype)
            return
        handoff = handoff_dir(cached) if self.sandbox is not None else None
        result: dict[str, Any] = {}

        def seed() -> None:
            try:
                result["seeded"] = self._seed(cached, serve, timeout_s)
                if result["seeded"] and handoff is not None:
                    os.link(cached, handoff / cached.name)
            except BaseException as exc:  # noqa: BLE001 - start() turns it into the boot's reason
                result["error"] = exc

        thread = threading.Thread(target=seed, name="weights-seed", daemon=True)
        self._seeding = _Seeding(thread, handoff, result)
        thread.start()

    def _document_wait_s(self) -> float:
        """How long the launch document tells the engine to wait for its weights file (0: no document)."""
        if self.options.launch is None:
            return 0.0
        weights = json.loads(self.options.launch).get("weights") or {}
        return float(weights.get("wait_s") or 0.0)

    def _join_seeding(self, deadline: float) -> None:
        """Wait (to the deadline) for the seeding begun beside the engine's start, and hand its file over.
        A failed seeding stops the engine and raises RuntimeError (TimeoutError past the deadline). Where
        the reference engine refused the configuration, the engine under test's own answer is awaited
        (bounded): a refusal at construction is left to start() to report, as without a seeding beside."""
        seeding = self._seeding
        assert seeding is not None
        t0 = time.monotonic()
        seeding.thread.join(max(0.0, deadline - t0))
        self.weights_phases["start_waited_for_seeding"] = round(time.monotonic() - t0, 3)
        if seeding.thread.is_alive():
            self._halt()
            raise TimeoutError(f"the engine's weights were not seeded in time; see {self.run_dir}")
        error = seeding.result.get("error")
        if error is not None:
            self._halt()
            why = str(error) if isinstance(error, RuntimeError) else f"the harness could not seed: {error!r}"
            raise RuntimeError(why)
        if not seeding.result.get("seeded"):
            self._done.wait(max(0.0, min(REFUSAL_ANSWER_WAIT_S, deadline - time.monotonic())))
            if not self._refused:
                self._halt()
                log = self.run_dir / "weights-step.log"
                said = _last_line(log.read_text(errors="replace")) if log.is_file() else "(no log)"
                raise RuntimeError(
                    "the reference engine refused this configuration when seeding its weights, and the "
                    f"engine under test did not refuse it at construction: it has no weights to load: {said}"
                )
            return
        self._hand_planned()

    def _halt(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the engine (and its supervisor's restarts) for good: the first part of stop(), which does
        the rest (a failed seeding halts the engine at once and leaves the rest to the run's stop)."""
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _terminate(proc, grace_s, self._pid if self.sandbox is not None else None)

    def _seed(self, cached: Path, serve: list[str], timeout_s: float) -> bool:
        """The reference engine's `weights` verb in the sandbox, streaming the file through a pipe the
        harness reads as it comes (receive_weights): the harness's copy is written and hashed while the
        step generates, and kept once the step exits 0 with the whole file sent."""
        scratch = self.run_dir / "weights-step"
        scratch.mkdir(parents=True, exist_ok=True)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.unlink(missing_ok=True)
        read_fd, write_fd = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        argv = [self.python, "-m", DEFAULT_ENGINE_MODULE, "weights", *serve[1:], "--out-fd", str(write_fd)]
        env = {k: v for k, v in self.env.items() if k not in (FAULT_ENV, ENGINE_MODULE_ENV)}
        if self.sandbox is None:
            env["QUALIFY_HOME"] = str(scratch / "home")
            sub_env = env
        else:
            # The reference engine's own `weights` verb, with the sandbox's code path: on a host that runs
            # the checkout in place (a GPU host), that path is what holds qualify and its wheels.
            sub_env = self.sandbox.engine_env(env)
        got: dict[str, Any] = {}
        stream: dict[str, float] = {}

        def receive() -> None:
            try:
                with open(read_fd, "rb", buffering=COPY_BLOCK) as src:
                    got["kept"] = receive_weights(src, tmp, stream)
            except BaseException as exc:  # noqa: BLE001 - the step's outcome says what it means
                got["error"] = exc

        reader = threading.Thread(target=receive, name="weights-receive", daemon=True)
        reader.start()
        t0 = time.monotonic()
        log = self.run_dir / "weights-step.log"
        try:
            rc = self._run_step(argv, scratch, sub_env, log, timeout_s, hand=(write_fd,))
            self.weights_phases["seeding_step"] = round(time.monotonic() - t0, 3)
            t0 = time.monotonic()
            reader.join(30.0)  # the step is gone: its end of the pipe is closed
            kept = got.get("kept") if not reader.is_alive() else None
            if rc == EXIT_REFUSED:
                return False
            if rc != 0 or kept is None:
                tail = _last_line(log.read_text(errors="replace"))
                why = describe_exit(rc) or "timed out"
                if rc == 0:
                    why = f"its stream was not kept: {got.get('error') or 'still being read'}"
                raise RuntimeError(f"the harness could not seed the engine's weights ({why}): {tail}")
            keep_weights(tmp, cached, kept[0])
            self.weights_phases["kept_after_step"] = round(time.monotonic() - t0, 3)
            # where the stream's time went on the harness's side: waiting on the step, hashing, writing
            self.weights_phases.update({f"stream_{k}": v for k, v in stream.items()})
            return True
        finally:
            tmp.unlink(missing_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------ kernels
    def prepare_kernels(self) -> KernelCache:
        """The run's kernel cache (launch/kernels.py): found in the harness's cache, or filled by the
        reference engine's warm step, started here in the background (before the weights are seeded: the
        step loads none); none without a GPU sandbox, or for an engine that is handed no weights."""
        if self.kernels is not None:
            return self.kernels
        if self.sandbox is None:
            self.kernels = KernelCache(None, "unsandboxed (--no-sandbox): no kernel cache is given")
        elif not self.sandbox.gpu:
            self.kernels = KernelCache(None, "a cpu target: its engines compile no kernels")
        elif not self.hand_weights or (self.weights is None and self._planned is None):
            self.kernels = KernelCache(
                None, "no handed weights: the engine is not the reference engine's kind"
            )
        else:
            self.kernels = self._kernel_cache()
        return self.kernels

    def _kernel_cache(self) -> KernelCache:
        from importlib import metadata

        code, _ = tree_digest([str(REFERENCE_ENGINE), str(REFERENCE_KERNELS)])
        versions = {}
        for dist in ("torch", "triton"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[dist] = metadata.version(dist)
        # The launch document names the weights file (its name keys the configuration and the reference
        # code); their values are never read by the step (it records shapes), so their digest is no key.
        launch = self.options.launch_text() if self.options.launch is not None else None
        key_src = json.dumps([self.options.serve_args(), launch, code, versions])
        key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
        kernels = KernelCache(cache_dir() / "kernels" / f"{self.options.preset}-{key}")
        facts = {"reference_code": code, "versions": versions}
        # where the running step compiles: an engine that starts meanwhile gets what it finished so far
        kernels.live = self.run_dir / "warm-step" / "home" / CACHE_SUBDIR
        kernels.start(lambda: self._warm_step(facts), cleanup=self._warm_cleanup)
        return kernels

    def _warm_step(self, facts: dict[str, Any]) -> tuple[Path | None, str | None, dict[str, Any]]:
        """`python -m qualify.engine warm --jobs N` (the reference engine, never the module under test) in
        the sandbox, with the launch document the engine under test gets: it records what its work would
        compile and compiles that in N processes (qualify/engine/precompile.py); the cache it left, and
        what it said of its work (the last JSON line of its output: the workers, the specializations, the
        seconds). It applies the room rule itself (exit EXIT_NO_ROOM: its GPU holds no second engine)."""
        assert self.sandbox is not None
        scratch = self.run_dir / "warm-step"
        scratch.mkdir(parents=True, exist_ok=True)
        jobs = precompile_jobs()
        if self.options.launch is not None:
            (scratch / "launch.json").write_text(self.options.launch_text())
            os.chmod(scratch / "launch.json", 0o444)
            args = ["warm", "--launch", f"{SCRATCH}/launch.json"]
        else:
            args = ["warm", *self.options.serve_args()[1:]]
        args += ["--jobs", str(jobs), "--room-factor", str(WARM_MEMORY_FACTOR)]
        argv = [self.python, "-m", DEFAULT_ENGINE_MODULE, *args]
        env = {k: v for k, v in self.env.items() if k not in (FAULT_ENV, ENGINE_MODULE_ENV)}
        log = self.run_dir / "warm-step.log"
        rc = self._run_step(argv, scratch, self.sandbox.engine_env(env), log, WARM_STEP_TIMEOUT_S)
        rc = rc if rc is None else _exit_status(rc, True)
        text = log.read_text(errors="replace") if log.is_file() else ""
        if rc == EXIT_NO_ROOM:
            return None, _last_line(text), {}
        if rc != 0:
            why = describe_exit(rc) or f"timed out after {WARM_STEP_TIMEOUT_S:g} s"
            return None, f"{why}: {_last_line(text)}", {}
        said = _last_json(text)
        # What else the step's process left in its home (other compile caches would show here), in words.
        home = scratch / "home"
        facts = {**facts, "step_home": sorted(
            str(p.relative_to(home)) for p in home.glob("*/*") if not p.is_symlink()
        )[:50], "precompile": said.get("precompile"), "warm": said.get("warm"),
            "step_boot_s": said.get("boot_seconds")}  # fmt: skip
        return home / CACHE_SUBDIR, None, facts

    def _warm_cleanup(self) -> None:
        shutil.rmtree(self.run_dir / "warm-step", ignore_errors=True)

    def _give_kernels(self, scratch: Path) -> None:
        """A fresh copy of the kernel cache into a new engine scratch dir (before its first process)."""
        if self.kernels is None or self.sandbox is None:
            return
        self.sandbox.prepare_scratch(scratch)
        owner = (SANDBOX_UID, SANDBOX_GID) if self.sandbox.root else None
        self.kernels.give(self.kernels_name, scratch / "home", owner)

    def give_kernels_late(self, timeout_s: float) -> dict[str, Any] | None:
        """The engine under test started before the warm step was done (it is not kept from booting for
        it): before its first request, wait (bounded) for the step and copy the cache into its running
        scratch dir (kernels.give_live). None where there is nothing to give late; else the record."""
        cache = self.kernels
        if cache is None or self.sandbox is None or cache.has_given(self.kernels_name):
            return None
        if cache.cached is None:  # no cache this run (a CPU target, no room...): nothing will come
            return None
        t0 = time.monotonic()
        cache.wait(max(0.0, timeout_s))
        waited = round(time.monotonic() - t0, 3)
        owner = (SANDBOX_UID, SANDBOX_GID) if self.sandbox.root else None
        return cache.give_late(self.kernels_name, self.scratch / "home", owner, waited)

    def settle(self, timeout_s: float) -> float:
        """Wait (bounded) for a warm step still running, so that it shares the GPU with no check that times
        the engine; the seconds waited."""
        if self.kernels is None:
            return 0.0
        t0 = time.monotonic()
        self.kernels.wait(timeout_s)
        waited = round(time.monotonic() - t0, 3)
        self.kernels.settled_s = round((self.kernels.settled_s or 0.0) + waited, 3)
        return waited

    def _run_step(
        self,
        argv: list[str],
        scratch: Path,
        env: dict[str, str],
        log_path: Path,
        timeout_s: float,
        hand: tuple[int, ...] = (),
    ) -> int | None:
        """One of the reference engine's steps (seeding the weights, warming the kernels) in this
        launcher's sandbox, its output in `log_path`: its exit code, None when it ran past `timeout_s`.
        The descriptors in `hand` go to the step and are closed here once it has them (whatever happens).
        A step still running when the run is interrupted, or when the launcher stops, is ended."""
        try:
            with log_path.open("w") as log:
                proc, _ = self._popen(
                    argv, scratch, env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, pass_fds=hand,
                )  # fmt: skip
        finally:
            for fd in hand:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with self._lock:
            self._steps.add(proc)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _terminate(proc, 1.0)
            return None
        except BaseException:  # interrupted (a signal in the main thread): the step goes with the run
            _terminate(proc, 1.0)
            raise
        finally:
            with self._lock:
                self._steps.discard(proc)

    def _launch_file(self, kda_backend: str | None = None) -> str | None:
        """Write the launch document (the refusal probe's beside it) into the run dir, and in a sandbox into
        the scratch dir too (the one folder of the host the engine sees); the path the engine reads."""
        if self.options.launch is None:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = "launch.json" if kda_backend is None else "launch-refusal.json"
        text = self.options.launch_text(kda_backend)
        (self.run_dir / name).write_text(text)
        if self.sandbox is None:
            return str(self.run_dir / name)
        scratch = self.scratch if kda_backend is None else self.run_dir / "refusal-scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)
        os.chmod(scratch / name, 0o444)
        return f"{SCRATCH}/{name}"

    def launch_paths(self, weights_name: str) -> tuple[str, str]:
        """The handed weights where the engine sees them (planned or seeded: boot's prepare_launch),
        else a file the engine writes: in a sandbox under its scratch dir, unsandboxed in the data dir."""
        from qualify import settings

        scratch = SCRATCH if self.sandbox is not None else str(self.scratch)
        if self.weights is not None:
            return self.weights.engine_path, scratch
        if self._planned is not None and self.hand_weights:  # planned, seeded after the document is built
            return self._planned[1], scratch
        if self.sandbox is not None:
            return f"{SCRATCH}/weights/{weights_name}", scratch
        return str(settings.data_dir() / "weights" / weights_name), scratch

    def host_path(self, engine_path: str) -> Path:
        """A path the engine names, as the harness sees it (its scratch dir is the sandbox's SCRATCH)."""
        if self.sandbox is not None and (engine_path == SCRATCH or engine_path.startswith(SCRATCH + "/")):
            return self.scratch / engine_path[len(SCRATCH) :].lstrip("/")
        return Path(engine_path)

    def manifest(self, timeout_s: float) -> tuple[bytes | None, str, str | None]:
        """`python -m MODULE manifest`, in this launcher's sandbox like every engine process."""
        argv = [self.python, "-m", self.module, "manifest"]
        env = {k: v for k, v in self.env.items() if k != FAULT_ENV}
        sub_env = env if self.sandbox is None else self.sandbox.engine_env(env)
        scratch = self.run_dir / "manifest-scratch"
        text = " ".join(argv[1:])
        try:
            proc, _ = self._popen(
                argv, scratch, sub_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            return None, text, f"`{text}` could not run: {exc}"
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _terminate(proc, 1.0)
            proc.communicate()
            return None, text, f"`{text}` did not finish within {timeout_s:g} s"
        finally:
            if self.sandbox is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        rc = _exit_status(proc.returncode, self.sandbox is not None)
        if rc != 0:
            why = _last_line(err.decode(errors="replace") or out.decode(errors="replace"))
            return None, text, f"`{text}` exited with code {rc}: {why}"
        return out, text, None

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        if self.hand_weights and self._seeding is None:
            self.prepare_weights(timeout_s)
        self.prepare_kernels()
        if self._kernels_wait and self.kernels is not None:  # a reference engine: the warm step's cache
            self.kernels.wait(max(0.0, min(WARM_STEP_TIMEOUT_S, timeout_s - (time.monotonic() - t0)) / 2))
        timeout_s = max(0.0, timeout_s - (time.monotonic() - t0))
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        if self._seeding is not None and self.weights is None:
            self._join_seeding(deadline)  # the engine starts beside the seeding of its weights
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                assert self._url is not None
                return self._url
            if self._done.is_set():
                if self._refused:
                    raise RuntimeError(
                        f"the engine refused its configuration at construction (exit {EXIT_REFUSED}, "
                        f"not restarted): {_last_line(self.logs_tail(5))}"
                    )
                raise RuntimeError(
                    f"the engine {describe_exit(self._exit_code)} before it was ready "
                    f"({self._restarts} restarts); see {self.log_path}"
                )
        raise TimeoutError(f"the engine was not ready within {timeout_s:g} s; see {self.log_path}")

    def _supervise(self) -> None:
        with self.log_path.open("a", buffering=1) as log:
            while True:
                port = self._port or 0
                cmd = self.command(port)
                log.write(f"# qualify: boot {self._boots + 1}: {' '.join(cmd)}\n")
                with self._lock:
                    if self._stopping:
                        break
                    if self._boots == 0:
                        self._give_kernels(self.scratch)
                    mon_env, mon_fds = self.monitor.local_boot()
                    # Own session: a terminal's Ctrl-C reaches the harness, which stops the engine itself.
                    self._proc, pid = self._popen(
                        cmd,
                        self.scratch,
                        {**self._env_for(self.env), **mon_env},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        bufsize=1,
                        start_new_session=True,
                        pass_fds=(self._watch_r, *mon_fds),
                    )
                    self.monitor.after_spawn()
                    self._boots += 1
                    self._sandbox_pid = self._proc.pid if self.sandbox is not None else None
                    self._pid = pid if pid is not None else self._proc.pid
                    self._ns_pid = ns_pids(self._pid) if self.sandbox is not None else None
                    self._hold_netns(pid)
                    self._pids.append(self._pid)
                    where = f" in bwrap pid {self._sandbox_pid}, NSpid {self._ns_pid}" if self.sandbox else ""
                    log.write(f"# qualify: engine host pid {self._pid}{where}\n")
                    first = self._boots == 1
                if first and self.on_spawn is not None:
                    threading.Thread(target=self._spawned, name="engine-spawned", daemon=True).start()
                self._pump(self._proc.stdout, log)
                rc = _exit_status(self._proc.wait(), self.sandbox is not None)
                log.write(f"# qualify: engine {describe_exit(rc)}\n")
                swept = sweep_stale_shm()  # what a crashed or killed engine could not release
                if swept:
                    log.write(f"# qualify: removed {len(swept)} shared-memory files it left\n")
                with self._lock:
                    self._exit_code = rc
                    self._exit_codes.append(rc)
                    self._swept.extend(swept)
                    self._ready.clear()
                    # A refusal at construction is the engine's answer; restarting it would only repeat it.
                    self._refused = rc == EXIT_REFUSED
                    if self._stopping or rc == 0 or self._refused or self._restarts >= self.max_restarts:
                        break
                    self._restarts += 1  # on-failure policy: a crash earns a restart
                time.sleep(0.2)
        self._done.set()

    def _spawned(self) -> None:
        with contextlib.suppress(Exception):  # work started early to save time: its own failure is no boot's
            assert self.on_spawn is not None
            self.on_spawn()

    def _pump(self, stream: IO[str] | None, log: IO[str]) -> None:
        assert stream is not None
        for line in stream:
            log.write(line)
            m = READY_RE.search(line)
            if m and not self._ready.is_set():
                url = m.group("url")
                self._port = urlsplit(url).port
                self._url = url.rstrip("/")
                self._ready.set()

    def _hold_netns(self, pid: int | None) -> None:
        """Open the new boot's network namespace (a restarted engine has a new one). In a sandbox with one
        of its own that cannot be opened, the client's connections fail: they never go to the host's."""
        if self.sandbox is None or not self.sandbox.own_net:
            return
        try:
            new = Netns(pid, "the harness did not find the engine's pid to enter its network")
        except NetnsError as exc:
            new = Netns(None, str(exc))
        old, self._netns = self._netns, new  # never None between two boots: None is the host's network
        if old is not None:
            old.close()

    def netns(self) -> Netns | None:
        return self._netns

    def url(self, refresh: bool = False) -> str:
        if self._url is None:
            raise RuntimeError("the engine has not reported an address yet")
        return self._url

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the engine (perhaps restarted) has printed its ready line again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return True
            if self._done.is_set():
                return False
        return False

    def status(self) -> LaunchStatus:
        with self._lock:
            alive = self._proc is not None and self._proc.poll() is None
            return LaunchStatus(
                alive=alive,
                exit_code=None if alive else self._exit_code,
                restart_count=self._restarts,
                detail={
                    "pid": self._pid,  # the engine's host pid
                    "sandbox_pid": self._sandbox_pid,  # bwrap's (None: unsandboxed)
                    "engine_ns_pid": self._ns_pid,  # /proc/PID/status NSpid, the host's first
                    "pids": list(self._pids),
                    "boots": self._boots,
                    "exit_codes": list(self._exit_codes),
                    "exits": [describe_exit(c) for c in self._exit_codes],
                    "refused_at_construction": self._refused,
                    "shm_swept": len(self._swept),
                    "log": str(self.log_path),
                },
            )

    def stop(self, grace_s: float = STOP_GRACE_S) -> LaunchStatus:
        self._halt(grace_s)
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 5)
        self._close_watch()
        self._drop_spare_peers()
        self.monitor.close()
        with self._lock:
            self._swept.extend(sweep_stale_shm())
            steps = list(self._steps)
        for step in steps:  # a step of this launcher's still running (a short run): it ends with the run
            _terminate(step, 1.0)
        if self._seeding is not None:
            self._seeding.thread.join(5.0)  # its step was just stopped: the thread ends with it
            if self._seeding.handoff is not None:
                remove_handoff(self._seeding.handoff)
        if self.sandbox is not None:
            if self.kernels is not None and self._boots:
                with contextlib.suppress(Exception):  # evidence only: what the engine compiled itself
                    self.kernels.account(self.kernels_name, self.scratch / "home")
            shutil.rmtree(self.scratch, ignore_errors=True)  # the engine's writes go with it
        with self._lock:
            old = self._netns
            if old is not None:  # a stopped engine's address is nobody's: nothing connects there now
                self._netns = Netns(None, "the engine was stopped")
        if old is not None:
            old.close()
        return self.status()

    def _engine_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**env, HARNESS_FD_ENV: str(self._watch_r)}

    def _close_watch(self) -> None:
        """Closing the write end tells any engine still alive that its harness is gone."""
        for fd in (self._watch_w, self._watch_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watch_w = self._watch_r = -1

    def logs_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def sibling(self, options: EngineOptions, name: str) -> LocalLauncher:
        other = LocalLauncher(
            options,
            self.run_dir / name,
            max_restarts=0,
            python=self.python,
            env=self.env,
            sandbox=self.sandbox,
            weights=self.weights,
        )
        other.hand_weights = self.hand_weights
        other.kernels = self.kernels
        other.kernels_name = name
        other._kernels_wait = True
        return other

    def identity(self) -> dict[str, Any]:
        return {"launcher": "local", "python": self.python, "engine_module": self.module}

    def host_pids(self) -> dict[int, int]:
        """{pid as the engine sees it (its pid namespace): host pid} for the engine and its children (DCP
        ranks); unsandboxed the two are the same."""
        from qualify.launch.sandbox import namespace_pids

        if self.sandbox is None or self._pid is None:
            return {}
        return namespace_pids(self._pid)

    def code_subject(self) -> tuple[str, str]:
        """(digest, scope): the harness's tree digest of what the engine can import (its sandbox's code
        mounts; unsandboxed, the same folders, though the engine could then import anything)."""
        from qualify.launch.sandbox import ENGINE_PATH_ENV, code_digest, engine_code

        code = (
            self.sandbox.code
            if self.sandbox is not None
            else engine_code(self.module, self.python, self.env.get(ENGINE_PATH_ENV, ""))
        )
        digest, files = code_digest(code)
        scope = code.scope()
        if self.sandbox is None:
            scope = (
                "UNSANDBOXED (--no-sandbox): the engine could import anything the operator can read; " + scope
            )
        return digest, f"{scope} [{files} files]"[:1000]

    def sandbox_info(self) -> dict[str, Any]:
        from qualify.launch.sandbox import unsandboxed

        if self.sandbox is None:
            return {**unsandboxed("--no-sandbox: the engine ran as the operator's own process"),
                    "env_names": sorted(self.engine_environment())}  # fmt: skip
        info = self.sandbox.describe(self.engine_environment())
        if self.kernels is not None:
            info["kernel_cache"] = self.kernels.evidence()
        return info

    def run_refusal(self, kda_backend: str, timeout_s: float) -> RefusalOutcome:
        # The fault flag is for the engine under test; the refusal must come from construction alone.
        env = {k: v for k, v in self.env.items() if k != FAULT_ENV}
        cmd = self.command(0, kda_backend)
        scratch = self.run_dir / "refusal-scratch"
        t0 = time.monotonic()
        proc, pid = self._popen(
            cmd,
            scratch,
            self._env_for(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            pass_fds=(self._watch_r,),
        )
        inner = pid if self.sandbox is not None else None
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            code: int | None = _exit_status(proc.returncode, self.sandbox is not None)
        except subprocess.TimeoutExpired:
            _terminate(proc, STOP_GRACE_S, inner)
            out, _ = proc.communicate()
            code = None
        except BaseException:  # interrupted (SIGTERM, SIGINT...): the probe goes with the run
            _terminate(proc, 1.0, inner)
            raise
        finally:
            if self.sandbox is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return RefusalOutcome(cmd, code, time.monotonic() - t0, out or "")

    def _into_engine_namespaces(self, cmd: list[str]) -> list[str]:
        """A harness helper that must meet the sandboxed engine's memory (the peer) joins the engine's pid,
        IPC, UTS and network namespaces with util-linux nsenter, keeping the harness's files. Its
        /proc must be that pid namespace's (the CUDA driver reads /proc/<getpid()>: "Error 304" under the
        host's /proc), so util-linux unshare gives it a mount namespace of its own, a copy of the
        harness's, with a fresh /proc. (What a legacy CUDA IPC handle needs is the exporter's real uid,
        `peer_identity`; scripts/ipc-matrix found no set of shared namespaces that opens it for root. The
        namespaces were joined before that was known; whether the engine's uid alone suffices from outside
        them is untested.) A harness without root
        (a user-namespace sandbox) cannot enter, and runs it outside."""
        if self.sandbox is None or not self.sandbox.own_net or self._pid is None:
            return cmd
        nsenter = shutil.which("nsenter", path="/usr/bin:/bin") or "/usr/bin/nsenter"
        unshare = shutil.which("unshare", path="/usr/bin:/bin") or "/usr/bin/unshare"
        into = [nsenter, f"--target={self._pid}", "--pid", "--ipc", "--uts", "--net", "--"]
        return [*into, unshare, "--mount", "--propagation=private", "--mount-proc", "--", *cmd]

    def peer_identity(self) -> list[str]:
        """The peer's --cuda-as: on a GPU, a root harness's sandboxed engine runs as SANDBOX_UID, and the
        NVIDIA driver opens its CUDA IPC handles only for a process of that real uid (root, or root with
        only that effective uid, gets cudaErrorMapBufferObjectFailed on the H200, 2026-12-02:
        tests/data/ipc-matrix). The peer takes it only while it holds the handles; its saved uid stays
        root, so the engine cannot trace it (it could signal it, which fails the check)."""
        if self.sandbox is None or not self.sandbox.root or not self.sandbox.gpu:
            return []
        return ["--cuda-as", f"{SANDBOX_UID}:{SANDBOX_GID}"]

    def _peer_command(self, *args: str) -> list[str]:
        cmd = [self.python, "-I", str(PEER_FILE), *args, *self.peer_identity()]
        return self._into_engine_namespaces(cmd)

    def prepare_peers(self, n: int) -> int:
        """Start up to `n` peers ahead of time (`peer.py --wait`: each imports torch, the slow part of a
        start, then waits for one spec on stdin), in the namespaces of the engine as it runs now; the
        layout check's peers then start only their work. The number waiting."""
        if self._pid is None:
            return 0
        with self._lock:
            self._spare_peers = [(p, log) for p, log in self._spare_peers if p.poll() is None]
            while len(self._spare_peers) < n:
                log = self.run_dir / f"peer-spare-{self._spares_started}.log"
                with log.open("w") as sink:
                    proc = subprocess.Popen(
                        self._peer_command("--wait"), stdout=sink, stderr=subprocess.STDOUT,
                        stdin=subprocess.PIPE, env=peer_env(self.env), cwd="/", start_new_session=True,
                    )  # fmt: skip
                self._spare_peers.append((proc, log))
                self._spares_started += 1
            return len(self._spare_peers)

    def _take_spare_peer(self) -> tuple[subprocess.Popen[bytes], Path] | None:
        with self._lock:
            while self._spare_peers:
                proc, log = self._spare_peers.pop(0)
                if proc.poll() is None and proc.stdin is not None:
                    return proc, log
        return None

    def _drop_spare_peers(self) -> None:
        with self._lock:
            spares, self._spare_peers = self._spare_peers, []
        for proc, _ in spares:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # EOF: a waiting peer exits 0
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _terminate(proc, 1.0)

    def run_peer(self, spec_path: Path, timeout_s: float) -> PeerOutcome:
        """The peer as a sibling subprocess: `python -I .../qualify/engine/peer.py` from the harness's own
        installation (never the engine module under test), run as a file (it is self-contained: torch,
        numpy, stdlib), so it needs no installed qualify (a GPU host runs the checkout in place): -I drops
        PYTHONPATH, the user site, the working directory and the script's folder from its path, so
        nothing the engine could write is imported. Its report is read from a file with a size limit. A
        peer started ahead of time (prepare_peers) gets the spec on its stdin, else one starts now."""
        out = spec_path.with_name(spec_path.stem + ".report.json")
        log = spec_path.with_name(spec_path.stem + ".log")
        out.unlink(missing_ok=True)  # a report left by an earlier peer must not count for this one
        t0 = time.monotonic()
        spare = self._take_spare_peer()
        if spare is not None:
            proc, spare_log = spare
            cmd = [*self._peer_command("--wait"), f"(stdin: --spec {spec_path} --out {out})"]
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"spec": str(spec_path), "out": str(out)}).encode() + b"\n")
                proc.stdin.close()
            except OSError:  # it died waiting: a peer of its own instead
                _terminate(proc, 1.0)
                spare = None
        if spare is None:
            cmd = self._peer_command("--spec", str(spec_path), "--out", str(out))
            spare_log = log
            with log.open("w") as sink:
                proc = subprocess.Popen(
                    cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=peer_env(self.env), cwd="/", start_new_session=True,
                )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _terminate(proc, 1.0)
            code = None
        if spare_log != log:
            with contextlib.suppress(OSError):
                os.replace(spare_log, log)
        raw = None
        if out.is_file():
            with out.open("rb") as f:
                raw = f.read(MAX_PEER_REPORT_BYTES + 1)
        text = log.read_text(errors="replace") if log.is_file() else ""
        return PeerOutcome.from_output(cmd, code, time.monotonic() - t0, raw, text)


# What a harness helper (the peer) keeps of the harness's environment; -I ignores the PYTHON* ones anyway.
PEER_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def peer_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in PEER_ENV}


def _exit_status(rc: int, sandboxed: bool) -> int:
    """bwrap reports a child killed by signal N as exit 128+N: read it back as a subprocess's -N."""
    if sandboxed and 128 < rc < 160:
        return -(rc - 128)
    return rc


def _terminate(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S, inner: int | None = None) -> None:
    """SIGTERM to the engine (inside a sandbox: to the engine process itself, so it releases its
    allocations; bwrap would answer a signal by dying and taking it down by SIGKILL), or to its process
    group; SIGKILL to the group after the grace period (the sandbox's pid namespace goes with bwrap)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if inner is not None:
            os.kill(inner, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _last_json(text: str) -> dict[str, Any]:
    """The last line of a step's output that is a JSON object (what the reference engine's step says of
    its work: evidence, never trusted for a verdict), else {}."""
    for line in reversed(text[-(1 << 16) :].splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                said = json.loads(line)
                if isinstance(said, dict):
                    return said
    return {}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("# qualify:")]
    return lines[-1][:300] if lines else "(no output)"
