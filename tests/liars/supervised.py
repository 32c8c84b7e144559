"""Liar: a supervisor hides a restart. The launched process binds the engine's listening socket itself and
forks a worker (the reference engine, serving on that socket); the worker crashes right after it answers
the first `/qualify/reload`, and the supervisor forks a fresh one on the same socket, which the harness's
next request simply waits for. The launched pid never exits, `/health` answers with the supervisor's pid,
and the launcher counts no restart: only the process tree in /proc shows a worker replaced under the
launched process (qualify/watch/procs.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

from qualify.engine import __main__ as engine_main

INCARNATION_ENV = "LIAR_SUPERVISED_INCARNATION"
MAX_WORKERS = 3


class _Bound(socket.socket):
    """The supervisor's listening socket, handed to the engine as if it had just bound it."""

    def bind(self, _address) -> None:
        pass

    def listen(self, _backlog: int = 0) -> None:
        pass


def _worker(fd: int, supervisor: int, first: bool) -> None:
    import uvicorn
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse

    from qualify.engine import server

    honest_app = server.create_app
    servers: list[uvicorn.Server] = []
    honest_init = uvicorn.Server.__init__

    def recording_init(self, *args, **kwargs) -> None:
        honest_init(self, *args, **kwargs)
        servers.append(self)

    uvicorn.Server.__init__ = recording_init

    def _die(_engine) -> None:
        # Stop accepting and let the answer go out; serve() then releases the engine, and the worker ends
        # with status 1 (below): connections that arrive meanwhile wait in the supervisor's backlog.
        for s in servers:
            s.should_exit = True

    def lying_app(engine, *args, **kwargs):
        app = honest_app(engine, *args, **kwargs)

        @app.middleware("http")
        async def hide(request, call_next):
            if request.url.path == "/health":
                return JSONResponse({"status": "ok", "ready": True, "pid": supervisor})
            response = await call_next(request)
            if first and request.url.path == "/qualify/reload":
                response.headers["connection"] = "close"  # the client's next request opens a new one
                response.background = BackgroundTask(_die, engine)  # once the answer is sent
            return response

        return app

    server.create_app = lying_app
    fake = type(sys)("socket")
    fake.__dict__.update(socket.__dict__)
    fake.socket = lambda *_a, **_k: _Bound(fileno=os.dup(fd))
    engine_main.socket = fake
    engine_main.main()


def supervise(argv: list[str]) -> None:
    args = engine_main._parser().parse_args(argv)
    if args.command != "serve":  # the manifest, the seeded weights: the honest engine's answers
        engine_main.main(argv)
        return
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    listener.listen(128)
    fd = listener.fileno()
    me = os.getpid()
    child: list[int] = []
    stopping = threading.Event()

    def _stop(sig: int, _frame) -> None:
        stopping.set()
        for pid in child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    harness = os.environ.get(engine_main.HARNESS_FD_ENV)
    if harness:  # the harness's pipe: stop with the harness, as the engine does

        def watch() -> None:
            with contextlib.suppress(OSError):
                while os.read(int(harness), 64):
                    pass
            os.kill(me, signal.SIGTERM)

        threading.Thread(target=watch, daemon=True).start()
    for n in range(1, MAX_WORKERS + 1):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _worker(fd, me, first=n == 1)
            os._exit(1 if n == 1 else 0)
        child[:] = [pid]
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if stopping.is_set() or os.waitstatus_to_exitcode(status) == 0:
            break
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stopping.is_set():
        os.kill(me, signal.SIGTERM)
    sys.exit(1)


if __name__ == "__main__":
    supervise(sys.argv[1:])
