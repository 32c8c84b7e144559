"""What the benchmarks share: timing contenders in interleaved rounds, where a result comes from
(commit, script, command, device, versions), and writing the JSON result."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"torch": "torch", "triton": "triton", "fla": "fla-core", "b12x": "b12x"}


def interleaved_medians(
    contenders: dict[str, Callable[[], dict[str, list[float]]]], rounds: int
) -> dict[str, dict[str, float]]:
    """Run each contender's measurement once per round, the order rotating every round, so that clock
    ramps and a neighbour's cache state fall on every contender alike rather than on whoever runs first.
    A measurement returns samples per measure name; the result is each measure's median over all rounds."""
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in contenders}
    labels = list(contenders)
    for r in range(rounds):
        shift = r % len(labels)
        for k in labels[shift:] + labels[:shift]:
            for measure, xs in contenders[k]().items():
                samples[k].setdefault(measure, []).extend(xs)
    return {k: {m: statistics.median(xs) for m, xs in ms.items()} for k, ms in samples.items()}


def with_settings(
    module: object, settings: dict[str, object], fn: Callable[[], object]
) -> Callable[[], object]:
    """fn run with the module's constants set as given, restored after each call (a variant timed beside
    the default: a kernel module's switches are read at launch, so a captured graph keeps them)."""

    def call() -> object:
        saved = {name: getattr(module, name) for name in settings}
        try:
            for name, value in settings.items():
                setattr(module, name, value)
            return fn()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return call


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit() -> dict[str, object]:
    """The commit whose code produced the result: BENCH_COMMIT where it is set (scripts/gpu-check passes
    it on when the tree travelled to the GPU machine as a copy, possibly inside another checkout), else
    the HEAD of the git checkout whose root is this tree, with whether its code was modified."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "commit_source": "BENCH_COMMIT"}
    top = _git("rev-parse", "--show-toplevel")
    head = _git("rev-parse", "HEAD")
    if top and head and os.path.realpath(top) == os.path.realpath(ROOT):
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
        return {"commit": head, "commit_source": "git", "modified": bool(dirty)}
    return {"commit": None, "commit_source": "none: no BENCH_COMMIT and no git checkout rooted here"}


def device() -> dict[str, object]:
    """The GPU (through torch, only if the script already imported it) and driver, else the CPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        d: dict[str, object] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
        }
        try:
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            d["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            d["driver"] = f"unknown: {e}"
        return d
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, object] = {"name": platform.processor() or platform.machine(), "cpus": cpus}
    try:  # a script that runs the GPU through other processes (qualify run) names it without torch
        q = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        gpus = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        if gpus:
            out["gpus"] = gpus
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name, dist in PACKAGES.items():
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def provenance(argv: list[str] | None = None) -> dict[str, object]:
    """Where a result comes from: commit, the script (path in the repository), the exact command, the
    wrapper that ran it (scripts/gpu-check sets BENCH_COMMAND), date, device, driver and versions."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    return {
        **commit(),
        "script": script,
        "command": shlex.join(["python", script, *argv[1:]]),
        "invoked_by": os.environ.get("BENCH_COMMAND") or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "device": device(),
        "versions": versions(),
    }


def write_result(result: dict, out: str | None, *, indent: int = 2, echo: bool = True) -> None:
    """Print `result`, headed by its provenance, as JSON; with `out`, write the same text there. echo=False
    writes `out` only (a partial result rewritten as a run goes, printed once at its end)."""
    text = json.dumps({"provenance": provenance(), **result}, indent=indent, default=str)
    if echo:
        print(text)
    if out:
        folder = os.path.dirname(out)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
