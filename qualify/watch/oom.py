"""Was a SIGKILLed engine killed by the kernel's OOM killer? Only the kernel's own record says: an OOM-kill
line in the kernel log naming the process, or a rise of `oom_kill` in this cgroup's memory.events."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

# "Out of memory: Killed process 1234 (python)" and "Memory cgroup out of memory: Killed process 1234 (...)"
OOM_KILL_RE = re.compile(r"Killed process (?P<pid>\d+)\b")
SIGKILL_EXITS = (-9, 137)  # a subprocess's -9, a container's 128 + 9


def oom_killed_pid(line: str) -> int | None:
    m = OOM_KILL_RE.search(line)
    return int(m.group("pid")) if m else None


def cgroup_oom_kills(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """`oom_kill` of this process's cgroup (v2, counted over its subtree), or None where it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
        rel = next(ln.split("::", 1)[1] for ln in lines if ln.startswith("0::"))
        events = (root / rel.lstrip("/") / "memory.events").read_text()
    except (OSError, StopIteration, IndexError):
        return None
    for ln in events.splitlines():
        key, _, value = ln.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def kernel_oom(
    exit_codes: Iterable[int],
    pids: Iterable[int],
    kernel_oom_pids: Iterable[int],
    cgroup_before: int | None,
    cgroup_after: int | None,
) -> str | None:
    """None when no engine was killed by signal 9; else "observed" when the kernel recorded an OOM kill of
    one of `pids` (or its cgroup counted one during the run), "unknown" otherwise."""
    if not any(c in SIGKILL_EXITS for c in exit_codes):
        return None
    if set(pids) & set(kernel_oom_pids):
        return "observed"
    if cgroup_before is not None and cgroup_after is not None and cgroup_after > cgroup_before:
        return "observed"
    return "unknown"
