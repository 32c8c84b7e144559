"""`python -m tests.second_engine manifest` | `serve --launch FILE [--host H] [--port P]` (docs/PROTOCOL.md).

A launch document it cannot honour exits 2 with one line on stderr, before any port is bound. When it
serves it prints `QUALIFY_ENGINE_READY url=http://HOST:PORT pid=PID`. It stops on SIGTERM, and when the pipe
named by QUALIFY_HARNESS_FD reaches end-of-file (its harness is gone), removing its shared-memory files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

EXIT_REFUSED = 2


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EXIT_REFUSED)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.second_engine")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("manifest")
    s = sub.add_parser("serve")
    s.add_argument("--launch", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)

    from .engine import Engine, Refused, manifest

    if args.command == "manifest":
        print(json.dumps(manifest()), flush=True)
        return
    try:
        with open(args.launch) as f:
            doc = json.load(f)
        engine = Engine(doc)
    except Refused as e:
        _fail(str(e))
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fail(f"cannot use the launch document {args.launch}: {type(e).__name__}: {e}")

    from .server import serve

    try:
        httpd = serve(engine, args.host, args.port)
    except OSError as e:
        engine.close()
        _fail(f"cannot bind {args.host}:{args.port}: {e}")
    stopped: list[int] = []

    def stop(sig: int, _frame=None) -> None:
        stopped.append(sig)
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    fd = os.environ.pop("QUALIFY_HARNESS_FD", None)
    if fd:

        def watch() -> None:
            try:
                while os.read(int(fd), 64):
                    pass
            except OSError:
                pass
            print("second engine: the harness is gone; stopping", file=sys.stderr, flush=True)
            stop(signal.SIGTERM)

        threading.Thread(target=watch, daemon=True).start()
    port = httpd.server_address[1]
    print(f"QUALIFY_ENGINE_READY url=http://{args.host}:{port} pid={os.getpid()}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
        engine.close()
    if stopped:
        signal.signal(stopped[0], signal.SIG_DFL)
        os.kill(os.getpid(), stopped[0])


if __name__ == "__main__":
    main()
