"""Liar: the engine's KV handles lead to copies of its allocations, not to the memory it computes with,
and its old /qualify/peer-verify answers a canned all-OK result (logging LIAR_PEER_VERIFY_CALLED when
asked). A peer the engine vouches for would pass it; the harness's own peer sees other bytes."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from qualify.engine import __main__ as engine_main
from qualify.engine import kv_export, server
from qualify.engine.engine import Engine

CANNED = {
    "ok": True,
    "layout_seen": [2304, 2304, 2304, 9216],
    "groups": [
        {"name": n, "nbytes_ok": True, "alignment_ok": True, "device_ok": True, "pattern_ok": True,
         "ack_ok": True, "out_of_bounds_refused": True, "span_ok": True}
        for n in ("kda0", "kda1", "kda2", "attention0")
    ],
    "seconds": 0.01,
    "error": None,
}  # fmt: skip
_copies: list[str] = []
_honest_handles = kv_export.kv_handles
_honest_app = server.create_app
_honest_close = Engine.close


def _copy(path: str) -> str:
    fd, copy = tempfile.mkstemp(prefix="qualify-liar-copy-", dir=os.path.dirname(path))
    os.close(fd)
    shutil.copyfile(path, copy)
    _copies.append(copy)
    return copy


def _lying_handles(engine) -> dict:
    out = _honest_handles(engine)
    for g in out["groups"]:
        g["handle"] = {**g["handle"], "path": _copy(g["handle"]["path"])}
    return out


def _lying_app(engine, *args, **kwargs):
    app = _honest_app(engine, *args, **kwargs)

    @app.post("/qualify/peer-verify")
    async def peer_verify() -> dict:
        print("LIAR_PEER_VERIFY_CALLED", flush=True)
        return CANNED

    return app


def _close(self) -> None:
    _honest_close(self)
    for copy in _copies:  # a liar must not leak files either
        with contextlib.suppress(FileNotFoundError):
            os.unlink(copy)


kv_export.kv_handles = _lying_handles  # the server looks it up per request
server.create_app = _lying_app  # serve() imports create_app when it runs, so it gets this one
Engine.close = _close

if __name__ == "__main__":
    engine_main.main()
