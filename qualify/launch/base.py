"""The launcher contract shared by the local and Docker launchers, and the engine's command line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import QualifyError

READY_RE = re.compile(r"QUALIFY_ENGINE_READY url=(?P<url>\S+)(?: pid=(?P<pid>\d+))?")
FAULT_ENV = "QUALIFY_ENGINE_FAULT"
DEFAULT_MAX_RESTARTS = 2
# The engine's exit status when it refuses its configuration at construction (python -m qualify.engine's
# EXIT_BAD_CONFIG): a refusal is an answer, not a crash, so no launcher restarts it.
EXIT_REFUSED = 2
# The local engine's end of the harness pipe (python -m qualify.engine watches it, exits on EOF).
HARNESS_FD_ENV = "QUALIFY_HARNESS_FD"


def describe_exit(code: int | None) -> str | None:
    """-9 (a subprocess) or 137 (a container) -> "killed by signal 9 (SIGKILL)"; 3 -> "exited with code 3"."""
    if code is None:
        return None
    sig = -code if code < 0 else code - 128 if 128 < code < 160 else None
    if sig is None:
        return f"exited with code {code}"
    try:
        name = f" ({signal.Signals(sig).name})"
    except ValueError:
        name = ""
    return f"killed by signal {sig}{name}"


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent pid, ...); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            _, paren, rest = f.read().rpartition(")")
    except OSError:
        return None
    return rest.split() if paren else None


def _proc_start_ticks(pid: int) -> str | None:
    fields = proc_stat(pid)
    return fields[19] if fields else None  # field 22, starttime


def _boot_id() -> str:
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()  # noqa: SIM115
    except OSError:
        return "unknown"


def harness_identity() -> dict[str, str]:
    """This harness process, as a later process on this host can tell whether it still lives (a PID alone
    may be reused: the boot and the process's start time make it unique)."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": str(pid),
        "start": _proc_start_ticks(pid) or "unknown",
    }


def harness_alive(ident: dict[str, str]) -> bool | None:
    """True while that harness runs; False once it is gone; None when this host cannot tell (another host)."""
    if ident.get("host") != socket.gethostname():
        return None
    if ident.get("boot_id") != _boot_id():
        return False  # the host rebooted since: every process of that boot is gone
    try:
        pid = int(ident.get("pid", ""))
    except ValueError:
        return None
    start = _proc_start_ticks(pid)
    return start is not None and start == ident.get("start")


class LaunchError(QualifyError):
    """The engine could not be started at all (no image, no daemon, no GPU runtime): one line for people."""


@dataclass(frozen=True)
class EngineOptions:
    """What the engine is asked to be; the launcher adds where it listens."""

    preset: str
    kda_backend: str
    num_spec: int = 0
    extra_args: tuple[str, ...] = ()
    # The launch document (JSON text, docs/PROTOCOL.md "Launch"): when set, the engine is started with
    # `serve --launch FILE` alone, the launcher writing the file where the engine can read it.
    launch: str | None = None

    def launch_text(self, kda_backend: str | None = None) -> str:
        """The launch document, with another backend where one is given (the refusal probe's)."""
        assert self.launch is not None
        if kda_backend is None:
            return self.launch
        doc = json.loads(self.launch)
        doc["kda_decode_backend"] = kda_backend
        return json.dumps(doc, sort_keys=True)

    def serve_args(self, kda_backend: str | None = None, launch_path: str | None = None) -> list[str]:
        if self.launch is not None and launch_path is not None:
            return ["serve", "--launch", launch_path]
        return [
            "serve",
            "--preset",
            self.preset,
            "--kda-backend",
            kda_backend if kda_backend is not None else self.kda_backend,
            "--num-spec",
            str(self.num_spec),
            *self.extra_args,
        ]


@dataclass
class LaunchStatus:
    """The engine's fate as the launcher sees it."""

    alive: bool
    exit_code: int | None
    restart_count: int
    oom_killed: bool = False  # container killed by its memory limit (docker); always False locally
    detail: dict[str, Any] = field(default_factory=dict)

    def to_evidence(self) -> dict[str, Any]:
        return {
            "alive": self.alive,
            "exit_code": self.exit_code,
            "restart_count": self.restart_count,
            "oom_killed": self.oom_killed,
            **self.detail,
        }


@dataclass(frozen=True)
class RefusalOutcome:
    """A second engine started with a value it must refuse at construction: how it ended."""

    command: list[str]
    exit_code: int | None  # None: still running at the deadline (then killed)
    seconds: float
    output: str


