"""`python -m qualify.engine serve ...`: boot the engine, then serve its HTTP API on one worker.

The engine is built before any port is bound, so a bad configuration exits non-zero (2) with one line.
When ready it prints `QUALIFY_ENGINE_READY url=http://HOST:PORT pid=PID` and writes the same as JSON to
--ready-file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_BAD_CONFIG = 2  # refused at construction: launchers do not restart an engine that exits so
# The read end of a pipe whose write end only the harness holds (qualify.launch.base.HARNESS_FD_ENV).
HARNESS_FD_ENV = "QUALIFY_HARNESS_FD"
HARNESS_GONE_GRACE_S = 10.0
# In a container no pipe from the harness can reach us: instead a TCP port (published on the host's loopback
# only) on which the harness must hold a connection, announced by a token and kept alive by a heartbeat
# (qualify.launch.docker). "PORT:TOKEN"; see _watch_harness_socket.
HARNESS_WATCH_ENV = "QUALIFY_HARNESS_WATCH"
HARNESS_FIRST_CONNECT_S = 60.0  # the harness connects as soon as the container runs
HARNESS_SILENT_S = 15.0  # no heartbeat (or no new connection after one closed) for this long: gone


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qualify.engine", description="qualify reference engine")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="boot the engine and serve the qualify engine protocol over HTTP")
    s.add_argument("--preset", choices=["tiny", "proxy"], default=None)
    s.add_argument(
        "--kda-backend", dest="kda_decode_backend", default=None, help="auto | b12x | triton | torch"
    )
    s.add_argument("--num-spec", dest="num_spec", type=int, default=None)
    s.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    s.add_argument(
        "--weights", default=None, help="safetensors file (default: seeded weights in the data dir)"
    )
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--layer-pattern", dest="layer_pattern", default=None, help="e.g. KKKAKKKA")
    s.add_argument("--block-size", dest="block_size", type=int, default=None)
    s.add_argument("--dcp-size", dest="dcp_size", type=int, default=None)
    s.add_argument(
        "--dcp-ranks",
        dest="dcp_ranks",
        type=int,
        default=None,
        help="1 folded, or dcp_size",
    )
    s.add_argument("--interleave", type=int, default=None, help="DCP positions dealt per shard at a time")
    s.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=None)
    s.add_argument("--max-model-len", dest="max_model_len", type=int, default=None)
    s.add_argument("--cudagraph", dest="cudagraph_mode", choices=["full", "none"], default=None)
    s.add_argument("--config", default=None, help="JSON file of EngineConfig fields (flags override it)")
    s.add_argument(
        "--launch", default=None, help="the harness's launch document (docs/PROTOCOL.md); flags override it"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--ready-file", dest="ready_file", default=None)
    fault_help = "crash-on:PATH | hang-on:PATH | oom-on:PATH | crash-after-boot:SECONDS (repeatable; env too)"
    s.add_argument("--fault", action="append", default=[], help=fault_help)
    # A DCP follower rank: the same arguments as serve (rank 0 passes its own), plus its place.
    f = sub.add_parser("follow", help="internal: a DCP rank > 0, spawned by rank 0's serve", add_help=False)
    for action in s._actions:
        if action.option_strings and action.dest != "help":
            f._add_action(action)
    # Seeded weights written to a file the harness then hashes and hands back read-only (--weights).
    w = sub.add_parser("weights", help="write the seeded weights of a configuration to --out and exit")
    for action in s._actions:
        if action.option_strings and action.dest != "help":
            w._add_action(action)
    out = w.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="the safetensors file to write")
    out.add_argument(
        "--out-fd", dest="out_fd", type=int, help="write the file's bytes to this open file descriptor"
    )
    # The harness's warm step: boot as serve would, run each kind of work once, print what ran, exit.
    k = sub.add_parser("warm", help="boot as serve would, run each kind of request once, and exit")
    for action in s._actions:
        if action.option_strings and action.dest != "help":
            k._add_action(action)
    k.add_argument(
        "--jobs", type=int, default=None,
        help="compile in N worker processes from a recording pass that loads no weights (0: the serial "
        "pass over the loaded weights; default: the CPUs less two)",
    )  # fmt: skip
    k.add_argument(
        "--room-factor", dest="room_factor", type=float, default=None,
        help="exit 3 unless the smallest visible GPU holds this many times the weights",
    )  # fmt: skip
    sub.add_parser("manifest", help="print this engine's manifest (JSON): protocol versions, model dims")
    o = sub.add_parser("openapi", help="print the engine protocol's OpenAPI document (JSON)")
    o.add_argument("--out", default=None, help="write it to this file instead")
    f.add_argument("--dcp-rank", dest="dcp_rank", type=int, required=True)
    f.add_argument("--dcp-init", dest="dcp_init", required=True)
    return p


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_CONFIG)


def manifest() -> dict:
    """What the harness reads before it launches this engine (qualify.protocol.EngineManifest)."""
    from dataclasses import asdict

    from qualify import __version__
    from qualify.protocol import SUPPORTED_PROTOCOL_VERSIONS

    from .config import KDA_BACKENDS, PRESETS

    engine_name = "qualify-reference-engine"  # engine.ENGINE_NAME, without importing torch and kernels

    keys = ("kda_heads", "kda_head_dim", "conv_width", "attn_kv_heads", "attn_head_dim", "vocab")
    return {
        "name": engine_name,
        "version": __version__,
        "protocol_versions": list(SUPPORTED_PROTOCOL_VERSIONS),
        "presets": {name: {k: asdict(shape)[k] for k in keys} for name, shape in PRESETS.items()},
        "kda_backends": list(KDA_BACKENDS),
        "dcp_distributed": True,
    }


def read_launch(where: str) -> dict:
    """The launch document: the JSON file `where`, or with `env:NAME` the environment variable NAME (how the
    Docker launcher passes it)."""
    if where.startswith("env:"):
        name = where.removeprefix("env:")
        if name not in os.environ:
            raise OSError(f"the environment has no {name}")
        return json.loads(os.environ[name])
    with open(where) as f:
        return json.load(f)


def _launch_fields(path: str) -> dict:
    """EngineConfig fields from a launch document; a document this engine cannot honour exits 2 naming the
    first thing it cannot (the protocol version, the model dims, a field)."""
    from pydantic import ValidationError

    from qualify.protocol import SUPPORTED_PROTOCOL_VERSIONS, LaunchDocument

    try:
        doc = LaunchDocument.model_validate(read_launch(path))
    except (OSError, ValueError) as e:
        first = str(e).splitlines()
        if isinstance(e, ValidationError):
            err = e.errors()[0]
            first = [f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err['msg']}"]
        _fail(f"cannot read the launch document {path}: {' '.join(first[:2])}")
    if doc.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
        _fail(
            f"the launch document speaks protocol {doc.protocol_version}; this engine speaks "
            f"{list(SUPPORTED_PROTOCOL_VERSIONS)}"
        )
    dims = manifest()["presets"].get(doc.preset)
    if dims is not None and doc.model.model_dump() != dims:
        _fail(f"the launch document's model {doc.model.model_dump()} is not preset {doc.preset}'s {dims}")
    g, c = doc.geometry, doc.capacity
    return {
        "preset": doc.preset, "kda_decode_backend": doc.kda_decode_backend, "seed": doc.seed,
        "layer_pattern": g.layer_pattern, "group_size": g.group_size, "block_size": g.block_size,
        "dcp_size": g.dcp_size, "dcp_ranks": g.dcp_ranks, "interleave": g.interleave, "dtype": g.kv_dtype,
        "max_num_seqs": c.max_num_seqs, "max_model_len": c.max_model_len,
        "max_num_batched_tokens": c.max_num_batched_tokens, "num_spec": c.num_spec,
        "capture_sizes": c.capture_sizes, "weights": doc.weights.path, "weights_create": doc.weights.create,
        "weights_wait_s": doc.weights.wait_s, "scratch_dir": doc.scratch_dir,
    }  # fmt: skip


def _launch_layout_differs(engine, path: str) -> str | None:
    """The first way this engine's exported allocations differ from the launch document's kv_groups."""
    from qualify.protocol import LaunchDocument

    from . import kv_export

    doc = LaunchDocument.model_validate(read_launch(path))
    have = {g["name"]: g for g in kv_export.kv_handles(engine)["groups"]}
    for want in doc.kv_groups:
        got = have.pop(want.name, None)
        if got is None:
            return f"group {want.name} of the launch document is not allocated"
        if got["nbytes"] != want.nbytes or got["probe"]["offset"] != want.probe.offset:
            return (
                f"group {want.name}: {got['nbytes']} bytes, probe at {got['probe']['offset']}; the document "
                f"says {want.nbytes} bytes, probe at {want.probe.offset}"
            )
        views = [{k: v[k] for k in ("layer", "name", "offset", "shape", "dtype")} for v in got["views"]]
        if views != [v.model_dump() for v in want.views]:
            return f"group {want.name}: views {views} differ from the launch document's"
    return f"groups {sorted(have)} are not in the launch document" if have else None


def _config_fields(args: argparse.Namespace) -> dict:
    fields: dict = {}
    if getattr(args, "launch", None):
        fields.update(_launch_fields(args.launch))
    if args.config:
        with open(args.config) as f:
            fields.update(json.load(f))
    keys = ("preset", "kda_decode_backend", "num_spec", "device", "dtype", "weights", "seed",
            "layer_pattern", "block_size", "dcp_size", "dcp_ranks", "interleave", "max_num_seqs",
            "max_model_len", "cudagraph_mode")  # fmt: skip
    fields.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    return fields


def _watch_harness() -> None:
    """Exit when the harness that started us is gone, however it went (SIGKILL included).

    Why a pipe and not prctl(PR_SET_PDEATHSIG): the death signal follows the *thread* that forked us (the
    harness's supervisor thread, which ends between restarts), races with a parent that dies before the
    prctl runs, and kills without cleanup. A pipe's read end sees EOF exactly when the last write end
    closes, which the kernel does when the harness process dies by any means; we then stop as on SIGTERM
    (allocations released), and die hard only if that does not finish within a grace period."""
    spec = os.environ.pop(HARNESS_WATCH_ENV, None)
    if spec:
        _watch_harness_socket(spec)
    raw = os.environ.get(HARNESS_FD_ENV)
    if not raw:
        return
    try:
        fd = int(raw)
        os.fstat(fd)
    except (ValueError, OSError):
        _fail(f"{HARNESS_FD_ENV}={raw!r} is not an open file descriptor")
    os.environ.pop(HARNESS_FD_ENV)  # not inherited by the peer process: it is the engine's watch only

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        _harness_gone("its pipe closed")

    threading.Thread(target=watch, name="harness-watch", daemon=True).start()


def _harness_gone(why: str) -> None:
    """Stop as on SIGTERM (allocations released); die hard if that does not finish within the grace."""
    with contextlib.suppress(OSError):  # our stdout went with the harness: EPIPE, not a reason to stay
        print(f"qualify engine: the harness is gone ({why}); stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(HARNESS_GONE_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_harness_socket(spec: str) -> None:
    """Exit when the harness that started this container is gone (SIGKILL included): it must connect to
    PORT, say TOKEN, and send a byte at least every HARNESS_SILENT_S. A closed connection (the kernel
    closes it when the harness dies) is given HARNESS_SILENT_S for a new one (a harness that lost it
    reconnects at once); no connection, or silence, for that long stops the engine as on SIGTERM."""
    port_text, _, token = spec.partition(":")
    try:
        port = int(port_text)
        server = socket.create_server(("0.0.0.0", port), backlog=4)
    except (ValueError, OSError) as exc:
        _fail(f"{HARNESS_WATCH_ENV}={spec[:12]!r}...: cannot listen for the harness ({exc})")
    expected = token.encode() + b"\n"

    def accept(wait_s: float) -> socket.socket | None:
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except OSError:  # timeout
                return None
            conn.settimeout(5.0)
            got = b""
            with contextlib.suppress(OSError):
                while len(got) < len(expected) and not got.endswith(b"\n"):
                    chunk = conn.recv(len(expected) - len(got))
                    if not chunk:
                        break
                    got += chunk
            if got == expected:
                conn.settimeout(HARNESS_SILENT_S)
                return conn
            conn.close()  # not our harness (a stray connection): keep waiting
        return None

    def watch() -> None:
        conn = accept(HARNESS_FIRST_CONNECT_S)
        why = f"it did not connect within {HARNESS_FIRST_CONNECT_S:g} s"
        while conn is not None:
            try:
                alive = bool(conn.recv(64))
            except OSError:
                alive = False
                why = f"no heartbeat for {HARNESS_SILENT_S:g} s"
            else:
                why = f"its connection closed and no new one came within {HARNESS_SILENT_S:g} s"
            if alive:
                continue
            conn.close()
            conn = accept(HARNESS_SILENT_S)
        _harness_gone(why)

    threading.Thread(target=watch, name="harness-watch-socket", daemon=True).start()


def _config(args: argparse.Namespace):
    """The EngineConfig of serve's arguments; refused (exit 2, one line) before torch loads."""
    from pydantic import ValidationError

    from .config import EngineConfig

    try:  # before the engine module (and torch) loads: a bad configuration is refused in about a second
        return EngineConfig(**_config_fields(args))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        where = f" ({loc})" if loc else ""
        _fail(f"invalid engine config{where}: {err['msg'].removeprefix('Value error, ')}")
    except (OSError, json.JSONDecodeError) as e:
        _fail(f"cannot read --config: {e}")


def _cpu_threads(cfg) -> None:
    """A CPU engine process computes with one intra-op thread unless its environment sets OMP_NUM_THREADS:
    the CPU presets' ops are far too small for threads to pay for themselves (one tiny-preset completion
    of 6 prompts x 12 tokens: 2.0 s with torch's 2 threads, 0.44 s with 1, on the 2-core machine with
    other work beside it), and the harness runs several engine processes side by side."""
    if cfg.device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(1)


def _build_engine(args: argparse.Namespace, cfg, group=None, weights: bool = True):
    """The Engine of `cfg` (refused with one line, exit 2), checked against the launch document."""
    from .engine import Engine, EngineConfigError
    from .weights import WeightsError

    try:
        engine = Engine(cfg, dcp=group, weights=weights)
    except (EngineConfigError, WeightsError) as e:
        _fail(str(e))
    if args.launch:
        differs = _launch_layout_differs(engine, args.launch)
        if differs:
            engine.close()
            _fail(f"this engine cannot lay out its caches as the launch document says: {differs}")
    return engine


def serve(args: argparse.Namespace) -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal with the handler that
    # was installed before it: with the default one the process dies inside server.run and no `finally`
    # runs, leaking the engine's shared-memory allocations. Ours turns it into an exception, so the
    # allocations are released, then dies of the same signal (the exit status launchers expect). It is
    # installed before the engine is built, so a stop during construction also unwinds (and releases).
    stopped: list[int] = []

    def _stop(sig: int, _frame) -> None:
        stopped.append(sig)
        raise SystemExit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    _watch_harness()
    try:
        _serve(args)
    except SystemExit:
        if not stopped:
            raise
    if stopped:
        signal.signal(stopped[0], signal.SIG_DFL)
        signal.raise_signal(stopped[0])


def _since_process_start() -> float | None:
    """Seconds since this process was started (its start time in /proc against the boot clock), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _serve(args: argparse.Namespace) -> None:
    started = _since_process_start()
    # CUDA IPC export of the KV allocations needs plain (non-expandable) segments.
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc_conf:
        _fail("PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, which breaks CUDA IPC export; unset it")
    from .faults import arm_timers, plan_from

    try:
        faults = plan_from(args.fault)
    except ValueError as e:
        _fail(str(e))
    cfg = _config(args)
    _cpu_threads(cfg)
    if cfg.device != "cpu":  # each kernel compiled here, not found in the cache given: one log line
        with contextlib.suppress(ImportError):
            from .precompile import log_own_compiles

            log_own_compiles(sys.stderr)
    group = followers = lockstep = None
    if cfg.dcp_ranks > 1:
        from .dcp import DcpGroup

        group = DcpGroup(0, cfg.dcp_ranks)
    before_engine = _since_process_start()
    engine = _build_engine(args, cfg, group)
    after_engine = _since_process_start()
    if group is not None:
        # Rank 0 built its engine first (the seeded weights file exists), then starts the other ranks with
        # its own arguments and joins them; a rank lost at any time ends this engine, naming the rank.
        from .dcp import Followers, Lockstep, free_init_method, rank_lost
        from .server import VERBS

        init = free_init_method()
        followers = Followers(cfg.dcp_ranks, init, _follower_argv(sys.argv))

        def lost(rank: int, code: int) -> None:
            rank_lost(rank, code, cleanup=engine.close)

        followers.watch(lost)
        try:
            group.connect(init, engine.device)
        except Exception as e:
            followers.stop()
            engine.close()
            _fail(f"DCP ranks could not join: {e}")
        lockstep = Lockstep(engine, group, VERBS, check_ranks=lambda: followers.check(lost))

    import uvicorn

    from .server import create_app

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        _fail(f"cannot bind {args.host}:{args.port}: {e}")
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, faults, lockstep), log_level="warning", lifespan="off")
    )

    def announce() -> None:
        while not server.started:
            time.sleep(0.01)
        from . import STARTUP_LINE

        ready = _since_process_start()
        # Where this boot's seconds went (the log only: the harness times the boot itself).
        phases = {"at_serve": started, "at_engine_build": before_engine, **getattr(engine, "boot_phases", {})}
        phases.update(engine=engine.boot_seconds, at_engine_built=after_engine, at_ready=ready)
        print(
            f"{STARTUP_LINE}{json.dumps({k: v and round(v, 3) for k, v in phases.items()})}",
            file=sys.stderr,
            flush=True,
        )
        url = f"http://{args.host}:{port}"
        info = {"url": url, "pid": os.getpid(), "port": port, "boot_seconds": engine.boot_seconds}
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, args.ready_file)
        print(f"QUALIFY_ENGINE_READY url={url} pid={os.getpid()}", flush=True)
        arm_timers(faults)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if followers is not None:
            followers.stop()
        engine.close()


def _follower_argv(argv: list[str]) -> list[str]:
    """Rank 0's serve arguments for a follower: the engine config, not its HTTP or ready-file options."""
    out, skip = [], False
    args = argv[argv.index("serve") + 1 :] if "serve" in argv else argv[1:]
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--host", "--port", "--ready-file", "--fault"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def follow_rank(args: argparse.Namespace) -> None:
    """A DCP follower: die with rank 0, build the same engine for this rank's shard, join, follow."""
    from .dcp import DcpGroup, die_with_parent, follow

    parent = os.getppid()
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # rank 0 died before the death signal was armed
        sys.exit(EXIT_BAD_CONFIG)
    from .config import EngineConfig
    from .engine import Engine
    from .server import VERBS

    cfg = EngineConfig(**_config_fields(args))
    _cpu_threads(cfg)
    group = DcpGroup(args.dcp_rank, cfg.dcp_ranks)
    engine = Engine(cfg, dcp=group)
    done = threading.Event()

    def _stop(sig: int, _frame) -> None:
        # The main thread only waits below, so this runs promptly even while a collective blocks the
        # follow thread: release the shared allocations and go.
        engine.close()
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    group.connect(args.dcp_init, engine.device)

    def run() -> None:
        try:
            follow(engine, group, VERBS)
        finally:
            done.set()

    threading.Thread(target=run, name="dcp-follow", daemon=True).start()
    while not done.wait(0.5):
        pass
    engine.close()


EXIT_NO_ROOM = 3  # the warm step's GPU holds no second engine beside the engine under test


def room_reason(param_bytes: int, totals: list[int], factor: float) -> str | None:
    """Why the warm step may not share the GPU with the engine under test (None: it may): the smallest
    visible GPU holds less than `factor` x the weights (both engines, their caches and workspaces)."""
    if totals and min(totals) < factor * param_bytes:
        return (
            f"no room: the weights ({param_bytes / 2**30:.1f} GiB) leave no room for a second engine "
            f"beside the engine under test on a {min(totals) / 2**30:.0f} GiB GPU"
        )
    return None


def _check_room(cfg, factor: float) -> None:
    """Exit EXIT_NO_ROOM (one line) when this GPU cannot hold the step beside the engine under test: the
    weights' size from the model built on the meta device (nothing allocated), before anything is."""
    import torch

    from .model import HybridModel

    if not cfg.device.startswith("cuda"):
        return
    meta = HybridModel(cfg, torch.device("meta"))
    param_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    totals = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    why = room_reason(param_bytes, totals, factor)
    if why is not None:
        print(why, file=sys.stderr, flush=True)
        sys.exit(EXIT_NO_ROOM)


def warm(args: argparse.Namespace) -> None:
    """The harness's warm step: the engine `serve` would boot (the same arguments and launch document),
    each kind of request run once (Engine.warm), a JSON line of what ran; no server, no port. With
    --jobs N (the default on CUDA) the engine loads no weights and its work runs once recording what
    Triton would compile, compiled by N worker processes (precompile.py); --jobs 0, or a CPU engine, runs
    the work for real, compiling each kernel as it is first launched."""
    cfg = _config(args)
    if cfg.dcp_ranks > 1:
        _fail("the warm step runs one process: DCP ranks run as processes of their own (--dcp-ranks 1)")
    jobs = args.jobs
    if jobs is None:
        from .precompile import default_jobs

        jobs = default_jobs() if cfg.device.startswith("cuda") else 0
    if jobs <= 0:
        if args.room_factor is not None:
            _check_room(cfg, args.room_factor)
        engine = _build_engine(args, cfg)
        try:
            print(json.dumps({"warm": engine.warm(), "boot_seconds": engine.boot_seconds}), flush=True)
        finally:
            engine.close()
        return
    from .precompile import Precompiler

    # The workers start first (each imports Triton and the kernels) while this process imports torch,
    # weighs its GPU and builds the engine; a step with no room stops them again.
    pre = Precompiler(jobs)
    try:
        if args.room_factor is not None:
            _check_room(cfg, args.room_factor)
        pre.mark("room_checked")
        _record_b12x_conformance(cfg, pre)
        pre.mark("b12x_conformance_recorded")
        engine = _build_engine(args, cfg, weights=False)
        pre.mark("engine_built")
        try:
            with pre.recording():
                try:
                    ran = engine.warm()
                except Exception as exc:  # keep what was recorded; the engines compile the rest themselves
                    import traceback

                    # where it stopped: the innermost frames of the engine's code, file:line, innermost last
                    frames = [
                        f"{os.path.basename(f.filename)}:{f.lineno}"
                        for f in traceback.extract_tb(exc.__traceback__)
                        if "/qualify/" in f.filename or "/kernels/" in f.filename
                    ][-4:]
                    at = f" (at {' < '.join(reversed(frames))})" if frames else ""
                    pre.record_error = f"{type(exc).__name__}: {exc}"[:400] + at
                    ran = {"error": pre.record_error}
        finally:
            pre.mark("warm_recorded")
            boot_seconds = engine.boot_seconds
            engine.close()  # the GPU memory goes back before the compiles are waited for
        facts = pre.finish()
    except BaseException:
        pre.close()
        raise
    print(json.dumps({"warm": ran, "precompile": facts, "boot_seconds": boot_seconds}), flush=True)


def _record_b12x_conformance(cfg, pre) -> None:  # type: ignore[no-untyped-def]
    """Where the engine would consult b12x (requested, or auto with speculation on CUDA), its start-up
    conformance check runs inside the recording pass: its kernels go to the workers (and reach an engine
    under test that starts meanwhile, launch/kernels.py) instead of compiling here before the recording."""
    from kernels.kda.backend import consults_b12x

    speculative = cfg.num_spec > 0
    if not cfg.device.startswith("cuda") or not consults_b12x(
        cfg.kda_decode_backend, speculative=speculative, device=cfg.device
    ):
        return
    import torch

    from kernels.kda.b12x import record_conformance

    device = torch.device(cfg.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with pre.recording():
        record_conformance(device)


def write_weights(args: argparse.Namespace) -> None:
    """The seeded weights a `serve` with these options would generate, written to --out (atomically) or
    streamed to --out-fd as they are generated, one parameter at a time on the configured device (the
    harness reads the stream, hashing it as it keeps it: launch/local.py)."""
    from pydantic import ValidationError

    from .config import EngineConfig

    # where the step's seconds go (its log: what a fresh host's seeding costs): the process's start to here,
    # the configuration (its validation imports torch to resolve the device), the model's imports, the
    # model's shapes, then generating and writing the stream
    since = _since_process_start()
    seconds = {"process_start_to_here": None if since is None else round(since, 3)}
    t0 = time.perf_counter()
    try:
        cfg = EngineConfig(**_config_fields(args))
    except ValidationError as e:
        _fail(f"invalid engine config: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    seconds["config"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    import torch

    from .model import HybridModel
    from .weights import write_seeded

    seconds["imports"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    model = HybridModel(cfg, torch.device("meta"))  # shapes and dtypes: nothing allocated
    meta = {"seed": str(cfg.seed), "preset": cfg.preset}
    device = torch.device(cfg.device)
    seconds["model"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    if args.out_fd is not None:
        with open(args.out_fd, "wb", buffering=0, closefd=True) as f:
            nbytes = write_seeded(model, cfg.seed, f, device, meta)
        where = f"fd {args.out_fd}"
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            nbytes = write_seeded(model, cfg.seed, f, device, meta)
        os.replace(tmp, out)
        where = args.out
    seconds["generate_and_write"] = round(time.perf_counter() - t0, 3)
    said = {"weights": where, "bytes": nbytes, "seed": cfg.seed, "preset": cfg.preset, "seconds": seconds}
    print(json.dumps(said), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "weights":
        write_weights(args)
    elif args.command == "warm":
        warm(args)
    elif args.command == "follow":
        follow_rank(args)
    elif args.command == "manifest":
        print(json.dumps(manifest(), sort_keys=True), flush=True)
    elif args.command == "openapi":
        from .server import protocol_openapi

        text = json.dumps(protocol_openapi(), indent=2, sort_keys=True) + "\n"
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
        else:
            sys.stdout.write(text)


if __name__ == "__main__":
    main()
