"""Engines that reach for the harness's trust domain, through the real `qualify run` path (local launcher,
tiny preset, CPU, bubblewrap sandbox): reading the operator's key, planting a sitecustomize.py where the
peer would import it, loading code from outside the hashed tree, booting other weights than the handed
file, shipping bytecode that differs from its hashed source. Each attempt fails or is caught, and the
receipt names what ran (docs/SANDBOX.md)."""

from __future__ import annotations

import base64
import importlib.util
import json
import marshal
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.launch.sandbox import SANDBOX_UID, ns_pids

from .conftest import LAYOUT, ROOT, Home, check

pytestmark = pytest.mark.slow


def _liar_env(home: Home, module: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return home.env(QUALIFY_ENGINE_MODULE=f"tests.liars.{module}", PYTHONPATH=path, **extra)


def _engine_log(home: Home) -> str:
    (log,) = home.path.glob("runs/*/engine.log")
    return log.read_text(errors="replace")


def _statement(home: Home) -> dict:
    (f,) = home.path.glob("runs/*/receipt.dsse.json")
    return json.loads(base64.b64decode(json.loads(f.read_text())["payload"]))


def test_an_engine_cannot_read_the_operator_key_or_reach_the_store(home: Home) -> None:
    key, db = home.path / "keys" / "operator.key", home.db
    added = ["--engine-env", f"LIAR_KEY={key}", "--engine-env", f"LIAR_DB={db}"]
    ran = home.qualify("run", "--layout", LAYOUT, "--json", *added, env=_liar_env(home, "steal_key"))
    assert key.is_file()  # the key exists: the engine just cannot reach it
    log = _engine_log(home)
    assert "LIAR_KEY_READ refused: FileNotFoundError" in log, log[-3000:]
    assert "LIAR_STORE_WRITE refused" in log and "LIAR_HOME_LIST refused" in log
    assert "LIAR_KEY_READ ok" not in log
    # What the engine was refused is in the receipt: the data dir and the checkout are not in its sandbox.
    assert ran.code == 0, ran.stderr[-2000:]
    p = _statement(home)["predicate"]
    sb = p["engine"]["sandbox"]
    assert sb["enabled"] and any(str(home.path) in a for a in sb["absent"])
    assert not any(str(home.path) in m for m in sb["code_mounts"])
    assert p["request"]["engine_env"] == {"LIAR_DB": str(db), "LIAR_KEY": str(key)}
    assert sb["env"]["LIAR_KEY"] == str(key) and "QUALIFY_ENGINE_MODULE" not in sb["env"]
    (only,) = home.predicates()  # the store holds the harness's receipt and nothing else
    assert only["verdict"] == "qualified" and home.verify_all().code == 0


def test_an_engine_that_plants_a_sitecustomize_for_the_peer_is_refused_and_rejected(home: Home) -> None:
    added = ["--engine-env", f"LIAR_HOME={home.path}"]
    ran = home.qualify(
        "run", "--layout", LAYOUT, "--fail-fast", "--json", *added, env=_liar_env(home, "plant_sitecustomize")
    )
    log = _engine_log(home)
    for where in ("project_root", "data_dir", "site_packages", "peer_folder"):
        assert f"LIAR_PLANT {where} refused" in log, log[-3000:]
    assert "LIAR_PLANT" in log and " ok: " not in "".join(ln for ln in log.splitlines() if "LIAR_PLANT" in ln)
    assert not (ROOT / "sitecustomize.py").exists() and not (home.path / "sitecustomize.py").exists()
    # The peer (python -I, the harness's own code) measured the real geometry: rejected.
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "rejected" and "layout: fail" in s["reasons"]
    peer = check(home.predicates()[0], "layout")["evidence"]
    assert "planted" not in json.dumps(peer)


def _hook(tmp: Path) -> Path:
    d = tmp / "outside"
    d.mkdir()
    (d / "qualify_outside_hook.py").write_text(
        "from qualify.engine import model as m\n"
        "_forward = m.DecoderLayer.forward\n"
        "def forward(self, x, ctx, decode):\n"
        "    return x if self.kind == 'A' else _forward(self, x, ctx, decode)\n"
        "m.DecoderLayer.forward = forward\n"
    )
    return d


def test_code_from_outside_the_sandbox_is_not_loaded_and_the_code_subject_is_the_liars(
    home: Home, tmp_path: Path
) -> None:
    hook = _hook(tmp_path)
    env = _liar_env(home, "outside_code")
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{hook}"  # on the operator's path, as a plugin would be
    ran = home.qualify("run", "--layout", LAYOUT, "--json", "--engine-env", f"LIAR_HOOK_DIR={hook}", env=env)
    log = _engine_log(home)
    assert "LIAR_HOOK refused: ModuleNotFoundError" in log and "LIAR_HOOK ok" not in log, log[-3000:]
    assert ran.code == 0, ran.stderr[-2000:]
    p = _statement(home)["predicate"]
    scope = p["engine"]["code_scope"]
    assert str(ROOT / "tests" / "liars") in scope  # the liar's whole package is in the code subject
    assert str(hook) not in " ".join(p["engine"]["sandbox"]["code_mounts"])
    honest = Home(tmp_path / "honest")
    ran2 = honest.qualify("run", "--layout", LAYOUT, "--json", env=honest.env())
    assert ran2.code == 0, ran2.stderr[-2000:]
    code = {s["name"].rsplit("-", 1)[1]: s["digest"]["sha256"] for s in ran.summary()["subjects"]}
    code2 = {s["name"].rsplit("-", 1)[1]: s["digest"]["sha256"] for s in ran2.summary()["subjects"]}
    assert code["code"] != code2["code"]  # another module ran: another code subject
    assert code["weights"] == code2["weights"]  # the same handed file


def test_unsandboxed_the_outside_hook_loads_and_the_receipt_says_no_sandbox(
    home: Home, tmp_path: Path
) -> None:
    hook = _hook(tmp_path)
    env = _liar_env(home, "outside_code")
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{hook}"
    home.qualify("run", "--layout", LAYOUT, "--json", "--no-sandbox", env=env)
    assert "LIAR_HOOK ok" in _engine_log(home)  # what the sandbox prevents
    p = _statement(home)["predicate"]
    assert p["request"]["sandbox"] is False and p["engine"]["sandbox"]["enabled"] is False
    assert p["engine"]["code_scope"].startswith("UNSANDBOXED")


def test_an_engine_that_boots_other_weights_than_the_handed_file_is_rejected(home: Home) -> None:
    env = _liar_env(home, "other_weights")
    ran = home.qualify("run", "--layout", LAYOUT, "--fail-fast", "--json", env=env)
    assert "LIAR_OTHER_WEIGHTS booted" in _engine_log(home)
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "rejected" and "boot: fail" in s["reasons"]
    boot = check(home.predicates()[0], "boot")
    cond = boot["conditions"]
    assert cond["engine_names_handed_weights"]["holds"]  # its word is right...
    assert not cond["handed_weights_reload_keeps_output"]["holds"]  # ...its output is not
    assert cond["handed_weights_reload_keeps_output"]["source"] == "observed"
    ev = boot["evidence"]["handed_weights_reload"]
    assert ev["before"] != ev["after"]


def test_the_engine_runs_as_another_uid_in_its_own_namespaces(home: Home) -> None:
    ran = home.qualify("run", "--layout", LAYOUT, "--json")
    assert ran.code == 0, ran.stderr[-2000:]
    p = _statement(home)["predicate"]
    boot = check(p, "boot")["evidence"]
    sb = p["engine"]["sandbox"]
    assert boot["pid"] != boot["launcher_pid"]  # its own pid namespace: /health says 2
    assert sb["identity"].startswith(f"host uid {SANDBOX_UID}" if os.geteuid() == 0 else f"uid {SANDBOX_UID}")
    assert set(sb["env"]) <= {
        "HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "PYTHONPYCACHEPREFIX",
        "QUALIFY_HOME", "TMPDIR", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
    }  # fmt: skip
    assert ns_pids(os.getpid()) is not None


PLANTED = """import sys
print("LIAR_PYC ran", file=sys.stderr, flush=True)
from qualify.engine import model as m
_forward = m.DecoderLayer.forward
def forward(self, x, ctx, decode):
    return x if self.kind == "A" else _forward(self, x, ctx, decode)
m.DecoderLayer.forward = forward
"""


def _planted_bytecode_engine(site: Path) -> Path:
    """An engine package whose `lie.py` is an empty, honest source, beside a __pycache__ file that Python
    accepts for it (its header names the source's mtime and size) holding other code: it announces itself
    and skips every attention layer. The code digest covers the source, never __pycache__."""
    pkg = site / "pyc_liar"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lie.py").write_text('"""Nothing here: the honest source."""\n')
    (pkg / "__main__.py").write_text(
        "from pyc_liar import lie  # noqa: F401\nfrom qualify.engine.__main__ import main\n\nmain()\n"
    )
    st = (pkg / "lie.py").stat()
    header = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size)
    code = compile(PLANTED, str(pkg / "lie.py"), "exec")
    planted = pkg / "__pycache__" / f"lie.{sys.implementation.cache_tag}.pyc"
    planted.write_bytes(header + marshal.dumps(code))
    return pkg


def test_bytecode_planted_beside_an_honest_source_never_runs_in_the_sandbox(
    home: Home, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    _planted_bytecode_engine(site)
    # Outside the sandbox Python runs the planted bytecode, not the source the digest covers.
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    plain["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    probe = subprocess.run(
        [sys.executable, "-c", "import pyc_liar.lie"], env=plain, capture_output=True, text=True, timeout=120
    )
    assert "LIAR_PYC ran" in probe.stderr, probe.stderr[-2000:]
    ran = home.qualify("run", "--layout", LAYOUT, "--json", env=home.foreign_env("pyc_liar", site))
    log = _engine_log(home)
    # In the sandbox the engine reads only the harness's bytecode, compiled from the hashed source.
    assert "LIAR_PYC ran" not in log, log[-3000:]
    assert ran.code == 0, ran.stderr[-2000:]
    sb = _statement(home)["predicate"]["engine"]["sandbox"]
    assert sb["env"]["PYTHONPYCACHEPREFIX"] == "/qualify/pycache" and "PYTHONPYCACHEPREFIX" in sb["bytecode"]
