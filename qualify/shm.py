"""The engine's CPU allocation files in shared memory, and the sweep of those whose engine is gone (stdlib
only: the engine sweeps before it allocates, the harness after each engine it supervised exits)."""

from __future__ import annotations

import fcntl
import os
import tempfile

# CPU allocations are files named SHM_PREFIX...; the owning engine holds a shared flock on each for its
# whole life, so a file nobody holds a lock on belongs to an engine that died (killed, crashed) and may be
# removed by anyone on this host, whatever PID namespace either ran in.
SHM_PREFIX = "qualify-kv-lk-"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def sweep_stale_shm(base: str | None = None) -> list[str]:
    """Remove CPU allocation files whose owner died (no lock held on them); return the names removed."""
    base = base or shm_dir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(SHM_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while any live engine holds its lock
        except OSError:
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
