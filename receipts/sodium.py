"""Ed25519 verification through libsodium (PyNaCl's binding, which bundles it) as a fast path in front of
OpenSSL.

libsodium's crypto_sign_open checks the same equation as OpenSSL's Ed25519 verify (RFC 8032 5.1.7,
cofactorless: the encoding of [S]B - [k]A must be R's bytes) and refuses more besides (a non-canonical S
or public key, a small-order R or public key), so what it accepts OpenSSL accepts too; here it takes about
a third of OpenSSL's time. Only its "valid" is taken: anything it refuses is verified again by OpenSSL
(cryptography), which stays the one that decides a refusal and words it. With QUALIFY_NO_LIBSODIUM set
(or PyNaCl missing) every signature goes to OpenSSL alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_UNLOADED = object()
_open: object = _UNLOADED
_bad: type[Exception] = Exception


def _load() -> Callable[[bytes, bytes], bytes] | None:
    global _bad
    if os.environ.get("QUALIFY_NO_LIBSODIUM"):
        return None
    try:
        from nacl.bindings import crypto_sign_open
        from nacl.exceptions import BadSignatureError
    except ImportError:
        return None
    _bad = BadSignatureError
    return crypto_sign_open


def available() -> bool:
    global _open
    if _open is _UNLOADED:
        _open = _load()
    return _open is not None


def ed25519_valid(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when libsodium finds `signature` a valid Ed25519 signature of `message` by the raw 32-byte
    `public_key`; False when it does not, or cannot tell: then ask OpenSSL."""
    if not available() or len(signature) != 64 or len(public_key) != 32:
        return False
    try:
        _open(bytes(signature) + bytes(message), bytes(public_key))  # type: ignore[operator]
    except Exception:  # BadSignatureError, or anything else: OpenSSL decides
        return False
    return True
