"""For liars about /health's pid: the server module's `os` with another `getpid` (what /health reports),
the real `os` for everything else."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType


class _Os:
    def __init__(self, getpid: Callable[[], int]) -> None:
        self.getpid = getpid

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(os, name)


def report_pid(server_module: ModuleType, getpid: Callable[[], int]) -> None:
    """Make `server_module` (qualify.engine.server) report `getpid()` as its pid."""
    server_module.os = _Os(getpid)  # type: ignore[attr-defined]
