"""Liar: the process /health names changes during the run. At boot it names itself (the server holding the
listener); from the reload check's reloads on (its second reload: the boot check reloads the handed weights
first) it names a helper process it started at boot, which stays in the launched tree and serves nothing,
as a supervisor that handed serving to another worker would. Caught by the faults check's
`same_serving_process_as_at_boot`."""

from __future__ import annotations

import os
import subprocess

from qualify.engine import engine as engine_module
from qualify.engine import server as server_module
from qualify.engine.__main__ import main
from tests.liars._pid import report_pid

_reload = engine_module.Engine.reload
HELPER = subprocess.Popen(["sleep", "3600"])  # noqa: S603,S607  (dies with the sandbox)
STATE = {"reloads": 0}


def _counting_reload(self, *args, **kwargs):  # noqa: ANN001,ANN002,ANN003
    STATE["reloads"] += 1
    return _reload(self, *args, **kwargs)


report_pid(server_module, lambda: HELPER.pid if STATE["reloads"] > 1 else os.getpid())
engine_module.Engine.reload = _counting_reload

if __name__ == "__main__":
    main()
