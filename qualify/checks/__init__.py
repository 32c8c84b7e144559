"""The checks of `qualify run`, one module each, in the order they run (DESIGN §4)."""

from __future__ import annotations

from qualify.checks import arenas, backend, boot, capture, faults, generation, layout, reload
from qualify.checks.base import Check

CHECKS: list[Check] = [
    boot.CHECK,
    backend.CHECK,
    layout.CHECK,
    arenas.CHECK,
    capture.CHECK,
    reload.CHECK,
    generation.CHECK,
    faults.CHECK,
]
