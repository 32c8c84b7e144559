"""The checks of `qualify run`, one module each, in the order they run (docs/DESIGN.md)."""

from __future__ import annotations

from qualify.checks import arenas, backend, boot, capture, dcp, faults, generation, layout, monitor, reload
from qualify.checks.base import Check
from qualify.run.request import RunRequest

CHECKS: list[Check] = [
    boot.CHECK,
    backend.CHECK,
    layout.CHECK,
    arenas.CHECK,
    capture.CHECK,
    reload.CHECK,
    monitor.CHECK,
    generation.CHECK,
    faults.CHECK,
]


def checks_for(req: RunRequest) -> list[Check]:
    """The checks a request runs, in order: with --dcp N the dcp check runs before faults."""
    if req.dcp is None:
        return list(CHECKS)
    return [*CHECKS[:-1], dcp.CHECK, CHECKS[-1]]
