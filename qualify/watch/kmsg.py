"""Kernel-log Xid watcher: parses `NVRM: Xid (PCI:...): NN, ...` lines and tails the kernel log during a run.

Sources, first that applies: $QUALIFY_KMSG_SOURCE (a file, read from its start and followed: tests and
replays of recorded logs, never a live watch), /dev/kmsg (only records written after the watcher started),
`dmesg --follow-new`. A live source that fails mid-run (a read error, dmesg exiting) is `unavailable` from
then on, with the time it was lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from qualify.watch.oom import oom_killed_pid
from qualify.watch.xid import XidEvent, classify

KMSG_SOURCE_ENV = "QUALIFY_KMSG_SOURCE"

# Accepts the forms the driver and log tools write: /dev/kmsg records ("6,1234,5678,-;NVRM: ..."),
# dmesg ("[  12.3] NVRM: ..."), syslog/journal ("May 18 19:02:39 host kernel: NVRM: ..."), and both
# "(PCI:0000:3b:00)" and the older "(0000:3b:00)" device forms.
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<device>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)\): "
    r"(?P<code>\d+)(?:,\s*(?P<rest>.*))?$"
)


def parse_line(line: str, source: str = "kmsg") -> XidEvent | None:
    """The classified Xid event of one kernel-log line, or None when the line is not an Xid report."""
    m = _XID_RE.search(line.rstrip("\r\n"))
    if m is None:
        return None
    rest = (m.group("rest") or "").strip()
    return classify(
        int(m.group("code")), source=source, device=m.group("device"), message=rest, line=line.strip()
    )


def _read_record(fd: int) -> bytes:
    return os.read(fd, 8192)  # /dev/kmsg hands out one record per read


class KmsgWatcher:
    """Collects Xid events from the kernel log on a background thread until `stop()`."""

    def __init__(
        self,
        source: str | os.PathLike[str] | None = None,
        poll_s: float = 0.2,
        kmsg_path: str = "/dev/kmsg",
    ) -> None:
        self._explicit = str(source) if source is not None else os.environ.get(KMSG_SOURCE_ENV)
        self._kmsg_path = kmsg_path  # tests point it elsewhere to reach the dmesg fallback
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self.events: list[XidEvent] = []
        self.oom_killed_pids: list[int] = []  # "Killed process PID" lines (the kernel's OOM killer)
        self.lines_read = 0
        self.source: str | None = None
        self.kind: str | None = None  # file | kmsg | dmesg
        # watching | stopped (live until stop) | replaying | replayed (a file) | unavailable (never or lost)
        self.status = "not_started"
        self.reason: str | None = None
        self.lost_at: str | None = None  # RFC 3339: when a live source stopped being read

    # ------------------------------------------------------------ lifecycle
    def start(self) -> KmsgWatcher:
        target = self._open()
        if target is not None:
            self.status = "replaying" if self.kind == "file" else "watching"
            self._thread = threading.Thread(
                target=self._guarded, args=(target,), name="kmsg-watch", daemon=True
            )
            self._thread.start()
        return self

    def _guarded(self, follow: Callable[[], None]) -> None:
        try:
            follow()
        except Exception as exc:  # a reader that dies must not leave the watch reading "watching"
            self._lose(f"{self.source} reader failed: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Stop tailing; lines already written to a file source are read to its end first."""
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=2)
        if self.status == "watching":
            self.status = "stopped"
        elif self.status == "replaying":
            self.status = "replayed"

    def live(self) -> bool:
        """True when a live kernel log (not a file) is being read, or was read until `stop()` without a
        failure: the thread that reads it is running, or finished only because it was stopped."""
        if self.kind not in ("kmsg", "dmesg"):
            return False
        if self.status == "watching":
            return self._thread is not None and self._thread.is_alive()
        return self.status == "stopped"

    def _lose(self, reason: str) -> None:
        """A live source failed: unavailable from now on, and the receipt says since when."""
        self.lost_at = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        self.status, self.reason = "unavailable", f"{reason} at {self.lost_at}"

    def oom_kills(self) -> list[int]:
        """PIDs the kernel log says the OOM killer killed, as seen so far."""
        with self._lock:
            return list(self.oom_killed_pids)

    def snapshot(self) -> list[XidEvent]:
        with self._lock:
            return list(self.events)

    def evidence(self) -> dict:
        events = self.snapshot()
        return {
            "status": self.status,
            "source": self.source,
            "reason": self.reason,
            "lost_at": self.lost_at,
            "lines_read": self.lines_read,
            "events": [e.to_evidence() for e in events],
        }

    # ------------------------------------------------------------ sources
    def _open(self):
        if self._explicit:
            path = Path(self._explicit)
            if not path.is_file():
                self.status, self.reason = "unavailable", f"{KMSG_SOURCE_ENV}={path} is not a readable file"
                return None
            self.source, self.kind = f"file:{path}", "file"
            return lambda: self._follow_file(path)
        try:
            fd = os.open(self._kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            kmsg_reason = f"{self._kmsg_path}: {exc.strerror}"
        else:
            # Seek to the end: only records written during this run count, not old boots' history.
            os.lseek(fd, 0, os.SEEK_END)
            self.source, self.kind = self._kmsg_path, "kmsg"
            return lambda: self._follow_kmsg(fd)
        dmesg = shutil.which("dmesg")
        if dmesg:
            try:
                self._proc = subprocess.Popen(
                    [dmesg, "--follow-new", "--nopager"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            except OSError as exc:
                self.status, self.reason = "unavailable", f"{kmsg_reason}; dmesg: {exc.strerror}"
                return None
            time.sleep(0.05)
            if self._proc.poll() is not None:
                self.status = "unavailable"
                self.reason = f"{kmsg_reason}; dmesg --follow-new exited {self._proc.returncode}"
                return None
            self.source, self.kind = "dmesg --follow-new", "dmesg"
            return self._follow_proc
        self.status, self.reason = "unavailable", f"{kmsg_reason}; no dmesg on PATH"
        return None

    def _record(self, line: str) -> None:
        self.lines_read += 1
        ev = parse_line(line, source="kmsg")
        pid = oom_killed_pid(line)
        if pid is not None:
            with self._lock:
                self.oom_killed_pids.append(pid)
        if ev is not None:
            with self._lock:
                self.events.append(ev)

    def _follow_file(self, path: Path) -> None:
        with path.open("r", errors="replace") as fh:
            pending = ""
            while True:
                chunk = fh.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        self._record(pending)
                        pending = ""
                    continue
                if self._stop.is_set():
                    if pending:
                        self._record(pending)
                    return
                self._stop.wait(self._poll_s)

    def _follow_kmsg(self, fd: int) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ready, _, _ = select.select([fd], [], [], self._poll_s)
                    if not ready:
                        continue
                    data = _read_record(fd)
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        continue
                    if exc.errno == errno.EPIPE:  # records overwritten before we read them: go on
                        continue
                    self._lose(f"{self._kmsg_path} read failed: {exc.strerror or exc}")
                    return
                # Record: "prio,seq,usec,flags;message\n continuation lines"
                text = data.decode("utf-8", "replace")
                self._record(text.split("\n", 1)[0])
        finally:
            os.close(fd)

    def _follow_proc(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._record(line)
            if self._stop.is_set():
                return
        if not self._stop.is_set():  # dmesg ended on its own: nothing is being watched any more
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=2)
            self._lose(f"dmesg --follow-new exited {self._proc.returncode}")
