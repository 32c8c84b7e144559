"""The protocol is a contract another team can implement: tests/second_engine (its own model dimensions,
math, server and code, importing nothing of qualify) qualifies through the real `qualify run` path (local
launcher, CPU), plain with --layout and with --spec mtp:2, and its receipt names its own code. The harness
derived every expectation from the launch document it sent, which the receipt records with the manifest
and the protocol version. Two liars built on it are refused: one claiming the reference's code digest, one
speaking another protocol version."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from qualify.protocol import package_digest
from qualify.run.receipt import engine_code_digest_on_disk

from .conftest import DOCKER, LAYOUT, ROOT, Home, check

pytestmark = pytest.mark.slow

SECOND = ROOT / "tests" / "second_engine"


def _env(home: Home, module: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return home.env(QUALIFY_ENGINE_MODULE=module, PYTHONPATH=path)


def _installed(home: Home, tmp_path: Path, liar: str) -> dict[str, str]:
    """The environment that runs tests/liars/<liar>.py installed the way a foreign engine is: it and the
    second engine (as the top-level package `second_engine`) in a folder of their own, which the sandbox
    mounts (QUALIFY_ENGINE_PATH) and the harness finds the module in (PYTHONPATH)."""
    site = tmp_path / "site"
    if not (site / "second_engine").is_dir():
        shutil.copytree(SECOND, site / "second_engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "tests" / "liars" / f"{liar}.py", site)
    return home.foreign_env(liar, site)


def _qualified(home: Home, *args: str) -> tuple[dict, dict]:
    ran = home.qualify("run", *args, "--json", env=_env(home, "tests.second_engine"), timeout=900)
    assert ran.code == 0, ran.why()
    assert ran.summary()["verdict"] == "qualified"
    (p,) = home.predicates()[-1:]
    return p, ran.summary()


def test_the_second_engine_qualifies_with_its_own_code_its_own_dims_and_the_launch_document(home: Home):
    p, summary = _qualified(home, "--layout", LAYOUT)
    engine = p["engine"]
    own = package_digest(SECOND)
    # It claims its own tree's digest, which the harness computed too; the receipt's code subject is the
    # harness's tree digest of the sandbox's code mounts (which hold its package), never the reference's.
    boot = check(p, "boot")
    said = boot["evidence"]["code_digest"]
    assert (
        said["engine"] == said["own_tree"] == own and boot["conditions"]["code_digest_matches_disk"]["holds"]
    )
    assert engine["name"] == "second-engine" and engine["code_digest"] != engine_code_digest_on_disk()
    assert "second_engine" in engine["code_scope"], engine["code_scope"]
    assert engine["protocol_version"] == "2" and engine["manifest"]["protocol_versions"] == ["2"]
    doc = engine["launch"]
    assert engine["launch_digest"].startswith("sha256:")
    # The model dims are the engine's own, as its manifest declared them; the peer checked the caches the
    # harness derived from them (conv width 3, 3 KDA heads of 8, 2 KV heads of 8).
    assert doc["model"] == engine["manifest"]["presets"]["tiny"]
    assert doc["model"]["conv_width"] == 3 and doc["model"]["kda_heads"] == 3
    state = doc["kv_groups"][0]["views"][0]
    assert state["name"] == "state" and state["shape"][1:] == [3, 8, 8] and state["dtype"] == "float32"
    layout = check(p, "layout")
    assert layout["status"] == "pass" and layout["evidence"]["geometry"]["conv_width"] == 3
    # The weights file it loaded is the one the launch document named (its own: create true, in its
    # sandbox's scratch dir), hashed by the harness.
    assert doc["weights"]["create"] is True
    assert boot["evidence"]["weights_file"]["hashed"]
    assert Path(boot["evidence"]["weights_file"]["path"]).name == Path(doc["weights"]["path"]).name
    statuses = {c["name"]: c["status"] for c in p["checks"]}
    assert {k: v for k, v in statuses.items() if k != "monitor"} == {
        "boot": "pass", "backend": "pass", "layout": "pass", "arenas": "pass", "capture": "skip",
        "reload": "pass", "generation": "pass", "faults": "pass",
    }  # fmt: skip
    assert statuses.get("monitor", "skip") == "skip"  # the CUDA monitor has nothing to watch on a CPU
    subjects = {s["name"]: s["digest"]["sha256"] for s in summary["subjects"]}
    assert subjects["second-engine-code"] == engine["code_digest"].removeprefix("sha256:")
    assert home.verify_all().code == 0


def test_the_second_engine_qualifies_with_speculation_proved(home: Home):
    p, _ = _qualified(home, "--spec", "mtp:2")
    gen = check(p, "generation")
    assert gen["conditions"]["spec_accepts_exactly_j"]["holds"]
    assert gen["conditions"]["speculative_drafts_reproduce_plain"]["holds"]
    hist = gen["evidence"]["acceptance_histogram"]
    assert all(hist[str(j)] > 0 for j in range(3)), hist
    assert p["engine"]["launch"]["capacity"]["num_spec"] == 2


def test_a_foreign_engine_claiming_the_reference_code_digest_is_rejected_naming_both(
    home: Home, tmp_path: Path
):
    env = _installed(home, tmp_path, "foreign_claims_reference")
    claim = engine_code_digest_on_disk()
    ran = home.qualify("run", "--json", "--engine-env", f"LIAR_CLAIM={claim}", env=env, timeout=300)
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    cond = check(p, "boot")["conditions"]["code_digest_matches_disk"]
    assert not cond["holds"] and claim in cond["detail"], cond
    assert "its own tree" in cond["detail"]
    # The receipt names the module the harness launched, not the reference engine's code.
    assert p["engine"]["code_digest"] != claim


def test_an_engine_of_another_protocol_version_is_refused_with_one_line_before_boot(
    home: Home, tmp_path: Path
):
    ran = home.qualify("run", "--json", env=_installed(home, tmp_path, "old_protocol"), timeout=120)
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    boot = check(p, "boot")
    assert boot["status"] == "fail"
    want = "engine second-engine speaks protocol version(s) ['1']; this harness speaks ['2']"
    assert boot["reason"] == want
    assert "launch" not in boot["evidence"]  # nothing was launched


def test_the_second_engine_qualifies_with_distributed_dcp_against_its_own_dcp_1_reference(home: Home):
    """--dcp 2: two processes, each storing one shard of the attention KV in its own allocations (the peer
    checks each rank's), rank 1 a child of rank 0; the harness boots a DCP 1 engine of the same build with
    the same launch document but one shard, and the outputs agree before and after a reload."""
    p, _ = _qualified(home, "--dcp", "2")
    dcp = check(p, "dcp")
    assert dcp["status"] == "pass"
    assert p["engine"]["launch"]["geometry"]["dcp_ranks"] == 2
    run_dir = Path(home.path).glob("runs/*/dcp1-reference/launch.json")
    (ref,) = [json.loads(f.read_text()) for f in run_dir]
    assert ref["geometry"]["dcp_size"] == 1 and ref["geometry"]["dcp_ranks"] == 1
    assert ref["weights"]["path"] == p["engine"]["launch"]["weights"]["path"]
    layout = check(p, "layout")
    assert layout["status"] == "pass"


def test_distributed_dcp_is_refused_for_an_engine_whose_manifest_has_none(home: Home, tmp_path: Path):
    env = _installed(home, tmp_path, "folded_only")
    ran = home.qualify("run", "--dcp", "2", "--json", env=env, timeout=120)
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    reason = check(p, "boot")["reason"]
    assert reason == "--dcp 2: engine second-engine declares no distributed DCP (dcp_distributed false)"


def test_the_second_engine_imports_nothing_of_qualify_or_kernels():
    """Written against the documents only: no module of it imports qualify or kernels."""
    import ast

    for f in sorted(SECOND.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not [n for n in names if n.split(".")[0] in ("qualify", "kernels", "receipts")], (f, names)


@pytest.fixture(scope="module")
def second_image(engine_image: str) -> str:
    """The second engine's image (tests/second_engine/Dockerfile) on top of the CPU engine image, built once
    (its tag is the hash of its files and base)."""
    files = [ROOT / "tests" / "__init__.py", *sorted(SECOND.glob("*.py")), SECOND / "Dockerfile"]
    h = hashlib.sha256(engine_image.encode())
    for f in files:
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    tag = f"qualify-second-engine:{h.hexdigest()[:12]}"
    if subprocess.run([DOCKER, "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as ctx:
        for f in files:
            dest = Path(ctx) / f.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
        r = subprocess.run(
            [DOCKER, "build", "--quiet", "--build-arg", f"BASE={engine_image}", "-t", tag, "-f",
             str(Path(ctx) / "tests" / "second_engine" / "Dockerfile"), ctx],
            capture_output=True, text=True, timeout=600, env={**os.environ, "DOCKER_BUILDKIT": "1"},
        )  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"building the second engine's image failed: {r.stderr[-1500:]}")
    return tag


@pytest.mark.docker
@pytest.mark.usefixtures("no_leftover_containers")
def test_the_second_engine_qualifies_in_a_container_through_its_own_entry_point(
    home: Home, second_image: str
):
    """The Docker launcher runs the image's ENTRYPOINT (`serve --launch FILE`, `manifest`): no qualify.engine
    needed in the image; the receipt names the image."""
    ran = home.qualify("run", "--launcher", "docker", "--image", second_image, "--spec", "mtp:2", "--json",
                       timeout=400)  # fmt: skip
    assert ran.code == 0, ran.why()
    s = ran.summary()
    assert s["verdict"] == "qualified"
    (p,) = home.predicates()
    assert p["engine"]["name"] == "second-engine" and p["engine"]["manifest"]["name"] == "second-engine"
    assert p["engine"]["launch"]["weights"]["path"].startswith("/var/lib/qualify/weights/")
    assert check(p, "layout")["status"] == "pass" and check(p, "generation")["status"] == "pass"
    assert home.verify_all().code == 0
