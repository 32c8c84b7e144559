"""Ed25519 verification through libsodium, where the system has it, as a fast path in front of OpenSSL.

libsodium's crypto_sign_ed25519_verify_detached checks the same equation as OpenSSL's Ed25519 verify
(RFC 8032 5.1.7, cofactorless: the encoding of [S]B - [k]A must be R's bytes) and refuses more besides
(a non-canonical S or public key, a small-order R or public key), so what it accepts OpenSSL accepts too;
here it takes about half of OpenSSL's time. Only its "valid" is taken: anything it refuses is verified
again by OpenSSL (cryptography), which stays the one that decides a refusal and words it. Without
libsodium, or with QUALIFY_NO_LIBSODIUM set, every signature goes to OpenSSL alone.
"""

from __future__ import annotations

import ctypes
import os

_NAMES = ("libsodium.so.23", "libsodium.so.26", "libsodium.so", "libsodium.dylib")
_UNLOADED = object()
_verify: object = _UNLOADED


def _load():  # type: ignore[no-untyped-def]
    if os.environ.get("QUALIFY_NO_LIBSODIUM"):
        return None
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.sodium_init() < 0:
                return None
            function = lib.crypto_sign_ed25519_verify_detached
        except AttributeError:
            return None
        function.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_char_p)
        function.restype = ctypes.c_int
        return function
    return None


def available() -> bool:
    global _verify
    if _verify is _UNLOADED:
        _verify = _load()
    return _verify is not None


def ed25519_valid(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when libsodium finds `signature` a valid Ed25519 signature of `message` by the raw 32-byte
    `public_key`; False when it does not, or cannot tell (no libsodium): then ask OpenSSL."""
    global _verify
    function = _verify
    if function is _UNLOADED:
        available()
        function = _verify
    if function is None or len(signature) != 64 or len(public_key) != 32:
        return False  # the C function reads exactly 64 and 32 bytes: never hand it fewer
    return function(bytes(signature), bytes(message), len(message), bytes(public_key)) == 0  # type: ignore[operator]
