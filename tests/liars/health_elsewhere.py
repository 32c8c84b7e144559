"""Liar: /health names a pid that is not the process serving the engine (a number a supervisor or a proxy
in front of the real server could report). Everything else is honest. Caught by boot's
`health_pid_is_the_serving_process`: the pid, mapped through /proc, is no process of the launched tree."""

from __future__ import annotations

import os

from qualify.engine import server as server_module
from qualify.engine.__main__ import main
from tests.liars._pid import report_pid

report_pid(server_module, lambda: os.getpid() + 7919)

if __name__ == "__main__":
    main()
