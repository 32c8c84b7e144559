"""A fake CUDA engine for the monitor's CPU tests: run by the monitor file as the engine module, it
"launches" kernels through tests/harness/fake_cupti (a graph replay of three kernels, an eager argmax,
a cuGraphLaunch call and, once, an allocation) every few milliseconds until its channel or its parent goes.

FAKE_CUDA_NAMES=N launches N distinct eager kernels per tick (the monitor's bounds); QUALIFY_LIAR_MONITOR
(silent | close) applies tests/liars/monitor_off.py's lie first, exactly as that liar does."""

from __future__ import annotations

import os
import time

from cupti import cupti

if os.environ.get("QUALIFY_LIAR_MONITOR"):
    import tests.liars.monitor_off  # noqa: F401  (its lie happens at import)

LIFETIME_S = 30.0


def main() -> None:
    names = int(os.environ.get("FAKE_CUDA_NAMES", "0"))
    cupti.memory(1 << 20)
    end = time.monotonic() + LIFETIME_S
    while time.monotonic() < end and os.getppid() != 1:
        cupti.api(501)
        for node, name in enumerate(("_kda_decode_kernel", "rmsnorm", "linear_small"), start=1):
            cupti.kernel(name, graph=42, node=node)
        cupti.kernel("argmax")
        for i in range(names):
            cupti.kernel(f"k{i}")
        time.sleep(0.005)


if __name__ == "__main__":
    main()
