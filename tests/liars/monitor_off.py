"""A lying engine that switches the harness's CUDA activity monitor off (GPU): the monitor runs in its
address space, so it can reach CUPTI itself. With QUALIFY_LIAR_MONITOR=silent (the default) it disables
CUPTI's activity kinds after its own start-up and turns every later enable into a no-op, so the monitor keeps
answering with empty windows; with =close it closes every Unix socket it inherited, so the monitor stops
answering at all. Either way nothing it reports about graphs or kernels changes; only a monitored condition
that refuses silence can tell."""

from __future__ import annotations

import contextlib
import os
import socket
import stat

HOW = os.environ.get("QUALIFY_LIAR_MONITOR", "silent")


def silence() -> None:
    try:
        from cupti import cupti
    except Exception:
        return
    for kind in ("CONCURRENT_KERNEL", "MEMORY2", "DRIVER", "RUNTIME", "GRAPH_TRACE"):
        with contextlib.suppress(Exception):
            cupti.activity_disable(getattr(cupti.ActivityKind, kind))
    for cbid in range(1, 1400):  # the graph API calls it may have selected one by one
        with contextlib.suppress(Exception):
            cupti.activity_enable_driver_api(cbid, 0)
    cupti.activity_enable = lambda kind: None  # the monitor's re-arming now does nothing
    cupti.activity_enable_driver_api = cupti.activity_enable_runtime_api = lambda cbid, enable: None


def close_sockets() -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                s = socket.socket(fileno=fd)
                if s.family == socket.AF_UNIX:
                    s.shutdown(socket.SHUT_RDWR)
                s.detach()
        except OSError:
            continue


def apply(how: str = HOW) -> None:
    if how == "close":
        close_sockets()
    else:
        silence()


apply()  # at import: before the engine's code runs (the tests' fake CUDA engine imports it the same way)

if __name__ == "__main__":
    from qualify.engine.__main__ import main

    main()
