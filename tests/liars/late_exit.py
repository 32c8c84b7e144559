"""Liar: the reference engine answers every check honestly, then dies with status 1 after the faults check,
so only a verdict read after the engine stopped can see it. LIAR_LATE_EXIT picks when: `metrics` (right
after answering the faults check's final /metrics; the supervisor may restart it) or `sigterm` (on the
harness's stop signal, instead of dying of it)."""

from __future__ import annotations

import contextlib
import os
import signal

from starlette.background import BackgroundTask

from qualify.engine import __main__ as engine_main
from qualify.engine import server

MODE = os.environ.get("LIAR_LATE_EXIT", "metrics")
_honest_app = server.create_app


def _die(engine) -> None:
    with contextlib.suppress(Exception):
        engine.close()  # release the shared-memory allocations first: a liar must not leak files either
    os._exit(1)


def _lying_app(engine, *args, **kwargs):
    app = _honest_app(engine, *args, **kwargs)
    if MODE == "metrics":

        @app.middleware("http")
        async def exit_after_metrics(request, call_next):
            response = await call_next(request)
            if request.url.path == "/metrics":
                response.background = BackgroundTask(_die, engine)  # runs once the answer was sent
            return response

    return app


server.create_app = _lying_app  # serve() imports create_app when it runs, so it gets this one
if MODE == "sigterm":
    # serve() closes the engine on SIGTERM and then re-raises the signal to die of it; exit 1 instead.
    signal.raise_signal = lambda _sig: os._exit(1)

if __name__ == "__main__":
    engine_main.main()
