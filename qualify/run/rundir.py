"""A run's directory as the evidence of a run in progress: held under an exclusive lock by its harness for the
run's whole life, with the request and the results so far, so a run whose harness was killed can be closed."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from qualify.launch.base import harness_identity

LOCK = "harness.lock"
REQUEST = "request.json"
PROGRESS = "progress.json"
RECEIPT = "receipt.dsse.json"


def store_label(url: str) -> str:
    """The store URL without its password: how a run dir names the store its receipt belongs in."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy knows: the store would have refused it already
        return url


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, default=str, indent=1))
    os.replace(tmp, path)


@dataclass
class RunDir:
    path: Path
    _fd: int = -1

    def claim(self, request: dict[str, Any], store_url: str, started_at: datetime, version: str) -> None:
        """Create the directory and hold its lock (released by the kernel however this process ends), then
        write what a later `qualify run` or `qualify gc` needs to sign an aborted receipt for it."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o600)  # O_CLOEXEC: engines lack it
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Written after the lock is held: a directory with a request and no lock holder was abandoned.
        _write_json(
            self.path / REQUEST,
            {
                "request": request,
                "store": store_label(store_url),
                "started_at": started_at.isoformat(),
                "harness": harness_identity(),
                "qualify_version": version,
            },
        )

    def progress(self, value: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # evidence on the way; the receipt at the end is what counts
            _write_json(self.path / PROGRESS, value)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def abandoned(runs: Path) -> list[Path]:
    """Run directories with a request, no receipt, and no living harness holding their lock (oldest first).
    Each is returned locked by this process (see `take`), or skipped."""
    out = []
    with contextlib.suppress(OSError):
        for d in sorted(runs.iterdir()):
            if d.is_dir() and (d / REQUEST).is_file() and not (d / RECEIPT).exists():
                out.append(d)
    return out


def take(run_dir: Path) -> int | None:
    """The run's lock, held now by this process (an fd to close when done), or None while a harness (or
    another recoverer) holds it."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if (run_dir / RECEIPT).exists():  # closed by someone else between the listing and the lock
        os.close(fd)
        return None
    return fd


def read(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request.json, progress.json or {})."""
    request = json.loads((run_dir / REQUEST).read_text())
    try:
        progress = json.loads((run_dir / PROGRESS).read_text())
    except (OSError, ValueError):
        progress = {}
    return request, progress
