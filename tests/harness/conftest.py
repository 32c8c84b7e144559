"""Fixtures for the harness tests: a temp QUALIFY_HOME per test, `qualify` as a real subprocess, the store's
receipts, and (Docker tests) the CPU engine image built once per session."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import host_lock

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_KMSG = ROOT / "tests" / "data" / "kmsg-xid-sample.txt"
LAYOUT = "2304,2304,2304,9216"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


# How a host's sandbox is set up (scripts/gpu-check sets the first two on the GPU machine): kept in runs' env.
SANDBOX_SETUP_ENV = ("QUALIFY_BWRAP", "QUALIFY_ENGINE_PATH", "QUALIFY_CACHE_DIR")


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float

    def summary(self) -> dict[str, Any]:
        return json.loads(self.stdout)

    def why(self) -> str:
        """What a failed run says first: its checks that neither passed nor skipped, each with its reason
        (pytest cuts a long assertion message short, so these lead it), then stderr's tail."""
        try:
            checks = self.summary().get("checks", [])
        except (ValueError, AttributeError):
            checks = []
        failed = [f"{c.get('name')} {c.get('status')}: {c.get('reason')}" for c in checks
                  if c.get("status") not in ("pass", "skip")]  # fmt: skip
        return "\n".join([f"exit {self.code} after {self.seconds:.0f} s", *failed, self.stderr[-2000:]])


@dataclass
class Home:
    """A QUALIFY_HOME of its own: the default SQLite store and the keys live there."""

    path: Path

    @property
    def db(self) -> Path:
        return self.path / "qualify.db"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k in SANDBOX_SETUP_ENV}
        env.update(QUALIFY_HOME=str(self.path), **extra)
        return env

    def foreign_env(self, module: str, site: Path, **extra: str) -> dict[str, str]:
        """The environment that runs `module`, installed in `site` the way a foreign engine is: the folder
        mounted in the sandbox and hashed (QUALIFY_ENGINE_PATH), where the harness finds it (PYTHONPATH)."""
        harness = (str(site), str(ROOT), os.environ.get("PYTHONPATH", ""))
        mounted = (str(site), os.environ.get("QUALIFY_ENGINE_PATH", ""))
        return self.env(
            QUALIFY_ENGINE_MODULE=module,
            PYTHONPATH=os.pathsep.join(p for p in harness if p),
            QUALIFY_ENGINE_PATH=os.pathsep.join(p for p in mounted if p),
            **extra,
        )

    def qualify(self, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> Ran:
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "qualify.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self.env(),
            cwd=ROOT,
        )
        return Ran(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def predicates(self) -> list[dict[str, Any]]:
        """Every stored receipt's predicate, oldest first (read straight from the query table)."""
        with sqlite3.connect(self.db) as db:
            rows = db.execute("SELECT predicate FROM receipts ORDER BY log_idx").fetchall()
        return [json.loads(r[0]) if isinstance(r[0], str) else r[0] for r in rows]

    def verify_all(self) -> Ran:
        return self.qualify("receipts", "verify", "--all", "--db", f"sqlite:///{self.db}")


@pytest.fixture
def home(tmp_path: Path) -> Home:
    h = tmp_path / "qhome"
    h.mkdir()
    return Home(h)


def check(summary_or_predicate: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in summary_or_predicate["checks"] if c["name"] == name)


@pytest.fixture
def empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A QUALIFY_HOME that does not exist yet (and no QUALIFY_DB_URL), for runs that must write nothing."""
    h = tmp_path / "home"
    monkeypatch.setenv("QUALIFY_HOME", str(h))
    monkeypatch.delenv("QUALIFY_DB_URL", raising=False)
    return h


def refused(args: list[str], home: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`qualify run ARGS` in-process is bad input: exit 2, one `error: ` line on stderr, nothing on stdout,
    nothing under `home`. Returns that line."""
    from qualify.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", *args])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == ""
    # Nothing written: no data dir, so no store file, no key, no run directory.
    assert not home.exists() or not any(home.rglob("*")), sorted(home.rglob("*"))
    return lines[0]


# ---------------------------------------------------------------- docker


def _docker_unavailable() -> str | None:
    if not Path(DOCKER).exists() and shutil.which(DOCKER) is None:
        return "no docker client"
    r = subprocess.run([DOCKER, "info"], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"docker info failed: {r.stderr.strip()[-200:]}"


@pytest.fixture(scope="session")
def docker_available() -> None:
    why = _docker_unavailable()
    if why:
        if IN_CI:
            pytest.fail(f"Docker unavailable: {why} (CI requires it)")
        pytest.skip(f"Docker unavailable: {why}")


@pytest.fixture(scope="session")
def engine_image(docker_available: None) -> str:
    """The CPU engine image, built once per session (skipped when `docker image inspect` finds it)."""
    with host_lock("engine-image"):
        r = subprocess.run(
            ["bash", str(ROOT / "docker" / "build-cpu-image.sh")], capture_output=True, text=True, timeout=900
        )
    if r.returncode != 0:
        pytest.fail(f"building the engine image failed: {r.stderr[-1500:]}")
    return r.stdout.strip().splitlines()[-1]


def _labelled_containers() -> set[str]:
    r = subprocess.run(
        [DOCKER, "ps", "-a", "--filter", "label=org.qualify.run", "--format", "{{.ID}}"],
        capture_output=True,
        text=True,
    )
    return set(r.stdout.split())


@pytest.fixture
def no_leftover_containers(docker_available: None) -> Iterator[None]:
    """The test leaves no container of its own behind (engine or refusal probe), whatever the verdict."""
    before = _labelled_containers()
    yield
    left = _labelled_containers() - before
    assert not left, f"containers left behind: {sorted(left)}"


@pytest.fixture(scope="session", autouse=True)
def _code_digest_cache() -> None:
    """Fill the harness's file-digest cache once per session (the first tree digest of the interpreter and
    its site-packages reads gigabytes), so runs with a short --timeout measure the run, not that. One
    process fills it at a time: a second pytest-xdist worker waits, then only stats the files."""
    from qualify.launch.sandbox import code_digest, engine_code

    with host_lock("code-digest"):
        code_digest(engine_code("qualify.engine"))
