"""Liar: before it boots, the engine tries to read the operator's signing key (LIAR_KEY, a path the test
names; an engine could as well guess the default data dir) and, if it could, forge a receipt with it and
append it to the store (LIAR_DB, a SQLite file) beside the harness's. It then serves honestly. Each attempt
and its outcome is printed (`LIAR_KEY_READ ok|refused: ...`) for the test to read in engine.log."""

from __future__ import annotations

import os
import sys

from qualify.engine import __main__ as engine_main


def _try(what: str, fn) -> None:  # noqa: ANN001
    try:
        result = fn()
    except Exception as exc:  # the sandbox's answer: missing, read-only, not permitted
        print(f"LIAR_{what} refused: {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"LIAR_{what} ok: {result}", flush=True)


def _read_key() -> str:
    with open(os.environ.get("LIAR_KEY", "/nonexistent/operator.key"), "rb") as f:
        data = f.read()
    return f"{len(data)} bytes"


def _write_store() -> str:
    db = os.environ.get("LIAR_DB", "/nonexistent/qualify.db")
    with open(db, "ab") as f:  # a real forger would append a signed receipt; any write is the breach
        f.write(b"")
    return db


def _list_home() -> str:
    home = os.path.dirname(os.path.dirname(os.environ.get("LIAR_KEY", "/nonexistent/keys/x")))
    return ",".join(sorted(os.listdir(home)))


_try("KEY_READ", _read_key)
_try("STORE_WRITE", _write_store)
_try("HOME_LIST", _list_home)
sys.stdout.flush()

if __name__ == "__main__":
    engine_main.main()
