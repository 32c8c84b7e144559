"""Fixtures for the interchange-format tests: sigstore-js installed from the npm registry into a cache
dir (pinned by tests/formats/npm/package-lock.json), and a store with receipts made through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _need
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
