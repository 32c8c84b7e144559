"""The launcher contract shared by the local and Docker launchers, and the engine's command line."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from qualify.errors import QualifyError

READY_RE = re.compile(r"QUALIFY_ENGINE_READY url=(?P<url>\S+)(?: pid=(?P<pid>\d+))?")
FAULT_ENV = "QUALIFY_ENGINE_FAULT"
DEFAULT_MAX_RESTARTS = 2


class LaunchError(QualifyError):
    """The engine could not be started at all (no image, no daemon, no GPU runtime): one line for people."""


@dataclass(frozen=True)
class EngineOptions:
    """What the engine is asked to be; the launcher adds where it listens."""

    preset: str
    kda_backend: str
    num_spec: int = 0
    extra_args: tuple[str, ...] = ()

    def serve_args(self, kda_backend: str | None = None) -> list[str]:
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


class Launcher(ABC):
    kind: str

    @abstractmethod
    def start(self, timeout_s: float) -> str:
        """Boot the engine; return its base URL once it is ready. LaunchError when it cannot start;
        TimeoutError when it did not get ready in time; RuntimeError when it died before ready."""

    @abstractmethod
    def url(self, refresh: bool = False) -> str:
        """The engine's current base URL (re-read after a restart when `refresh`)."""

    @abstractmethod
    def status(self) -> LaunchStatus: ...

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
