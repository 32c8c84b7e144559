"""Size limits on what the harness reads from people and the network, and a file read that honours them."""

from __future__ import annotations

from pathlib import Path

from qualify.errors import UsageError

# A policy is at most 100 conditions of 4 KiB each; anything bigger is not a policy.
MAX_POLICY_BYTES = 1 << 20
# `receipts import`: JSON Lines of envelopes (a receipt is about 20 KiB), read whole before appending.
MAX_IMPORT_BYTES = 64 << 20
# A POST body (`/v1/decisions`: a subject and a policy).
MAX_BODY_BYTES = 1 << 20


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def read_bytes_limited(path: str | Path, limit: int, what: str) -> bytes:
    """The exact bytes of `path`, reading at most `limit` + 1 of them (so /dev/zero or a huge file is
    refused at once); UsageError (one line) when it is missing, unreadable or too big."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{what} {path} is larger than {_size(limit)}; refusing to read it")
    return data


def read_text_limited(path: str | Path, limit: int, what: str) -> str:
    """The UTF-8 text of `path` read as `read_bytes_limited` does; UsageError (one line) also when it is
    not UTF-8."""
    data = read_bytes_limited(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None
