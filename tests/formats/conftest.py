"""Fixtures for the interchange-format tests: sigstore-js installed from the npm registry into a cache
dir (pinned by tests/formats/npm/package-lock.json), and a store with receipts made through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _need, host_lock
from tests.store.conftest import cli, home  # noqa: F401 (the CLI as `qualify` runs it, in a private home)

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
# Where npm installs the verifier: a cache beside the checkout (ignored by git), or QUALIFY_TEST_CACHE.
CACHE = Path(os.environ.get("QUALIFY_TEST_CACHE") or ROOT / ".cache")


@dataclass(frozen=True)
class SigstoreJs:
    node: str
    node_path: Path

    def verify(self, bundle: Path, public_pem: Path, keyid: str) -> dict[str, Any]:
        """Run tests/formats/sigstore_verify.cjs: {"ok": bool, ...}."""
        done = subprocess.run(
            [self.node, str(HERE / "sigstore_verify.cjs"), str(bundle), str(public_pem), keyid],
            env={**os.environ, "NODE_PATH": str(self.node_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.stdout.strip(), done.stderr[-2000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert done.returncode == (0 if result["ok"] else 1), (done.returncode, done.stderr[-1000:])
        return result


@pytest.fixture(scope="session")
def sigstore_js() -> SigstoreJs:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        _need("sigstore-js", "node and npm are not installed (apt-get install -y npm)")
    lock = (HERE / "npm" / "package-lock.json").read_bytes()
    target = CACHE / "npm" / f"sigstore-verify-{hashlib.sha256(lock).hexdigest()[:12]}"
    modules = target / "node_modules"
    with host_lock("sigstore-js"):  # pytest-xdist workers: one installs, the other finds it installed
        if not (modules / "@sigstore" / "verify" / "package.json").exists():
            target.mkdir(parents=True, exist_ok=True)
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(HERE / "npm" / name, target / name)
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
                cwd=target,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "npm_config_cache": str(CACHE / "npm" / "_cache")},
            )
            if done.returncode != 0:
                _need("sigstore-js", f"npm ci failed: {done.stderr.strip()[-400:]}")
    return SigstoreJs(node=node, node_path=modules)


@pytest.fixture
def receipt_store(cli, home: Path, tmp_path: Path) -> Callable[[str], dict[str, Any]]:  # noqa: F811
    """A store made through the CLI whose operator key is of the given algorithm, with one receipt."""
    from receipts.keys import SigningKey
    from receipts.testing import synthetic_envelope

    def make(algorithm: str) -> dict[str, Any]:
        url = f"sqlite:///{tmp_path / f'{algorithm}.db'}"
        key_path = tmp_path / f"{algorithm}.key"
        made = cli("keys", "generate", "--algorithm", algorithm, "--out", key_path, "--db", url, "--json")
        assert made.code == 0, made.err
        key = SigningKey.load(key_path)
        envelopes = tmp_path / f"{algorithm}.jsonl"
        envelopes.write_text(json.dumps(synthetic_envelope(key, 1)) + "\n")
        imported = cli("receipts", "import", envelopes, "--db", url, "--json")
        assert imported.code == 0, imported.err
        public = tmp_path / f"{algorithm}.pub"
        assert cli("keys", "export-public", "--key", key_path, "--out", public).code == 0
        return {"url": url, "key": key, "public": public, "id": json.loads(imported.out)[0]["id"]}

    return make


# ---------------------------------------------------------------- a real registry (Debian's docker-registry)

DOCKER = "/usr/bin/docker"
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Docker's distribution registry (2.x: no referrers API, so the referrers tag schema is used) on
    127.0.0.1 at a free port, storing into a temp dir; yields host:port."""
    import socket
    import time
    import urllib.request

    if not os.path.exists(REGISTRY_BIN):
        _need("docker-registry", "not installed (apt-get install -y docker-registry)")
    root = tmp_path_factory.mktemp("registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                _need("docker-registry", f"did not start: {(root / 'registry.log').read_text()[-400:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _docker(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pushed_image(registry: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A tiny image made with `docker import` and pushed to the test registry (dockerd lets 127.0.0.1
    registries speak plain HTTP); yields its reference and image id (the config digest receipts name)."""
    import uuid

    if not os.path.exists(DOCKER) or _docker("info", timeout=30).returncode != 0:
        _need("Docker", "no docker engine (docker info failed)")
    files = tmp_path / "rootfs"
    files.mkdir()
    (files / "engine.txt").write_text(f"a tiny stand-in for the engine image {uuid.uuid4()}\n")
    tar = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "-C", str(files), "-cf", str(tar), "."], check=True, timeout=60)
    ref = f"{registry}/qualify-test/engine:{uuid.uuid4().hex[:12]}"
    made = _docker("import", str(tar), ref)
    assert made.returncode == 0, made.stderr
    try:
        pushed = _docker("push", ref, timeout=300)
        assert pushed.returncode == 0, pushed.stderr
        image_id = _docker("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()
        yield {"ref": ref, "image_id": image_id}
    finally:
        _docker("rmi", "-f", ref)
