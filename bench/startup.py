"""CLI start-up time: wall time of `qualify --help` and of simple read commands, each run as a fresh
process (the installed `qualify` entry point) against a small SQLite store made for the run. The target
is 0.3 s for `--help`, `--version` and group help (command modules are imported lazily, see qualify/cli.py);
read commands that open the store are measured beside them (they import SQLAlchemy and the store).

    python bench/startup.py                       # 15 runs of each, the median reported
    python bench/startup.py --runs 30 --out bench/results/startup.json

Wall time is the target; the CPU time of each process is recorded beside it, since on a shared machine
the wall time also counts waiting for a core (the load average is recorded too).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402

TARGET_S = 0.3
# (label, argv, held to the target)
COMMANDS = [
    ("--help", ["--help"], True),
    ("--version", ["--version"], True),
    ("receipts --help", ["receipts", "--help"], True),
    ("keys --help", ["keys", "--help"], True),
    ("log --help", ["log", "--help"], True),
    ("approve --help", ["approve", "--help"], True),
    ("keys export-public", ["keys", "export-public"], True),
    ("keys list", ["keys", "list"], False),
    ("receipts list", ["receipts", "list"], False),
    ("log checkpoint", ["log", "checkpoint"], False),
]


def _qualify() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "qualify")
    return here if os.path.exists(here) else (shutil.which("qualify") or "qualify")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    exe = _qualify()
    home = tempfile.mkdtemp(prefix="qualify-bench-startup-")
    env = {**os.environ, "QUALIFY_HOME": home}
    env.pop("QUALIFY_DB_URL", None)
    try:
        subprocess.run([exe, "keys", "generate"], env=env, check=True, capture_output=True, timeout=120)
        results = {}
        for label, argv, held in COMMANDS:
            subprocess.run([exe, *argv], env=env, capture_output=True, timeout=120)  # warm the file cache
            samples, cpu = [], []
            for _ in range(args.runs):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                done = subprocess.run([exe, *argv], env=env, capture_output=True, timeout=120)
                samples.append(time.perf_counter() - t0)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                if done.returncode != 0:
                    raise SystemExit(f"{label} failed: {done.stderr.decode()[-400:]}")
            median = statistics.median(samples)
            results[label] = {
                "median_s": round(median, 3),
                "min_s": round(min(samples), 3),
                "max_s": round(max(samples), 3),
                # CPU time of the process (user + system): what the start-up costs, less sensitive than
                # wall time to other work on a shared machine (see load_average_1m_before_end).
                "cpu_median_s": round(statistics.median(cpu), 3),
                "target_s": TARGET_S if held else None,
                "meets_target": (median <= TARGET_S) if held else None,
            }
        load = os.getloadavg()
        write_result(
            {
                "runs": args.runs,
                "entry_point": os.path.relpath(exe, ROOT) if exe.startswith(ROOT) else exe,
                "load_average_1m_before_end": round(load[0], 2),
                "commands": results,
            },
            args.out,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
