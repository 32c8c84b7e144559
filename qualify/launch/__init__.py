"""Launchers: boot the engine as a supervised local process or a Docker container; report its fate."""

from __future__ import annotations

from qualify.launch.base import EngineOptions, Launcher, LaunchError, LaunchStatus, RefusalOutcome

__all__ = ["EngineOptions", "LaunchError", "LaunchStatus", "Launcher", "RefusalOutcome"]
