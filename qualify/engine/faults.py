"""Fault injection for the harness's own tests: crash, hang or exhaust memory on an endpoint, or crash a
while after boot. Chosen with `--fault SPEC` (repeatable) or QUALIFY_ENGINE_FAULT (comma-separated)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

ENV = "QUALIFY_ENGINE_FAULT"
KINDS = ("crash-on", "hang-on", "oom-on", "crash-after-boot")
CRASH_EXIT_CODE = 3


@dataclass
class FaultPlan:
    crash_on: set[str] = field(default_factory=set)
    hang_on: set[str] = field(default_factory=set)
    oom_on: set[str] = field(default_factory=set)
    crash_after_boot: float | None = None

    def __bool__(self) -> bool:
        return bool(self.crash_on or self.hang_on or self.oom_on or self.crash_after_boot is not None)


def parse_faults(specs: list[str]) -> FaultPlan:
    plan = FaultPlan()
    for raw in specs:
        for spec in filter(None, (s.strip() for s in raw.split(","))):
            kind, sep, arg = spec.partition(":")
            if not sep or kind not in KINDS or not arg:
                raise ValueError(f"unknown fault {spec!r}; use one of {', '.join(k + ':ARG' for k in KINDS)}")
            if kind == "crash-after-boot":
                try:
                    plan.crash_after_boot = float(arg)
                except ValueError:
                    raise ValueError(f"crash-after-boot needs seconds, got {arg!r}") from None
            else:
                path = arg if arg.startswith("/") else "/" + arg
                getattr(plan, kind.replace("-", "_")).add(path)
    return plan


def plan_from(cli_specs: list[str] | None) -> FaultPlan:
    env = os.environ.get(ENV, "")
    return parse_faults([*(cli_specs or []), *([env] if env else [])])


def _exhaust_host_memory() -> None:
    """Allocate and touch host memory until the kernel or the container kills us."""
    hog = []
    while True:
        block = bytearray(256 * 1024 * 1024)
        for i in range(0, len(block), 4096):  # touch every page so it is really resident
            block[i] = 1
        hog.append(block)


def trigger(plan: FaultPlan, path: str) -> None:
    """Called before an endpoint runs; blocks the server on purpose (a hang must look like one)."""
    if path in plan.crash_on:
        os._exit(CRASH_EXIT_CODE)
    if path in plan.hang_on:
        while True:
            time.sleep(3600)
    if path in plan.oom_on:
        _exhaust_host_memory()


def arm_timers(plan: FaultPlan) -> None:
    if plan.crash_after_boot is not None:
        t = threading.Timer(plan.crash_after_boot, os._exit, args=(CRASH_EXIT_CODE,))
        t.daemon = True
        t.start()
