"""The weights subject as OpenSSF model signing computes it: the digest in qualify's receipt is the root
digest that `model-signing` 1.1.1 signs, checked by signing and verifying with model-signing itself."""

from __future__ import annotations

import base64
import json
import os
import tempfile
from pathlib import Path

import pytest

from qualify.run import receipt as rc
from qualify.run import weights_identity as wi
from receipts import keys
from tests.conftest import _need

try:
    import model_signing
except ImportError:  # skipped locally, a failure in CI (the dev extra installs it)
    model_signing = None


@pytest.fixture(autouse=True)
def _model_signing_installed() -> None:
    if model_signing is None:
        _need("model-signing", "not installed: pip install model-signing==1.1.1 (the dev extra)")


def _signed_root(model: Path, tmp_path: Path) -> str:
    """Sign `model` with model-signing (an ECDSA P-256 key made by qualify), verify it with model-signing,
    and return the root digest its signed statement names."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))  # one signing per call, outside the model
    key = keys.generate("p256")
    private = key.save(work / "ms.key")
    public = work / "ms.pub"
    public.write_bytes(key.public_key().public_pem())
    signature = work / f"{model.name}.sig"
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).sign(model, signature)
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(model, signature)
    bundle = json.loads(signature.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    (subject,) = statement["subject"]
    return "sha256:" + subject["digest"]["sha256"]


def _weights(path: Path, size: int = 3 * wi.CHUNK // 2 + 17) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_one_weights_file_has_the_root_digest_model_signing_signs(tmp_path: Path) -> None:
    weights = _weights(tmp_path / "model" / "weights.safetensors")
    ours = wi.model_signing_digest(weights)
    assert ours == _signed_root(weights, tmp_path)
    # ... and the same from the file's sha256 that the harness already took (no second read).
    assert wi.root_of_one_file(rc.file_digest(weights)) == ours
    assert ours != rc.file_digest(weights)  # a different digest from the plain file hash, on purpose


def test_a_model_directory_matches_model_signing_including_its_order_and_ignores(tmp_path: Path) -> None:
    model = tmp_path / "glm"
    _weights(model / "a.b", 100)
    _weights(model / "a" / "b", 200)  # path-component order puts a/b before a.b; string order would not
    _weights(model / "shards" / "model-00002-of-00002.safetensors", 300)
    _weights(model / "shards" / "model-00001-of-00002.safetensors", 400)
    _weights(model / "config.json", 50)
    _weights(model / ".gitattributes", 10)  # ignored by model-signing's defaults, so here too
    _weights(model / ".git" / "HEAD", 10)
    assert wi.model_signing_digest(model) == _signed_root(model, tmp_path)
    # Changing any file changes the root, and model-signing agrees with the new one.
    (model / "a" / "b").write_bytes(b"changed")
    assert wi.model_signing_digest(model) == _signed_root(model, tmp_path)


def test_a_symlink_is_refused_as_model_signing_refuses_it(tmp_path: Path) -> None:
    model = tmp_path / "m"
    target = _weights(tmp_path / "elsewhere.bin", 10)
    model.mkdir()
    (model / "w.bin").symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        wi.model_signing_digest(model)
    with pytest.raises(ValueError):
        model_signing.hashing.hash(model)


def test_a_local_receipt_names_the_weights_by_their_model_signing_root(tmp_path: Path) -> None:
    weights = _weights(tmp_path / "weights.safetensors")
    engine = {
        "name": "qualify-engine",
        "code_digest": "sha256:" + "ab" * 32,
        "config_digest": "sha256:" + "cd" * 32,
    }
    subjects = {s.name: s.digest["sha256"] for s in rc.subjects(engine, {}, rc.file_digest(weights))}
    assert subjects["qualify-engine-weights"] == rc.file_digest(weights).removeprefix("sha256:")
    oms = subjects["qualify-engine" + wi.SUBJECT_SUFFIX]
    assert "sha256:" + oms == _signed_root(weights, tmp_path)
    # No weights digest, no weights subjects of either kind.
    names = [s.name for s in rc.subjects(engine, {}, None)]
    assert not any("weights" in n for n in names)
