"""The harness's end of the CUDA activity monitor (qualify/monitor/cupti_monitor.py, docs/MONITOR.md).

The launchers call three hooks and nothing else: `monitor_command` (the engine's argv, run through the
monitor file so it starts before the engine's code), `EngineMonitor.local_boot` / `after_spawn` (the
socketpair end a local engine inherits) and `EngineMonitor.docker_mount` (a read-only mount of the monitor
file and the socket directory for a container). The checks then open and close windows around their own
requests through `Launcher.monitor`. Every window report is kept (and written to the run directory's
monitor.jsonl), so the receipt's conditions can be recomputed from what the monitor sent.

The monitor runs in the engine's address space: what it reports is `monitored` evidence (stronger than the
engine's word, weaker than what the harness observes outside the process). A channel that stays silent, a
hello that never comes or a window that never returns is reported as such, never as an empty success.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MONITOR_FILE = Path(__file__).resolve().parents[1] / "monitor" / "cupti_monitor.py"  # run, never imported
FD_ENV = "QUALIFY_MONITOR_FD"
SOCKET_ENV = "QUALIFY_MONITOR_SOCKET"
# "off" starts the engine without the monitor (cost measurements; a GPU target then fails its monitored
# conditions, and the receipt says the monitor was switched off).
SWITCH_ENV = "QUALIFY_MONITOR"
CONTAINER_DIR = "/qualify-monitor"  # the monitor file, read-only, in a container
CONTAINER_SOCKET_DIR = "/qualify-monitor-socket"
HELLO_TIMEOUT_S = 60.0  # CUPTI start-up plus the engine's imports before the first window
WINDOW_TIMEOUT_S = 30.0  # a flush of a window's records
MAX_LINE_BYTES = 8 << 20  # one window report
MAX_WINDOWS = 512  # kept per run


def monitor_command(python: str, module: str, args: list[str], *, path: str | None = None) -> list[str]:
    """`python -m MODULE ARGS` as the monitor runs it: the monitor file first, the module as __main__."""
    return [python, path or str(MONITOR_FILE), module, *args]


def monitor_enabled(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(SWITCH_ENV, "on").lower() not in ("off", "0", "no")


class EngineMonitor:
    """One engine's monitor channel over its boots (a restarted engine brings a new monitor, a new link)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.mode: str | None = None  # local (socketpair) | docker (listening socket)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._child: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._sock_dir: Path | None = None
        self._buf = b""
        self.boots = 0
        self.hello: dict[str, Any] | None = None
        # why the current link stopped reporting (or never could)
        self.lost: str | None = None if enabled else f"the monitor is switched off ({SWITCH_ENV}=off)"
        self.windows: list[dict[str, Any]] = []
        self._next = 0

    # ------------------------------------------------------------ launcher hooks
    def local_boot(self) -> tuple[dict[str, str], tuple[int, ...]]:
        """Before each local boot: a fresh socketpair; the env var and the fd the engine inherits."""
        if not self.enabled:
            return {}, ()
        self.mode = "local"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        with self._lock:
            self._replace(ours)
            self._child = theirs
        return {FD_ENV: str(theirs.fileno())}, (theirs.fileno(),)

    def after_spawn(self) -> None:
        """The engine holds its end now; the harness keeps only its own."""
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    def docker_mount(self) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """A container's env and volumes: the monitor file read-only, and the directory of the socket this
        harness listens on (the only thing in it)."""
        if not self.enabled:
            return {}, {}
        self.mode = "docker"
        # A Unix socket path has at most 107 bytes: a private directory under /tmp, not the run dir.
        sock_dir = Path(tempfile.mkdtemp(prefix="qualify-monitor-"))
        os.chmod(sock_dir, 0o755)
        self._sock_dir = sock_dir
        path = sock_dir / "monitor.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)  # the container's uid may differ
        listener.listen(4)
        self._listener = listener
        env = {SOCKET_ENV: f"{CONTAINER_SOCKET_DIR}/monitor.sock"}
        volumes = {
            str(MONITOR_FILE.parent): {"bind": CONTAINER_DIR, "mode": "ro"},
            str(sock_dir): {"bind": CONTAINER_SOCKET_DIR, "mode": "rw"},
        }
        return env, volumes

    def _replace(self, sock: socket.socket | None) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._buf = sock, b""
        if sock is not None:
            self.boots += 1
            self.hello, self.lost = None, None
        elif not self.enabled:
            self.lost = f"the monitor is switched off ({SWITCH_ENV}=off)"

    def _accept(self, timeout_s: float) -> None:
        """Docker: the newest connection is the current engine's monitor (a restarted container
        reconnects)."""
        if self._listener is None:
            return
        while True:
            ready, _, _ = select.select([self._listener], [], [], timeout_s if self._sock is None else 0)
            if not ready:
                return
            conn, _ = self._listener.accept()
            self._replace(conn)

    def close(self) -> None:
        with self._lock:
            self._replace(None)
            if self._listener is not None:
                with contextlib.suppress(OSError):
                    self._listener.close()
                self._listener = None
            if self._sock_dir is not None:
                shutil.rmtree(self._sock_dir, ignore_errors=True)
                self._sock_dir = None
            if self._child is not None:
                self._child.close()
                self._child = None

    # ------------------------------------------------------------ reading
    def _read_message(self, deadline: float) -> dict[str, Any] | None:
        sock = self._sock
        while sock is not None:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    self.lost = "the monitor sent a line that is not JSON"
                    return None
                return msg if isinstance(msg, dict) else None
            if len(self._buf) > MAX_LINE_BYTES:
                self.lost = f"the monitor sent a message over {MAX_LINE_BYTES} bytes"
                self._replace_keep_state()
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([sock], [], [], left)
            if not ready:
                return None
            try:
                chunk = sock.recv(1 << 20)
            except OSError as exc:
                chunk, self.lost = b"", f"the monitor channel failed: {exc}"
            if not chunk:
                self.lost = self.lost or "the monitor closed its channel"
                self._replace_keep_state()
                return None
            self._buf += chunk
        return None

    def _replace_keep_state(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None

    def _ensure_hello(self, timeout_s: float) -> None:
        if self.mode == "docker":
            self._accept(timeout_s)
        if self.hello is not None or self._sock is None:
            return
        msg = self._read_message(time.monotonic() + timeout_s)
        if msg is not None and msg.get("t") == "hello":
            self.hello = msg
        elif self.lost is None:
            self.lost = "no hello from the monitor" if msg is None else f"first message was {msg.get('t')!r}"

    # ------------------------------------------------------------ windows
    def window(self, label: str, timeout_s: float = WINDOW_TIMEOUT_S) -> Window:
        return Window(self, label, timeout_s)

    def _open(self, label: str, timeout_s: float) -> int:
        with self._lock:
            self._next += 1
            w = self._next
            self._ensure_hello(HELLO_TIMEOUT_S)
            if self._sock is not None and self.lost is None:
                try:
                    self._sock.sendall(json.dumps({"t": "open", "w": w}).encode() + b"\n")
                    deadline = time.monotonic() + timeout_s
                    while True:  # a late report of an earlier window may come first: skip it
                        msg = self._read_message(deadline)
                        if msg is None or (msg.get("t") == "opened" and msg.get("w") == w):
                            break
                    if msg is None:
                        self.lost = self.lost or f"window {w} ({label}) was not opened by the monitor"
                except OSError as exc:
                    self.lost = f"the monitor channel failed: {exc}"
            return w

    def _close(self, w: int, label: str, timeout_s: float) -> dict[str, Any]:
        with self._lock:
            report: dict[str, Any] | None = None
            if self._sock is not None and self.lost is None:
                try:
                    self._sock.sendall(json.dumps({"t": "close", "w": w}).encode() + b"\n")
                    deadline = time.monotonic() + timeout_s
                    while report is None:
                        msg = self._read_message(deadline)
                        if msg is None:
                            break
                        if msg.get("t") == "window" and msg.get("w") == w:
                            report = msg
                except OSError as exc:
                    self.lost = f"the monitor channel failed: {exc}"
            if report is None:
                why = self.lost or f"window {w} ({label}) did not come back within {timeout_s:g} s"
                if not self.enabled:
                    why = f"the monitor is switched off ({SWITCH_ENV}=off)"
                elif self.mode is None:
                    why = "this launcher does not start the monitor"
                report = {"t": "window", "w": w, "missing": why}
            report["label"] = label
            report["boot"] = self.boots
            if len(self.windows) < MAX_WINDOWS:
                self.windows.append(report)
                self._save(report)
            return report

    def _save(self, report: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with (self.run_dir / "monitor.jsonl").open("a") as f:
                f.write(json.dumps(report, separators=(",", ":")) + "\n")

    def status(self) -> dict[str, Any]:
        """What the receipt says about the monitor itself."""
        return {
            "enabled": self.enabled,
            "mode": self.mode,
            "boots": self.boots,
            "hello": self.hello,
            "lost": self.lost,
            "windows": len(self.windows),
        }


class Window:
    """`with monitor.window("graph n=2 T=4") as w: ...requests...` then `w.report`."""

    def __init__(self, monitor: EngineMonitor, label: str, timeout_s: float) -> None:
        self.monitor, self.label, self.timeout_s = monitor, label, timeout_s
        self.report: dict[str, Any] = {}
        self._w = 0

    def __enter__(self) -> Window:
        self._w = self.monitor._open(self.label, self.timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        self.report = self.monitor._close(self._w, self.label, self.timeout_s)
