"""One grammar for the filters that the CLI (`receipts list`, `approvals`) and the HTTP API share: `since`
(a duration ago, or a time), `host`, `subject`, `verdict`. Each parser returns the normalized value or
raises ParamError with one line a person can act on; the CLI turns it into exit 2, the API into a 422."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

VERDICTS = ("qualified", "rejected", "aborted")
MAX_HOST = 253  # a DNS name's longest text form
_DURATION = re.compile(r"^(\d{1,9})([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_SUBJECT = re.compile(r"^(sha256:)?([0-9a-f]{64})$")


class ParamError(ValueError):
    """A filter value outside the grammar (the message names the parameter and what it takes)."""


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`30m`, `24h`, `7d`, `2w` (that long ago), or an ISO 8601 / RFC 3339 date or time (UTC unless it
    names an offset), as an aware UTC datetime."""
    text = value.strip()
    match = _DURATION.match(text)
    if match:
        try:
            return (now or datetime.now(UTC)) - timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        except OverflowError:
            raise ParamError(f"since {value!r} reaches back before year 1; give a shorter duration") from None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ParamError(
            f"since {value[:40]!r} is neither a duration like 30m / 24h / 7d nor an ISO date or time "
            "like 2025-06-01T00:00:00Z"
        ) from None
    try:
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
    except (OverflowError, ValueError):
        raise ParamError(f"since {value[:40]!r} is not a time that exists in UTC") from None


def parse_subject(value: str) -> str:
    """A subject digest: `sha256:<64 hex>` or the 64 hex digits alone; returns `sha256:<hex>`."""
    match = _SUBJECT.match(value.strip())
    if match is None:
        raise ParamError(f"subject {value[:80]!r} is not sha256:<64 lower-case hex> (or the 64 hex digits)")
    return f"sha256:{match.group(2)}"


def parse_host(value: str) -> str:
    """A hostname as receipts record it (exact match)."""
    text = value.strip()
    if not text or len(text) > MAX_HOST or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ParamError(f"host must be a hostname of 1 to {MAX_HOST} printable characters")
    return text


def parse_verdict(value: str) -> str:
    if value not in VERDICTS:
        raise ParamError(f"verdict {value[:40]!r} is not one of: {', '.join(VERDICTS)}")
    return value