# The KV-transfer peer the harness launches beside the engine: its module (run from the harness's own
# code), and the most bytes of report the harness reads from it.
PEER_MODULE = "qualify.engine.peer"
PEER_FILE = Path(__file__).resolve().parents[1] / "engine" / "peer.py"  # a path, never imported here
MAX_PEER_REPORT_BYTES = 1 << 20


@dataclass(frozen=True)
class PeerOutcome:
    """How the peer process the harness launched ended, and its JSON report (None: no usable report)."""

    command: list[str]
    exit_code: int | None  # None: still running at the deadline (then killed)
    seconds: float
    report: dict[str, Any] | None
    error: str | None  # why there is no report, in words
    output: str = ""  # the tail of what it printed besides the report

    @classmethod
    def from_output(
        cls, command: list[str], exit_code: int | None, seconds: float, raw: bytes | None, output: str
    ) -> PeerOutcome:
        """Parse the report bytes (size-limited, one JSON object) into an outcome."""
        report: dict[str, Any] | None = None
        error: str | None = None
        if exit_code is None:
            error = f"the peer did not finish within {seconds:.0f} s and was killed"
        elif not raw:
            error = f"the peer exited with code {exit_code} without a report"
        elif len(raw) > MAX_PEER_REPORT_BYTES:
            error = f"the peer's report is over {MAX_PEER_REPORT_BYTES} bytes"
        else:
            try:
                report = json.loads(raw)
            except ValueError as exc:
                error = f"the peer's report is not JSON: {exc}"
            if report is not None and not isinstance(report, dict):
                report, error = None, "the peer's report is not a JSON object"
        return cls(command, exit_code, seconds, report, error, output[-2000:])


class Launcher(ABC):
    kind: str
    # The harness's CUDA activity monitor inside the engine (qualify.launch.monitor.EngineMonitor), where
    # this launcher starts one; None: it does not, and monitored conditions say so.
    monitor: Any = None

    @abstractmethod
    def start(self, timeout_s: float) -> str:
        """Boot the engine; return its base URL once it is ready. LaunchError when it cannot start;
        TimeoutError when it did not get ready in time; RuntimeError when it died before ready."""

    @abstractmethod
    def url(self, refresh: bool = False) -> str:
        """The engine's current base URL (re-read after a restart when `refresh`)."""

    @abstractmethod
    def status(self) -> LaunchStatus: ...

    def netns(self) -> Any:
        """The engine's own network namespace (qualify.netns.Netns) that the harness connects in, or None:
        the engine is reached on the host's network."""
        return None

    @abstractmethod
    def stop(self, grace_s: float = 5.0) -> LaunchStatus:
        """Stop the engine (SIGTERM, then SIGKILL after `grace_s`); the final status."""

    @abstractmethod
    def logs_tail(self, lines: int = 30) -> str: ...

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What identifies the engine build from the outside (docker: image id and repo digests)."""

    @abstractmethod
    def run_refusal(self, kda_backend: str, timeout_s: float) -> RefusalOutcome:
        """Start a second engine with `kda_backend` (a value it must refuse) and report how it ended."""

    def sibling(self, options: EngineOptions, name: str) -> Launcher:
        """Another engine of the same build, launched the same way with other options (a reference the
        harness compares against), logging under the run dir's `name` folder. Not restarted."""
        raise NotImplementedError(f"the {self.kind} launcher cannot start a reference engine")

    def launch_paths(self, weights_name: str) -> tuple[str, str]:
        """(weights file, scratch dir) as the engine will see them: the launcher fills these fields of the
        launch document (where they live is the launcher's to decide)."""
        raise NotImplementedError(f"the {self.kind} launcher does not say where the weights live")

    def manifest(self, timeout_s: float) -> tuple[bytes | None, str, str | None]:
        """Run the engine's `manifest` command: (its output, the command in words, why there is none)."""
        return None, "manifest", f"the {self.kind} launcher cannot read an engine manifest"

    def run_peer(self, spec_path: Path, timeout_s: float) -> PeerOutcome:
        """Launch the KV-transfer peer (the harness's own code, not the engine) where it can import the
        engine's allocations, give it `spec_path` (JSON: geometry, kv-handles, nonces) and read its report.
        A launcher that cannot do so says why, and the layout check fails closed."""
        return PeerOutcome([], None, 0.0, None, f"the {self.kind} launcher cannot launch a peer")
