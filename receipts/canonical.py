"""Canonical JSON (RFC 8785, JCS) for digests and stored bytes, and the sha256 digests taken over it."""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785

# JCS numbers are IEEE doubles; integers beyond this lose precision, so they travel as strings.
MAX_SAFE_INTEGER = 2**53 - 1


def _safe_integers(obj: Any) -> Any:
    """Copy of `obj` with every integer outside +-(2^53-1) replaced by its decimal string."""
    if isinstance(obj, bool):  # bool is an int subclass; keep true/false as they are
        return obj
    if isinstance(obj, int):
        return str(obj) if abs(obj) > MAX_SAFE_INTEGER else obj
    if isinstance(obj, dict):
        return {key: _safe_integers(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_safe_integers(value) for value in obj]
    return obj


def canonical_json(obj: Any) -> bytes:
    """RFC 8785 bytes of a JSON value (dict/list/str/int/float/bool/None); big integers become strings.

    Raises `rfc8785.CanonicalizationError` (a ValueError) for NaN/infinity, non-string keys or other types.
    """
    return rfc8785.dumps(_safe_integers(obj))


def sha256_hex(obj: Any) -> str:
    """Lower-case hex sha256 of `canonical_json(obj)`."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def digest(obj: Any) -> dict[str, str]:
    """An in-toto DigestSet of the canonical bytes: {"sha256": hex}."""
    return {"sha256": sha256_hex(obj)}
