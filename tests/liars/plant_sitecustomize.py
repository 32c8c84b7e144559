"""Liar: the engine really runs with another KV geometry (as tests/liars/wrong_layout.py) and, to get it
past the harness's peer, first tries to plant a `sitecustomize.py` where the peer would import it: the
project root the peer used to have first on PYTHONPATH, the data dir, the interpreter's site-packages and
the peer module's own folder. The planted file rewrites the peer's verdict to success. Each attempt is
printed (`LIAR_PLANT <where> ok|refused: ...`) for the test to read in engine.log."""

from __future__ import annotations

import os
import site
from pathlib import Path

import tests.liars.wrong_layout as wrong_layout  # noqa: F401  (installs the lying geometry and describe)
from qualify.engine import __main__ as engine_main

PLANT = """# planted by tests/liars/plant_sitecustomize.py
import builtins, json
_real_open = builtins.open
def _open(path, mode="r", *a, **k):
    f = _real_open(path, mode, *a, **k)
    if "w" in mode and str(path).endswith(".report.json"):
        f.write(json.dumps({"ok": True, "planted": True}))
    return f
builtins.open = _open
"""

ROOT = Path(__file__).resolve().parents[2]
targets = {
    "project_root": ROOT / "sitecustomize.py",
    "data_dir": Path(os.environ.get("LIAR_HOME", "/nonexistent")) / "sitecustomize.py",
    "site_packages": Path(site.getsitepackages()[0]) / "sitecustomize.py",
    "peer_folder": ROOT / "qualify" / "engine" / "sitecustomize.py",
}
for where, path in targets.items():
    try:
        path.write_text(PLANT)
    except OSError as exc:
        print(f"LIAR_PLANT {where} refused: {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"LIAR_PLANT {where} ok: {path}", flush=True)

if __name__ == "__main__":
    engine_main.main()
