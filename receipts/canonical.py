"""Canonical JSON (RFC 8785, JCS) for digests and stored bytes, and the sha256 digests taken over it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import rfc8785

# JCS numbers are IEEE doubles; integers beyond this lose precision, so they travel as strings.
MAX_SAFE_INTEGER = 2**53 - 1
# Parse bounds for untrusted JSON: deeper values are refused before anything recurses over them, and
# integers longer than this many digits (Python's own limit is 4300) are refused as nonsense.
MAX_DEPTH = 64
MAX_INT_DIGITS = 40


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply lists and dicts nest in `value` (a scalar is 0), counted without recursion; stops
    counting once past `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth > limit:
                return deepest
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer has {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(
    text: str | bytes,
    *,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """`json.loads` for untrusted text: ValueError (one line) for invalid JSON, NaN/Infinity, integers over
    MAX_INT_DIGITS digits, or values nested deeper than `max_depth`."""
    try:
        value = json.loads(
            text, parse_int=_bounded_int, parse_constant=_no_constant, object_pairs_hook=object_pairs_hook
        )
    except RecursionError:
        raise ValueError(f"it is nested more than {max_depth} deep") from None
    # Each level of nesting opens with a bracket of the text, so the text's brackets (those inside strings
    # too) bound the depth: walking the value is needed only when there are more than max_depth of them.
    if isinstance(text, str):
        opened = text.count("{") + text.count("[")
    else:
        opened = text.count(b"{") + text.count(b"[")
    if opened > max_depth and nesting_depth(value, max_depth) > max_depth:
        raise ValueError(f"it is nested more than {max_depth} deep")
    return value


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
