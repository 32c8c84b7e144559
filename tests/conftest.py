"""Shared fixtures: a throwaway PostgreSQL cluster, and store URLs for both dialects; how the suite runs in
parallel (pytest-xdist: `make test` runs PYTEST_WORKERS of them, 2 by default): Docker tests one at a time
across the workers, `serial` tests after the rest, in one process."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Without an NVIDIA GPU, Triton kernels run under its interpreter. The variable must be set before the
# first @triton.jit kernel is defined, i.e. before any test module imports kernels.kda; the root conftest
# is loaded before every other one.
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may read or write the user's own data dir (keys, the default store, run dirs): the whole session
# gets a QUALIFY_HOME of its own, and QUALIFY_DB_URL from the caller's shell is dropped. Tests that need a
# home of their own still set one; this is the floor under them. Set before any test module is imported.
USER_QUALIFY_HOME = os.environ.get("QUALIFY_HOME")
os.environ["QUALIFY_HOME"] = tempfile.mkdtemp(prefix="qualify-test-home-")
os.environ.pop("QUALIFY_DB_URL", None)
# The harness's cache (file digests of the sandbox's code mounts, seeded weights) is the tests' own, never
# the user's, and kept across sessions: the first run hashes the interpreter and its site-packages (seconds),
# later ones only stat them. tests/harness/conftest.py fills it before the first timed run.
os.environ["QUALIFY_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"qualify-test-cache-{os.getuid()}")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """In-process torch computes with one intra-op thread, as the engine processes the tests start do: two
    pytest-xdist workers on the 2-core machine, each with torch's default threads, spin against each other
    (tests/engine/test_fused_glue.py beside tests/test_bench_batch_variance.py in two workers, 2026-12-06:
    70.2 and 68.4 s with the default threads, 63.1 and 61.1 s with one). The environment is left as it is."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# Tests that share the Docker daemon's containers: one checks that it leaves no container of its label behind,
# `qualify gc` and `qualify run --launcher docker` reap those whose harness is gone, and the engine image is
# built once. Under pytest-xdist they run one at a time across the workers, each holding a host lock for its
# whole run (`_docker_one_at_a_time`), while the other worker goes on with the rest. (xdist's own `--dist
# loadgroup` would keep them in one worker, but it groups by rewriting `item._nodeid`, which pytest 9 no
# longer reads: seen on 2026-12-04, when two workers ran Docker tests at once and each saw the other's
# containers as left behind.)
DOCKER_FIXTURES = frozenset(
    {"docker_available", "engine_image", "no_leftover_containers", "second_image", "pushed_image", "registry"}
)


def _uses_docker(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("docker")) or bool(
        DOCKER_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


@pytest.fixture(autouse=True)
def _docker_one_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse fixtures are set up first, so the lock is held before a test's own fixtures look at Docker."""
    if not _uses_docker(request.node):
        yield
        return
    with host_lock("docker-tests"):
        yield


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """One holder at a time on this host (pytest-xdist workers, or two checkouts' suites): for set-up that
    fills a cache they share (the harness's file digests, sigstore-js, the engine image)."""
    path = os.path.join(tempfile.gettempdir(), f"qualify-test-{name}-{os.getuid()}.lock")
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _need(what: str, why: str) -> None:
    """Skip locally, fail in CI: CI must run every service-backed test."""
    msg = f"{what} unavailable: {why}"
    if IN_CI:
        pytest.fail(msg + " (CI requires it)")
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return os.path.dirname(found[-1]) if found else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """Start a PostgreSQL cluster as the `postgres` user in a temp dir; yield a SQLAlchemy base URL."""
    bindir = _pg_bindir()
    if bindir is None:
        _need("PostgreSQL", "no /usr/lib/postgresql/*/bin/initdb")
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        _need("PostgreSQL", "no 'postgres' system user")
    root = tempfile.mkdtemp(prefix="qualify-pg-")
    data, sock = os.path.join(root, "data"), os.path.join(root, "sock")
    os.makedirs(sock)
    for p in (root, sock):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    os.chmod(root, 0o755)
    port = _free_port()

    def as_pg(*cmd: str) -> subprocess.CompletedProcess:
        run_as = [] if os.getuid() == pw.pw_uid else ["runuser", "-u", "postgres", "--"]
        return subprocess.run([*run_as, *cmd], capture_output=True, text=True, timeout=120)

    r = as_pg(f"{bindir}/initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
    if r.returncode != 0:
        _need("PostgreSQL", f"initdb failed: {r.stderr.strip()[-300:]}")
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    r = as_pg(f"{bindir}/pg_ctl", "-D", data, "-o", opts, "-l", os.path.join(root, "log"), "-w", "start")
    if r.returncode != 0:
        logfile = os.path.join(root, "log")
        log = Path(logfile).read_text()[-500:] if os.path.exists(logfile) else ""
        _need("PostgreSQL", f"pg_ctl start failed: {r.stderr.strip()[-300:]} {log}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        as_pg(f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


_db_counter = 0


@pytest.fixture
def pg_url(postgres_server: str) -> str:
    """A fresh, empty PostgreSQL database on the throwaway cluster."""
    global _db_counter
    _db_counter += 1
    name = f"t{os.getpid()}_{_db_counter}_{int(time.time() * 1000) % 100000}"
    import psycopg

    dsn = postgres_server.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{postgres_server}/{name}"


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'qualify.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request) -> str:
    """Run a store test against both dialects."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")
