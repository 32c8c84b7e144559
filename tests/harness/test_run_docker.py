"""`qualify run` with the Docker launcher against the CPU engine image built with no registry: a qualified
run, a container killed by its memory limit, and a GPU request on a host without the NVIDIA runtime."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .conftest import DOCKER, LAYOUT, ROOT, Home, check

# A lying image: the reference engine with tests/liars/other_weights.py loaded at interpreter start (a
# sitecustomize on the image's PYTHONPATH), so `python -m qualify.engine serve` boots weights of its own
# and names the handed file. The peer (`python -I`) never loads it.
LIAR_DOCKERFILE = """ARG BASE
FROM ${BASE}
COPY other_weights.py /opt/liar/liar_other_weights.py
RUN echo 'import liar_other_weights  # noqa' > /opt/liar/sitecustomize.py
ENV PYTHONPATH=/opt/liar
"""

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.usefixtures("no_leftover_containers")]


def test_docker_run_qualifies_and_names_the_image_digest(home: Home, engine_image: str) -> None:
    ran = home.qualify("run", "--launcher", "docker", "--image", engine_image, "--layout", LAYOUT, "--json")
    assert ran.code == 0, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "qualified" and s["target"] == "cpu"
    image_id = subprocess.run(
        [DOCKER, "image", "inspect", "--format", "{{.Id}}", engine_image], capture_output=True, text=True
    ).stdout.strip()
    assert {"name": engine_image, "digest": {"sha256": image_id.removeprefix("sha256:")}} in s["subjects"]
    (p,) = home.predicates()
    assert p["engine"]["image_digest"] == image_id
    assert p["request"]["launcher"] == "docker" and p["request"]["image"] == engine_image
    assert check(p, "faults")["evidence"]["launcher"]["restart_count"] == 0
    # The weights the engine ran are the harness's: seeded by the image's reference engine, hashed, mounted
    # read-only into the container, named by the engine, reloaded with unchanged output; a subject.
    boot = check(p, "boot")
    handed = boot["evidence"]["weights_file"]
    assert handed["hashed"] and handed["engine_path"].startswith("/qualify/weights/")
    for cond in ("weights_file_hashed", "engine_names_handed_weights", "handed_weights_reload_keeps_output"):
        assert boot["conditions"][cond]["holds"], (cond, boot["conditions"][cond])
    weights = {"name": "qualify-reference-engine-weights", "digest": {"sha256": handed["digest"][7:]}}
    assert weights in s["subjects"]
    binds = p["engine"]["sandbox"]["binds"]
    assert f"{handed['path']}:{handed['engine_path']}:ro" in binds, binds
    assert home.verify_all().code == 0


def test_container_killed_by_its_memory_limit_records_the_oom(home: Home, engine_image: str) -> None:
    env = home.env(QUALIFY_ENGINE_FAULT="oom-on:/qualify/reload")
    ran = home.qualify(
        "run", "--launcher", "docker", "--image", engine_image, "--mem-limit", "700m", "--json", env=env
    )
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "rejected"
    assert s["faults"]["oom"]["container"] is True
    assert s["faults"]["restart_count"] >= 1
    assert check(s, "reload")["status"] == "error"
    faults = check(s, "faults")
    assert faults["status"] == "fail" and "no_container_oom" in faults["reason"]
    assert home.verify_all().code == 0


def _has_nvidia_runtime() -> bool:
    info = subprocess.run([DOCKER, "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True)
    return "nvidia" in json.dumps(info.stdout)


def test_gpu_request_without_nvidia_runtime_fails_clearly_and_leaves_no_container(
    home: Home, engine_image: str
) -> None:
    if _has_nvidia_runtime():
        pytest.skip("this Docker host has the NVIDIA runtime")
    ran = home.qualify("run", "--launcher", "docker", "--image", engine_image, "--gpus", "all", "--json")
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    boot = check(s, "boot")
    assert s["verdict"] == "rejected" and boot["status"] == "error"
    assert "NVIDIA container" in boot["reason"] and "\n" not in boot["reason"]
    assert home.verify_all().code == 0


def test_stop_removes_a_container_whose_create_was_interrupted(tmp_path, engine_image: str) -> None:
    from qualify.launch.base import EngineOptions
    from qualify.launch.docker import LABEL, DockerLauncher

    launcher = DockerLauncher(
        EngineOptions(preset="tiny", kda_backend="auto"), engine_image, tmp_path / "run"
    )
    launcher._resolve_image()  # connected, as `start` is when SIGINT lands inside `containers.create`
    # The daemon created the container but the launcher never got its handle.
    made = subprocess.run(
        [DOCKER, "create", "--label", f"{LABEL}={launcher.run_id}", engine_image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    launcher.stop()
    left = subprocess.run(
        [DOCKER, "ps", "-aq", "--no-trunc", "--filter", f"id={made}"], capture_output=True, text=True
    ).stdout.split()
    assert left == []


def test_the_engine_container_is_hardened_as_docker_inspect_reports_it(tmp_path, engine_image: str) -> None:
    from qualify.launch.base import EngineOptions
    from qualify.launch.docker import PIDS_LIMIT, DockerLauncher

    launcher = DockerLauncher(
        EngineOptions("tiny", "auto"), engine_image, tmp_path / "run", engine_env={"LIAR_X": "1"}
    )
    try:
        launcher.start(120)
        cid = launcher._container.id
        r = subprocess.run([DOCKER, "inspect", cid], capture_output=True, text=True, timeout=30)
        (c,) = json.loads(r.stdout)
        hc = c["HostConfig"]
        assert hc["ReadonlyRootfs"] is True
        assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd")
        assert "no-new-privileges" in hc["SecurityOpt"]
        assert hc["PidsLimit"] == PIDS_LIMIT
        assert set(hc["Tmpfs"]) == {"/tmp", "/var/lib/qualify"}
        # Nothing of the host's but the harness's monitor (its file read-only, its socket's own folder):
        # no data dir, no checkout.
        from qualify.launch.monitor import CONTAINER_DIR, CONTAINER_SOCKET_DIR, MONITOR_FILE

        mounts = {m["Destination"]: m for m in c["Mounts"]}
        assert set(mounts) <= {CONTAINER_DIR, CONTAINER_SOCKET_DIR}, mounts
        if CONTAINER_DIR in mounts:
            assert (
                mounts[CONTAINER_DIR]["Source"] == str(MONITOR_FILE.parent)
                and not mounts[CONTAINER_DIR]["RW"]
            )
        if CONTAINER_SOCKET_DIR in mounts:
            assert mounts[CONTAINER_SOCKET_DIR]["Source"].startswith("/tmp/qualify-monitor-")
        assert hc["Privileged"] is False
        env = dict(e.split("=", 1) for e in c["Config"]["Env"])
        assert env["LIAR_X"] == "1"  # --engine-env reaches the engine...
        info = launcher.sandbox_info()
        assert info["operator_env"] == {"LIAR_X": "1"}  # ...and is recorded
        assert info["read_only_rootfs"] is True and info["cap_drop"] == ["ALL"]
        # The engine cannot write its image: only the tmpfs scratch.
        ro = launcher._container.exec_run(["sh", "-c", "touch /usr/x 2>&1; touch /tmp/x && echo tmp-ok"])
        assert b"Read-only file system" in ro.output and b"tmp-ok" in ro.output
        ident = launcher.identity()
        assert ident["image_id"] == c["Image"] == ident["running_container_image_id"]
    finally:
        launcher.stop()


@pytest.fixture(scope="module")
def other_weights_image(engine_image: str) -> str:
    liar = ROOT / "tests" / "liars" / "other_weights.py"
    h = hashlib.sha256(engine_image.encode() + LIAR_DOCKERFILE.encode() + liar.read_bytes())
    tag = f"qualify-liar-other-weights:{h.hexdigest()[:12]}"
    if subprocess.run([DOCKER, "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as ctx:
        shutil.copyfile(liar, Path(ctx) / "other_weights.py")
        (Path(ctx) / "Dockerfile").write_text(LIAR_DOCKERFILE)
        r = subprocess.run(
            [DOCKER, "build", "--quiet", "--build-arg", f"BASE={engine_image}", "-t", tag, ctx],
            capture_output=True, text=True, timeout=600, env={**os.environ, "DOCKER_BUILDKIT": "1"},
        )  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"building the lying image failed: {r.stderr[-1500:]}")
    return tag


def test_an_image_that_boots_other_weights_than_the_handed_file_is_rejected(
    home: Home, other_weights_image: str
) -> None:
    ran = home.qualify(
        "run",
        "--launcher",
        "docker",
        "--image",
        other_weights_image,
        "--layout",
        LAYOUT,
        "--json",
        "--fail-fast",
    )
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    boot = check(p, "boot")
    # It names the handed file (its word holds) and the file is the hashed one; reloading that very file
    # changes its answers on fresh prompts: what it booted was not the subject.
    assert boot["conditions"]["engine_names_handed_weights"]["holds"]
    assert boot["conditions"]["weights_file_hashed"]["holds"]
    cond = boot["conditions"]["handed_weights_reload_keeps_output"]
    assert not cond["holds"] and cond["source"] == "observed"
    assert "output changed" in cond["detail"], cond
