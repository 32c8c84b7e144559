"""The launched engine's process tree as the kernel keeps it (/proc), sampled by the harness during the run.

A restart the launcher cannot see (a supervisor inside the launched process that re-forks a crashed worker
under the same pid) still leaves marks in /proc: the worker that served at boot ends, and a process with the
same parent and command line takes its place, with a later start time. The harness samples the tree (the
launched pid and every descendant, each keyed by pid and start time, so a reused pid is another process) in
a bounded background thread and at check boundaries, and counts such replacements as restarts. Processes
present from boot that stay (DCP follower ranks, a sandbox's init) are expected; short-lived helpers that
come and go (a compiler the JIT runs) replace nothing, so neither counts.

Pids inside a pid namespace (a sandbox's, a container's) are not the harness's: `NSpid:` in
/proc/PID/status lists a process's pid in each namespace it belongs to, the last being its own view
(getpid()), so `resolve_ns_pid` maps a pid the engine reports (`/health`, DCP ranks) onto a host process of
the launched tree.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

SAMPLE_INTERVAL_S = 0.5
MAX_PROCESSES = 4096  # distinct (pid, start) records kept; the evidence says when more were seen
LONG_LIVED_S = 1.0  # a process seen across this long (or present at boot) is a worker, not a passing helper
MAX_CMDLINE = 512


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it: start is in clock ticks since boot (field 22 of stat), cpu_ticks
    utime + stime; nspid its pid in each pid namespace, outermost (the harness's) first."""

    pid: int
    ppid: int
    start: int
    state: str
    comm: str
    cmdline: str
    nspid: tuple[int, ...]
    cpu_ticks: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    @property
    def inner_pid(self) -> int:
        return self.nspid[-1] if self.nspid else self.pid


def read_proc(pid: int, root: str = "/proc") -> Proc | None:
    """The process `pid`, or None when it is gone (or /proc cannot say)."""
    try:
        with open(f"{root}/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    head, paren, rest = raw.rpartition(")")
    if not paren:
        return None
    f = rest.split()
    try:
        ppid, utime, stime, start = int(f[1]), int(f[11]), int(f[12]), int(f[19])
    except (IndexError, ValueError):
        return None
    comm = head.partition("(")[2]
    nspid: tuple[int, ...] = (pid,)
    with contextlib.suppress(OSError, ValueError), open(f"{root}/{pid}/status") as s:
        for line in s:
            if line.startswith("NSpid:"):
                nspid = tuple(int(x) for x in line.split()[1:]) or (pid,)
                break
    cmdline = ""
    with contextlib.suppress(OSError), open(f"{root}/{pid}/cmdline", "rb") as c:
        cmdline = c.read(MAX_CMDLINE).replace(b"\0", b" ").decode(errors="replace").strip()
    return Proc(pid, ppid, start, f[0], comm, cmdline, nspid, utime + stime)


def all_procs(root: str = "/proc") -> dict[int, Proc]:
    out: dict[int, Proc] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            p = read_proc(int(name), root)
            if p is not None:
                out[p.pid] = p
    return out


