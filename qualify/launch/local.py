"""Local launcher: the engine as a supervised subprocess with an on-failure restart policy.

The engine's address comes from its ready line; after the first boot its port is pinned, so a restarted
engine answers at the same URL. Logs of every incarnation go to one file in the run directory. Every engine
holds the read end of a pipe only this harness writes to: it exits when the harness dies, even by SIGKILL.
After each exit the supervisor sweeps the shared-memory files a crashed engine could not release.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
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
    PEER_MODULE,
    READY_RE,
    EngineOptions,
    Launcher,
    LaunchStatus,
    PeerOutcome,
    RefusalOutcome,
    describe_exit,
)
from qualify.launch.monitor import EngineMonitor, monitor_command, monitor_enabled
from qualify.shm import sweep_stale_shm

STOP_GRACE_S = 5.0
# The module run as the engine (`python -m MODULE serve ...`); the reference engine by default. Another
# module that serves the same protocol (a wrapper, a patched build) is qualified the same way; the receipt's
# launcher identity names it.
ENGINE_MODULE_ENV = "QUALIFY_ENGINE_MODULE"
DEFAULT_ENGINE_MODULE = "qualify.engine"


class LocalLauncher(Launcher):
    kind = "local"

    def __init__(
        self,
        options: EngineOptions,
        run_dir: Path,
        *,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self.options = options
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.log_path = run_dir / "engine.log"
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stopping = False
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._port: int | None = None
        self._pid: int | None = None
        self._exit_code: int | None = None
        self._exit_codes: list[int] = []
        self._pids: list[int] = []
        self._restarts = 0
        self._boots = 0
        self._refused = False
        self._swept: list[str] = []
        # Non-inheritable by default: only the engines get the read end (pass_fds), nobody the write end.
        self._watch_r, self._watch_w = os.pipe()
        # The harness's CUDA activity monitor, started inside every boot of the engine (launch/monitor.py).
        self.monitor = EngineMonitor(run_dir, enabled=monitor_enabled(self.env))

    # ------------------------------------------------------------ commands
    @property
    def module(self) -> str:
        return self.env.get(ENGINE_MODULE_ENV) or DEFAULT_ENGINE_MODULE

    def command(self, port: int) -> list[str]:
        args = [*self.options.serve_args(None, self._launch_file()), "--port", str(port)]
        if self.monitor.enabled:
            return monitor_command(self.python, self.module, args)
        return [self.python, "-m", self.module, *args]

    def _launch_file(self, kda_backend: str | None = None) -> str | None:
        """Write the launch document (the refusal probe's beside it) into the run dir; its path."""
        if self.options.launch is None:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / ("launch.json" if kda_backend is None else "launch-refusal.json")
        path.write_text(self.options.launch_text(kda_backend))
        return str(path)

    def launch_paths(self, weights_name: str) -> tuple[str, str]:
        from qualify import settings

        return str(settings.data_dir() / "weights" / weights_name), str(self.run_dir / "scratch")

    def manifest(self, timeout_s: float) -> tuple[bytes | None, str, str | None]:
        cmd = [self.python, "-m", self.module, "manifest"]
        env = {k: v for k, v in self.env.items() if k != FAULT_ENV}
        text = " ".join(cmd[1:])
        try:
            out = subprocess.run(
                cmd, capture_output=True, env=env, timeout=timeout_s, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return None, text, f"`{text}` did not finish within {timeout_s:g} s"
        except OSError as exc:
            return None, text, f"`{text}` could not run: {exc}"
        if out.returncode != 0:
            err = _last_line(out.stderr.decode(errors="replace") or out.stdout.decode(errors="replace"))
            return None, text, f"`{text}` exited with code {out.returncode}: {err}"
        return out.stdout, text, None

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
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
                    mon_env, mon_fds = self.monitor.local_boot()
                    # Own session: a terminal's Ctrl-C reaches the harness, which stops the engine itself.
                    self._proc = subprocess.Popen(
                        cmd,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env={**self._engine_env(self.env), **mon_env},
                        text=True,
                        bufsize=1,
                        start_new_session=True,
                        pass_fds=(self._watch_r, *mon_fds),
                    )
                    self.monitor.after_spawn()
                    self._boots += 1
                    self._pid = self._proc.pid
                    self._pids.append(self._pid)
                self._pump(self._proc.stdout, log)
                rc = self._proc.wait()
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
                    "pid": self._pid,
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
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _terminate(proc, grace_s)
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 5)
        self._close_watch()
        self.monitor.close()
        with self._lock:
            self._swept.extend(sweep_stale_shm())
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
        return LocalLauncher(options, self.run_dir / name, max_restarts=0, python=self.python, env=self.env)

    def identity(self) -> dict[str, Any]:
        return {"launcher": "local", "python": self.python, "engine_module": self.module}

    def run_refusal(self, kda_backend: str, timeout_s: float) -> RefusalOutcome:
        # The fault flag is for the engine under test; the refusal must come from construction alone.
        env = {k: v for k, v in self.env.items() if k != FAULT_ENV}
        launch = self._launch_file(kda_backend)
        cmd = [self.python, "-m", self.module, *self.options.serve_args(kda_backend, launch), "--port", "0"]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._engine_env(env),
            text=True,
            start_new_session=True,
            pass_fds=(self._watch_r,),
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _terminate(proc)
            out, _ = proc.communicate()
            code = None
        except BaseException:  # interrupted (SIGTERM, SIGINT...): the probe goes with the run
            _terminate(proc, 1.0)
            raise
        return RefusalOutcome(cmd, code, time.monotonic() - t0, out or "")

    def run_peer(self, spec_path: Path, timeout_s: float) -> PeerOutcome:
        """The peer as a sibling subprocess: `python -m qualify.engine.peer` from the harness's own code
        (never the engine module under test), its report read from a file with a size limit."""
        root = str(PEER_FILE.parents[2])
        env = {k: v for k, v in self.env.items() if k not in (FAULT_ENV, ENGINE_MODULE_ENV)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        out = spec_path.with_name(spec_path.stem + ".report.json")
        log = spec_path.with_name(spec_path.stem + ".log")
        out.unlink(missing_ok=True)  # a report left by an earlier peer must not count for this one
        cmd = [self.python, "-m", PEER_MODULE, "--spec", str(spec_path), "--out", str(out)]
        t0 = time.monotonic()
        with log.open("w") as sink:
            proc = subprocess.Popen(
                cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=root, start_new_session=True,
            )  # fmt: skip
            try:
                code: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _terminate(proc, 1.0)
                code = None
        raw = None
        if out.is_file():
            with out.open("rb") as f:
                raw = f.read(MAX_PEER_REPORT_BYTES + 1)
        text = log.read_text(errors="replace") if log.is_file() else ""
        return PeerOutcome.from_output(cmd, code, time.monotonic() - t0, raw, text)


def _terminate(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the engine's process group, SIGKILL after the grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("# qualify:")]
    return lines[-1][:300] if lines else "(no output)"
