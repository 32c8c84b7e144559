"""The engine's network namespace, entered by the harness only to open its own connections to the engine.

A sandboxed engine has a network namespace of its own (bwrap --unshare-net): loopback only, no route to
any other address, no socket of the host's reachable. The harness still speaks TCP to it on 127.0.0.1:
it holds the namespace open by a file descriptor (/proc/PID/ns/net of the sandbox's first process) and
creates each connection's socket inside it, with setns(2) on the connecting thread alone, then returns that
thread to its own namespace. A socket keeps the namespace it was made in, so nothing else of the harness
ever runs there. Entering needs CAP_SYS_ADMIN in the harness's own user namespace: a harness run as root
has it; one that is not keeps the engine on the host's network and the receipt says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
CAP_SYS_ADMIN = 21

_libc: ctypes.CDLL | None = None
_own: int | None = None  # the harness's own network namespace (the process's, opened once)
_own_lock = threading.Lock()


class NetnsError(OSError):
    """The harness could not enter (or, fatal for the thread, leave) an engine's network namespace."""


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def _own_fd() -> int:
    global _own
    with _own_lock:
        if _own is None:
            _own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return _own


def can_enter() -> bool:
    """Whether this process may setns(2) into a network namespace its sandboxes make: CAP_SYS_ADMIN in
    its effective set (root's, in the host's user namespace)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        return False
    return False


class Netns:
    """An engine's network namespace, held open by the harness (it outlives the process it came from)."""

    def __init__(self, pid: int | None, why: str = "") -> None:
        """Open pid's namespace; `pid` None: a namespace that could not be found (`why`), which every
        connection then fails to enter (never falling back to the host's network)."""
        self.pid, self.fd, self.inode, self.why = pid, None, 0, why
        if pid is None:
            return
        try:
            self.fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise NetnsError(exc.errno or errno.ESRCH, f"network namespace of pid {pid}: {exc}") from exc
        self.inode = os.fstat(self.fd).st_ino

    def is_hosts(self) -> bool:
        """True when this is in fact the harness's own namespace (the sandbox did not unshare it)."""
        return os.fstat(_own_fd()).st_ino == self.inode

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread inside this namespace for the block (sockets made there stay there)."""
        if self.fd is None:
            raise NetnsError(errno.EBADF, self.why or "the engine's network namespace was closed")
        own = _own_fd()
        _setns(self.fd)
        try:
            yield
        finally:
            _setns(own)  # never fails where the way in succeeded; if it did, the thread must not go on

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
