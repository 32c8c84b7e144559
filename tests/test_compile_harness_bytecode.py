"""scripts/compile-harness-bytecode: the bytecode an installed harness has, for every package the run's
modules import (whole packages, not the standard library), compiled where each lies."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "compile-harness-bytecode"
    loader = importlib.machinery.SourceFileLoader("compile_harness_bytecode", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_the_packages_are_the_runs_third_party_and_own_ones_not_the_standard_librarys() -> None:
    # in a process of its own: what the run's modules import, not what this test process has imported
    script = str(ROOT / "scripts" / "compile-harness-bytecode")
    code = f"import json, runpy; print(json.dumps(runpy.run_path({script!r})['packages']()))"
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)
    found = {Path(p).name for p in json.loads(out.stdout)}
    assert {"sqlalchemy", "pydantic", "click", "qualify", "receipts"} <= found
    assert not {"json", "asyncio", "email", "torch"} & found  # the standard library; the engine's torch


def test_a_package_without_bytecode_gets_it_for_every_module_even_one_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site"
    (site / "wheelpkg" / "later").mkdir(parents=True)
    (site / "wheelpkg" / "__init__.py").write_text("X = 1\n")
    (site / "wheelpkg" / "later" / "__init__.py").write_text("")
    (site / "wheelpkg" / "later" / "mod.py").write_text("Y = 2\n")  # imported later in a run, not at start
    (site / "single.py").write_text("import wheelpkg\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE: importing writes none
    script = _script()
    monkeypatch.setattr(script, "RUN_MODULES", ("single",))
    assert not list(site.rglob("*.pyc"))
    assert script.main() == 0
    compiled = {p.name.split(".")[0] for p in site.rglob("*.pyc")}
    assert {"__init__", "mod", "single"} <= compiled
    # only what the run's modules brought in: here the two packages, none this test process had before
    assert "for 2 packages" in capsys.readouterr().out
    for name in ("single", "wheelpkg"):
        sys.modules.pop(name, None)