def tree(root_pid: int, procs: dict[int, Proc]) -> dict[int, Proc]:
    """`root_pid` and its descendants among `procs` (zombies included: an exited child not yet reaped)."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out: dict[int, Proc] = {}
    todo = [root_pid] if root_pid in procs else []
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out[pid] = procs[pid]
        todo.extend(children.get(pid, []))
    return out


def snapshot(root_pid: int, root: str = "/proc") -> dict[int, Proc]:
    """The launched process and its descendants now."""
    return tree(root_pid, all_procs(root))


def resolve_ns_pid(ns_pid: int, procs: Iterable[Proc]) -> list[Proc]:
    """The processes among `procs` (a launched tree) whose own view of their pid is `ns_pid`: NSpid's last
    field; without namespaces that is the host pid."""
    return [p for p in procs if p.inner_pid == ns_pid]


@dataclass
class Seen:
    proc: Proc
    root: tuple[int, int]  # the launched process it was seen under
    first: float
    last: float
    samples: int = 1
    at_boot: bool = False
    ended: float | None = None  # monotonic time of the first sample it was missing from (or a zombie in)
    gpu: bool = False

    def long_lived(self) -> bool:
        return self.at_boot or (self.samples >= 2 and self.last - self.first >= LONG_LIVED_S)

    def to_evidence(self, t0: float) -> dict[str, Any]:
        p = self.proc
        return {
            "pid": p.pid,
            "ns_pid": p.inner_pid,
            "ppid": p.ppid,
            "start_ticks": p.start,
            "comm": p.comm,
            "cmdline": p.cmdline[:200],
            "at_boot": self.at_boot,
            "first_seen_s": round(self.first - t0, 3),
            "ended_s": None if self.ended is None else round(self.ended - t0, 3),
            "cpu_ticks": p.cpu_ticks,
            "on_gpu": self.gpu,
        }


@dataclass
class TreeHistory:
    """Every process seen in the launched tree, sample by sample (pure: tests feed it synthetic samples)."""

    seen: dict[tuple[int, int], Seen] = field(default_factory=dict)
    samples: int = 0
    dropped: int = 0
    baseline_taken: bool = False
    t0: float = field(default_factory=time.monotonic)
    roots: list[tuple[int, int]] = field(default_factory=list)

    def add(self, now: float, root_pid: int, procs: dict[int, Proc], gpu_pids: Iterable[int] = ()) -> None:
        self.samples += 1
        root = procs.get(root_pid)
        if root is None:
            return  # the launched process is gone: the launcher sees that itself
        rkey = root.key
        if rkey not in self.roots:
            self.roots.append(rkey)
        gpu = set(gpu_pids)
        present = set()
        for p in procs.values():
            present.add(p.key)
            s = self.seen.get(p.key)
            if s is None:
                if len(self.seen) >= MAX_PROCESSES:
                    self.dropped += 1
                    continue
                s = self.seen[p.key] = Seen(p, rkey, now, now)
            else:
                # A zombie has no command line and no NSpid left: keep what the live process showed.
                if p.state in ("Z", "X") or not p.cmdline:
                    p = replace(p, cmdline=s.proc.cmdline, nspid=s.proc.nspid)
                s.last, s.samples, s.proc = now, s.samples + 1, p
            s.gpu = s.gpu or p.pid in gpu
            if p.state in ("Z", "X") and s.ended is None:
                s.ended = now
        for s in self.seen.values():
            if s.ended is None and s.proc.key not in present and s.root == rkey:
                s.ended = now

    def mark_baseline(self) -> None:
        """What lives now is the engine as booted (call it once the engine is ready)."""
        self.baseline_taken = True
        for s in self.seen.values():
            if s.ended is None:
                s.at_boot = True

    def restarts(self) -> list[dict[str, Any]]:
        """Workers replaced under the same launched process: a long-lived process of the tree ended, and
        a later process with the same parent and command line appeared, or with the same parent and
        program that lived on itself (or, on a GPU, a later process of the tree took a GPU after a GPU
        process of it ended)."""
        out: list[dict[str, Any]] = []
        used: set[tuple[int, int]] = set()
        by_start = sorted(self.seen.values(), key=lambda s: s.first)
        for old in by_start:
            if old.ended is None or not old.long_lived() or old.proc.key == old.root:
                continue
            for new in by_start:
                if new.proc.key in used or new.root != old.root or new.proc.key == old.proc.key:
                    continue
                if new.proc.start < old.proc.start or new.first < old.first or new.at_boot:
                    continue
                parent = new.proc.ppid == old.proc.ppid
                same = parent and new.proc.cmdline == old.proc.cmdline
                # A worker started again with other arguments: the same program under the same parent,
                # living on (a helper that comes and goes is not a worker).
                again = parent and new.proc.comm == old.proc.comm and new.long_lived()
                if same or again or (old.gpu and new.gpu):
                    used.add(new.proc.key)
                    why = (
                        "same parent and command line"
                        if same
                        else "same parent and program, long-lived"
                        if again
                        else "a new GPU process of the tree"
                    )
                    out.append({
                        "ended": {"pid": old.proc.pid, "start_ticks": old.proc.start},
                        "replaced_by": {"pid": new.proc.pid, "start_ticks": new.proc.start},
                        "parent": old.proc.ppid,
                        "why": why,
                    })  # fmt: skip
                    break
        return out

    def evidence(self) -> dict[str, Any]:
        procs = sorted(self.seen.values(), key=lambda s: (s.first, s.proc.pid))
        return {
            "samples": self.samples,
            "launched": [{"pid": p, "start_ticks": s} for p, s in self.roots],
            "baseline_taken": self.baseline_taken,
            "processes": [s.to_evidence(self.t0) for s in procs[:64]],
            "processes_seen": len(procs) + self.dropped,
            "restarts": self.restarts(),
        }


class ProcessWatch:
    """Samples the launched tree every `interval_s` in a daemon thread (and whenever `sample()` is called)
    until `stop()`; `root` gives the launched pid (None: not started, or not a host process)."""

    def __init__(
        self,
        root: Callable[[], int | None],
        gpu_pids: Callable[[], dict[int, list[int]] | None] = lambda: None,
        interval_s: float = SAMPLE_INTERVAL_S,
        proc_root: str = "/proc",
    ) -> None:
        self.root, self.gpu_pids, self.interval_s, self.proc_root = root, gpu_pids, interval_s, proc_root
        self.history = TreeHistory()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = os.path.isdir(f"{proc_root}/self")

    def start(self) -> ProcessWatch:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="procs-watch", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a sampling error loses one sample, never the run
                self.sample()

    def sample(self) -> dict[int, Proc]:
        """One sample now; the tree as seen (empty when there is no launched pid)."""
        pid = self.root()
        if pid is None or not self.available:
            return {}
        procs = snapshot(pid, self.proc_root)
        gpu = self.gpu_pids() or {}
        with self._lock:
            self.history.add(time.monotonic(), pid, procs, gpu)
        return procs

    def mark_baseline(self) -> None:
        self.sample()
        with self._lock:
            self.history.mark_baseline()

    def restarts(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.history.restarts()

    def evidence(self) -> dict[str, Any]:
        with self._lock:
            out = self.history.evidence()
        out["interval_s"] = self.interval_s
        return out

    def stop(self) -> None:
        """A last sample, then the thread ends (call before the engine is stopped)."""
        with contextlib.suppress(Exception):
            self.sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
