"""No module of the project changes the process environment when it is imported (one that did once made
every later test in the process run Triton under its interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "qualify", "receipts", "bench")

# Imports every module of PACKAGES in turn (third-party libraries that may touch the environment
# themselves are imported before the baseline) and prints {module: [changed variables]} for any culprit.
PROBE = r"""
import importlib, json, os, pkgutil, sys
for lib in ("torch", "triton", "sqlalchemy", "pydantic", "click"):
    try:
        importlib.import_module(lib)
    except Exception:
        pass
names = []
for pkg in sys.argv[1:]:
    path = os.path.join(os.getcwd(), pkg)
    names.append(pkg)
    for m in pkgutil.walk_packages([path], prefix=pkg + "."):
        names.append(m.name)
changed, failed = {}, {}
for name in sorted(set(names)):
    if name.rsplit(".", 1)[-1] == "__main__" or name.startswith("bench.results"):
        continue
    before = dict(os.environ)
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"[:200]
    after = dict(os.environ)
    diff = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if diff:
        changed[name] = diff
print(json.dumps({"changed": changed, "failed": failed, "count": len(names)}))
"""


def probe(*packages: str, cwd: Path = ROOT) -> dict:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *packages],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_project_module_changes_the_environment_at_import() -> None:
    result = probe(*PACKAGES)
    assert result["count"] > 50  # the walk found the packages' modules
    assert result["failed"] == {}  # a module that cannot be imported here would go unchecked
    assert result["changed"] == {}


def test_the_probe_names_a_module_that_sets_a_variable_at_import(tmp_path: Path) -> None:
    pkg = tmp_path / "culprit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clean.py").write_text("X = 1\n")
    (pkg / "dirty.py").write_text('import os\nos.environ.setdefault("QUALIFY_PROBE_CANARY", "1")\n')
    result = probe("culprit", cwd=tmp_path)
    assert result["changed"] == {"culprit.dirty": ["QUALIFY_PROBE_CANARY"]}
