"""`qualify run` on the proxy preset with the local launcher, timed end to end; its JSON report and the
wall time are written to --out with the run's provenance."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402

CLI = ["-m", "qualify.cli", "run", "--layout", "2304,2304,2304,9216", "--preset", "proxy", "--json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is stopped")
    args = ap.parse_args()
    cmd = [sys.executable, *CLI]
    start = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        sys.exit(f"qualify run did not finish within {args.timeout:.0f} s")
    wall = time.perf_counter() - start
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        sys.exit(f"qualify run exited {r.returncode} without a JSON report: {r.stderr.strip()[-500:]}")
    result = {
        "bench": "qualify_run",
        "cli": " ".join(["python", *CLI]),
        "exit_code": r.returncode,
        "wall_s": round(wall, 2),
        "run": report,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
