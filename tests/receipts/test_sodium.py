"""The libsodium (PyNaCl) fast path for Ed25519 verification: it only ever says "valid" where OpenSSL does
too, and every refusal is OpenSSL's (receipts.sodium)."""

from __future__ import annotations

import os

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from receipts import keys, sodium
from receipts.checkpoint import NoteVerifier
from receipts.errors import VerificationError

# Signatures with an S of L or more, a small-order R, or of a small-order public key: libsodium refuses
# them; OpenSSL has the last word (RFC 8032 vectors and the Ed25519 edge cases of "Taming the many EdDSAs").
_L = (2**252 + 27742317777372353535851937790883648493).to_bytes(32, "little")
_IDENTITY = (1).to_bytes(32, "little")  # the neutral point: small order


def _openssl_valid(public: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def _cases() -> list[tuple[bytes, bytes, bytes]]:
    out = []
    for n in range(20):
        private = Ed25519PrivateKey.generate()
        public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        message = os.urandom(n * 37)
        signature = private.sign(message)
        out.append((public, signature, message))
        flipped = bytearray(signature)
        flipped[n % 64] ^= 1 << (n % 8)
        out.append((public, bytes(flipped), message))
        out.append((public, signature, message + b"x"))
        out.append((public, signature[:32] + _L, message))  # S not reduced
        out.append((public, _IDENTITY + signature[32:], message))  # small-order R
    out.append((_IDENTITY, _IDENTITY + bytes(32), b"anything"))  # small-order key, S = 0
    return out


def test_libsodium_says_valid_only_where_openssl_does() -> None:
    assert sodium.available()  # PyNaCl is a dependency: the fast path exists wherever qualify installs
    for public, signature, message in _cases():
        if sodium.ed25519_valid(public, signature, message):
            assert _openssl_valid(public, signature, message)
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert sodium.ed25519_valid(public, private.sign(b"m"), b"m")  # the fast path is taken


def test_short_or_long_inputs_never_reach_libsodium() -> None:
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    signature = private.sign(b"m")
    for sig, key in (
        (signature[:63], public),
        (signature + b"\0", public),
        (signature, public[:31]),
        (b"", b""),
    ):
        assert not sodium.ed25519_valid(key, sig, b"m")


@pytest.mark.parametrize("fast", [True, False])
def test_keys_and_note_verifiers_decide_as_openssl(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    if not fast:
        monkeypatch.setattr(sodium, "_open", None)  # as without libsodium
    for public, signature, message in _cases():
        expected = _openssl_valid(public, signature, message)
        try:
            key = keys.VerifyingKey(Ed25519PublicKey.from_public_bytes(public))
        except ValueError:
            continue
        try:
            key.verify(signature, message)
            valid = True
        except VerificationError:
            valid = False
        assert valid == expected
        note = NoteVerifier("example.com/log", key.crypto)  # type: ignore[arg-type]
        assert note.verify(message, signature) == expected
