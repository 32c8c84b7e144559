"""Signing keys: algorithms, securesystemslib-compatible key ids, 0600 key files and clear refusals."""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from securesystemslib.signer import SSlibKey

from receipts import keys
from receipts.errors import KeyFileError, ReceiptsError, VerificationError

ALGORITHMS = ["ed25519", "p256"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_signature_verifies_and_a_changed_message_or_signature_is_refused(algorithm: str) -> None:
    key = keys.generate(algorithm)
    signature = key.sign(b"receipt")
    key.public_key().verify(signature, b"receipt")
    with pytest.raises(VerificationError):
        key.public_key().verify(signature, b"receipT")
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    with pytest.raises(VerificationError):
        key.public_key().verify(flipped, b"receipt")
    with pytest.raises(VerificationError):
        keys.generate(algorithm).public_key().verify(signature, b"receipt")


def test_p256_signatures_are_der_encoded_ecdsa_sha256() -> None:
    key = keys.generate("p256")
    signature = key.sign(b"data")
    assert signature[0] == 0x30  # DER SEQUENCE, not raw r||s
    key.crypto.public_key().verify(signature, b"data", ec.ECDSA(hashes.SHA256()))


def test_unknown_algorithm_is_refused_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="ed25519, p256"):
        keys.generate("rsa")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_keyid_equals_securesystemslib_default_keyid(algorithm: str) -> None:
    key = keys.generate(algorithm)
    assert key.keyid == SSlibKey.from_crypto(key.crypto.public_key()).keyid
    assert key.public_key().keyid == key.keyid
    assert len(key.keyid) == 64


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_public_pem_round_trips_to_the_same_key(algorithm: str) -> None:
    key = keys.generate(algorithm)
    again = keys.VerifyingKey.from_pem(key.public_key().public_pem())
    assert again == key.public_key()
    assert again.algorithm == algorithm
    again.verify(key.sign(b"x"), b"x")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_saved_key_is_mode_0600_in_a_0700_directory_and_loads_back(tmp_path, algorithm: str) -> None:
    key = keys.generate(algorithm)
    path = tmp_path / "new" / "dir" / "signing.pem"
    key.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    loaded = keys.SigningKey.load(path)
    assert loaded.keyid == key.keyid and loaded.algorithm == algorithm
    key.public_key().verify(loaded.sign(b"m"), b"m")
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert [p.name for p in path.parent.iterdir()] == ["signing.pem"]  # no temp file left behind


def test_saved_key_is_0600_even_under_a_permissive_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        path = keys.generate().save(tmp_path / "k.pem")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_save_refuses_to_overwrite_unless_asked(tmp_path) -> None:
    path = tmp_path / "k.pem"
    first = keys.generate()
    first.save(path)
    with pytest.raises(KeyFileError, match="already exists"):
        keys.generate().save(path)
    assert keys.SigningKey.load(path).keyid == first.keyid
    second = keys.generate("p256")
    second.save(path, overwrite=True)
    assert keys.SigningKey.load(path).keyid == second.keyid
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_group_or_world_readable_key_is_refused_with_the_chmod_fix(tmp_path, mode: int) -> None:
    path = keys.generate().save(tmp_path / "k.pem")
    path.chmod(mode)
    with pytest.raises(KeyFileError) as err:
        keys.SigningKey.load(path)
    message = str(err.value)
    assert f"mode {mode:04o}" in message
    assert f"chmod 600 {path}" in message
    assert "\n" not in message


def test_missing_key_file_is_one_clear_line(tmp_path) -> None:
    with pytest.raises(KeyFileError, match="does not exist") as err:
        keys.SigningKey.load(tmp_path / "absent.pem")
    assert isinstance(err.value, ReceiptsError) and "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key_file_is_refused(tmp_path) -> None:
    path = keys.generate().save(tmp_path / "k.pem")
    path.chmod(0o000)
    with pytest.raises(KeyFileError, match="cannot read"):
        keys.SigningKey.load(path)


def test_permission_denied_on_a_key_file_is_one_clear_line(tmp_path, monkeypatch) -> None:
    # Root (as in CI containers) reads any file, so deny the open itself.
    path = keys.generate().save(tmp_path / "k.pem")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(keys.os, "open", denied)
    with pytest.raises(KeyFileError, match="cannot read key file .*Permission denied"):
        keys.SigningKey.load(path)


def test_directory_in_place_of_a_key_file_is_refused(tmp_path) -> None:
    folder = tmp_path / "k.pem"
    folder.mkdir(mode=0o700)
    with pytest.raises(KeyFileError):
        keys.SigningKey.load(folder)


def _write_private(path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a key at all",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    ],
)
def test_garbage_private_key_file_is_refused(tmp_path, content: bytes) -> None:
    path = tmp_path / "k.pem"
    _write_private(path, content)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        keys.SigningKey.load(path)


def test_public_key_given_as_private_key_is_refused(tmp_path) -> None:
    path = tmp_path / "k.pem"
    _write_private(path, keys.generate().public_key().public_pem())
    with pytest.raises(KeyFileError):
        keys.SigningKey.load(path)


def test_unsupported_key_types_are_refused(tmp_path) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    p384 = ec.generate_private_key(ec.SECP384R1())
    for crypto in (rsa_key, p384):
        path = tmp_path / "k.pem"
        pem = crypto.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_private(path, pem)
        with pytest.raises(KeyFileError, match="only ed25519 and p256"):
            keys.SigningKey.load(path)
        public = crypto.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        with pytest.raises(KeyFileError, match="only ed25519 and p256"):
            keys.VerifyingKey.from_pem(public)


def test_encrypted_private_key_is_refused_saying_so(tmp_path) -> None:
    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    path = tmp_path / "k.pem"
    _write_private(path, pem)
    with pytest.raises(KeyFileError, match="encrypted"):
        keys.SigningKey.load(path)


def test_garbage_public_key_is_refused() -> None:
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        keys.VerifyingKey.from_pem(b"-----BEGIN PUBLIC KEY-----\nzz\n-----END PUBLIC KEY-----\n")


def test_private_key_offered_for_trust_is_refused_with_a_hint() -> None:
    with pytest.raises(KeyFileError, match="export-public"):
        keys.VerifyingKey.from_pem(keys.generate().private_pem())


def test_public_key_file_loads_and_missing_one_is_refused(tmp_path) -> None:
    key = keys.generate("p256")
    path = tmp_path / "pub.pem"
    path.write_bytes(key.public_key().public_pem())
    assert keys.VerifyingKey.load(path).keyid == key.keyid
    with pytest.raises(KeyFileError, match="does not exist"):
        keys.VerifyingKey.load(tmp_path / "none.pem")


def test_repr_never_shows_private_material() -> None:
    key = keys.generate()
    assert "PRIVATE" not in repr(key) and key.keyid[:16] in repr(key)
