"""`python -m tests.second_engine manifest` | `serve --launch FILE [--host H] [--port P]` (docs/PROTOCOL.md).

A launch document it cannot honour exits 2 with one line on stderr, before any port is bound. When it
serves it prints `QUALIFY_ENGINE_READY url=http://HOST:PORT pid=PID`. It stops on SIGTERM, and when the pipe
named by QUALIFY_HARNESS_FD reaches end-of-file (its harness is gone), removing its shared-memory files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading

EXIT_REFUSED = 2


def read_launch(where: str) -> dict:
    """The launch document: a JSON file, or `env:NAME` for the environment variable NAME (Docker)."""
    if where.startswith("env:"):
        return json.loads(os.environ[where.removeprefix("env:")])
    with open(where) as fh:
        return json.load(fh)


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EXIT_REFUSED)


def one_thread() -> None:
    """Compute with one intra-op thread unless OMP_NUM_THREADS says otherwise: this engine's ops are far too
    small for threads to pay, and its DCP ranks step in lockstep beside the harness's other engines, where
    each process's idle threads spin against the others' work."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.second_engine")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("manifest")
    s = sub.add_parser("serve")
    s.add_argument("--launch", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    f = sub.add_parser("follow")  # internal: a DCP rank > 0, started by rank 0
    f.add_argument("--launch", required=True)
    f.add_argument("--rank", type=int, required=True)
    f.add_argument("--address", required=True)
    f.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)

    from .engine import Engine, Refused, manifest

    if args.command == "manifest":
        print(json.dumps(manifest()), flush=True)
        return
    fd = os.environ.pop("QUALIFY_HARNESS_FD", None)  # rank 0's watch; never a follower's
    one_thread()
    if args.command == "follow":
        follow(args)
        return
    try:
        engine = Engine(read_launch(args.launch))
    except Refused as e:
        _fail(str(e))
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fail(f"cannot use the launch document {args.launch}: {type(e).__name__}: {e}")
    followers: list = []
    if engine.world > 1:
        followers = start_followers(engine, args.launch)

    from .server import serve

    try:
        httpd = serve(engine, args.host, args.port)
    except OSError as e:
        stop_followers(followers, engine)
        engine.close()
        _fail(f"cannot bind {args.host}:{args.port}: {e}")
    stopped: list[int] = []

    def stop(sig: int, _frame=None) -> None:
        stopped.append(sig)
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
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
        stop_followers(followers, engine)
        engine.close()
    if stopped:
        signal.signal(stopped[0], signal.SIG_DFL)
        os.kill(os.getpid(), stopped[0])


# ---------------------------------------------------------------- distributed DCP (docs/DCP.md)

FOLLOWER_BOOT_S = 120.0
RANK_LOST = "QUALIFY_DCP_RANK_LOST"  # the line rank 0 prints before it exits because a follower died
EXIT_RANK_LOST = 4
_stopping = threading.Event()


def start_followers(engine, launch: str) -> list:
    """Start ranks 1..N-1 as children, connect to each over a Unix socket (an authentication key in their
    environment), wait until each built its engine, and watch them: a rank that exits ends rank 0, naming
    it. Refuses (exit 2) when they do not come up in time."""
    import secrets
    import subprocess
    import tempfile
    from multiprocessing.connection import Listener

    key = secrets.token_bytes(16)
    address = os.path.join(tempfile.gettempdir(), f"second-engine-{os.getpid()}-{secrets.token_hex(4)}.sock")
    listener = Listener(address, family="AF_UNIX", authkey=key)
    procs = []
    for r in range(1, engine.world):
        cmd = [sys.executable, "-m", "tests.second_engine", "follow", "--launch", launch, "--rank", str(r),
               "--address", address, "--parent", str(os.getpid())]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env={**os.environ, "SECOND_ENGINE_KEY": key.hex()}))
    conns: dict[int, object] = {}

    def accept() -> None:
        while len(conns) < engine.world - 1:
            conn = listener.accept()
            hello, rank = conn.recv()
            conns[rank] = conn

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    t.join(FOLLOWER_BOOT_S)
    try:
        if len(conns) < engine.world - 1:
            raise RuntimeError(
                f"{engine.world - 1 - len(conns)} DCP rank(s) did not connect in {FOLLOWER_BOOT_S:g} s"
            )
        engine.conns = [conns[r] for r in range(1, engine.world)]
        for r, conn in enumerate(engine.conns, start=1):
            kind, why = conn.recv()
            if kind != "ok":
                raise RuntimeError(f"DCP rank {r} could not start: {why}")
    except (RuntimeError, EOFError, OSError) as e:
        for p in procs:
            p.kill()
        engine.close()
        _fail(f"DCP ranks could not join: {e}")
    finally:
        listener.close()
    for r, proc in enumerate(procs, start=1):
        threading.Thread(target=_watch_rank, args=(r, proc, engine), daemon=True).start()
    return procs


def _watch_rank(rank: int, proc, engine) -> None:
    code = proc.wait()
    if _stopping.is_set():
        return
    print(f"{RANK_LOST} rank={rank} exited with code {code}", flush=True)
    engine.close()
    os._exit(EXIT_RANK_LOST)


def stop_followers(procs: list, engine) -> None:
    _stopping.set()
    for conn in engine.conns:
        with contextlib.suppress(OSError):
            conn.close()  # a follower reads end-of-file and stops
    for p in procs:
        try:
            p.wait(timeout=5)
        except Exception:  # noqa: BLE001 - a rank that does not stop is killed
            p.kill()


def follow(args) -> None:
    """Rank r > 0: die with rank 0, connect, build the same engine for this rank's shard, then run what
    rank 0 sends until it closes the connection."""
    import ctypes
    from multiprocessing.connection import Client

    from .engine import Engine

    # A stop signal to the process group is rank 0's to act on: it closes the connections, and this rank
    # stops at their end-of-file. Rank 0's death, however it dies, kills this rank (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != args.parent:
        sys.exit(EXIT_REFUSED)
    conn = Client(args.address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("SECOND_ENGINE_KEY")))
    conn.send(("hello", args.rank))
    try:
        engine = Engine(read_launch(args.launch), rank=args.rank, conns=[conn])
    except Exception as e:  # noqa: BLE001 - rank 0 reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(EXIT_REFUSED)
    conn.send(("ok", None))
    try:
        engine.follow()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
