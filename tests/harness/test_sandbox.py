"""The local engine's sandbox (qualify/launch/sandbox.py), against a real sandboxed engine and real files:
another uid in its own namespaces, a clean environment, the data dir and the checkout absent, the weights
read-only, the engine's host pid tracked; the code digest; deterministic weight files; the refusal when
no sandbox can be had. docs/SANDBOX.md has the threat model these hold."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from qualify.checks.boot import holds_listener
from qualify.client import EngineClient, EngineUnreachable
from qualify.launch.base import EngineOptions
from qualify.launch.local import LocalLauncher
from qualify.launch.sandbox import (
    SANDBOX_UID,
    SCRATCH,
    DigestCache,
    Sandbox,
    engine_code,
    locate_module,
    ns_pids,
    parse_engine_env,
    tree_digest,
)

from .conftest import ROOT, Home

pytestmark = pytest.mark.slow


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def test_a_sandboxed_engine_is_another_uid_in_its_own_namespaces(tmp_path: Path) -> None:
    home = tmp_path / "operator-home"
    (home / "keys").mkdir(parents=True)
    (home / "keys" / "operator.key").write_text("secret")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"},
        "QUALIFY_HOME": str(home),
        "SECRET_TOKEN": "operator-only",
    }
    sandbox = Sandbox.for_engine("qualify.engine", gpu=False, operator_env={"ADDED": "1"}, env=env)
    launcher = LocalLauncher(EngineOptions("tiny", "torch"), tmp_path / "run", env=env, sandbox=sandbox)
    try:
        url = launcher.start(120)
        st = launcher.status().detail
        pid = st["pid"]
        assert st["sandbox_pid"] != pid and st["engine_ns_pid"] == [pid, 2] == ns_pids(pid)
        # Its own word, its pid namespace's pid, over a connection made in its network namespace.
        assert EngineClient(url, netns=launcher.netns).health().pid == 2
        status = _status(pid)
        if os.geteuid() == 0:  # a host uid of its own, no capabilities
            assert status["Uid"].split() == [str(SANDBOX_UID)] * 4
            assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000"
        assert status["NoNewPrivs"] == "1"
        for ns in ("mnt", "pid", "ipc", "uts"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
        if sandbox.own_net:  # root: a network of its own, not reachable on the host's loopback
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=5)
        else:  # documented: a harness without root cannot enter one, so the engine keeps the host's
            assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
        assert holds_listener(pid, urlsplit(url).port) is True  # the launched engine serves the port
        if sandbox.own_net:  # the peer joins its pid, net, IPC and UTS namespaces as the harness's own uid
            show = (
                "import os; ns = ('pid', 'net', 'ipc', 'uts', 'mnt'); "
                "print(*(os.readlink(f'/proc/self/ns/{n}') for n in ns), "
                "os.readlink('/proc/self') == str(os.getpid()), os.getuid(), os.path.isfile(os.sys.argv[1]))"
            )
            readme = str(ROOT / "README.md")
            cmd = launcher._into_engine_namespaces([sys.executable, "-I", "-c", show, readme])
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.split()
            assert got[:4] == [os.readlink(f"/proc/{pid}/ns/{n}") for n in ("pid", "net", "ipc", "uts")]
            # Its own /proc of that pid namespace (CUDA reads /proc/<getpid()>), the harness's files, uid.
            assert got[4] != os.readlink("/proc/self/ns/mnt")
            assert got[4] != os.readlink(f"/proc/{pid}/ns/mnt")
            assert got[5:] == ["True", str(os.getuid()), "True"]
        # A clean environment: nothing of the operator's but what the protocol names and what was added.
        environ = dict(
            e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e
        )
        assert "SECRET_TOKEN" not in environ and environ["ADDED"] == "1"
        assert environ["HOME"].startswith(SCRATCH) and environ["QUALIFY_HOME"].startswith(SCRATCH)
        assert "PYTHONPATH" not in environ
        # Its mount namespace: the data dir and the checkout's other files are not there; code read-only.
        root = Path(f"/proc/{pid}/root")
        assert not (root / str(home).lstrip("/")).exists()
        assert not (root / str(ROOT / "tests").lstrip("/")).exists()
        assert (root / str(ROOT / "qualify" / "engine").lstrip("/")).is_dir()
        assert (root / str(ROOT / "README.md").lstrip("/")).exists() is False
        mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()

        def opts(point: str) -> set[str]:
            (line,) = [m for m in mounts if m.split()[4] == point]
            return set(line.split()[5].split(","))

        weights = launcher.weights
        assert weights is not None and "ro" in opts(weights.engine_path)
        assert "ro" in opts(str(ROOT / "qualify")) and "ro" in opts("/")
        assert "rw" in opts(SCRATCH)
        with pytest.raises(OSError):
            (root / weights.engine_path.lstrip("/")).open("ab")
    finally:
        final = launcher.stop()
    if sandbox.own_net:  # its address is nobody's now: the client never tries the host's network instead
        with pytest.raises(EngineUnreachable, match="the engine was stopped"):
            EngineClient(url, netns=launcher.netns).health()
    # Stopped by SIGTERM to the engine itself (not bwrap), so it released its allocations and died of it.
    assert final.exit_code == -signal.SIGTERM and not final.alive
    assert not launcher.scratch.exists()  # what it wrote goes with it


def test_a_sandboxed_engine_that_crashes_is_restarted_and_tracked_by_its_host_pid(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"},
        "QUALIFY_HOME": str(tmp_path / "home"),
        "QUALIFY_ENGINE_FAULT": "crash-after-boot:1.0",
    }
    sandbox = Sandbox.for_engine("qualify.engine", gpu=False, env=env)
    launcher = LocalLauncher(
        EngineOptions("tiny", "torch"), tmp_path / "run", env=env, sandbox=sandbox, max_restarts=1
    )
    try:
        launcher.start(120)
        first = launcher.status().detail["pid"]
        end = time.monotonic() + 90
        while launcher.status().detail["boots"] < 2 and time.monotonic() < end:
            time.sleep(0.1)
        assert launcher.wait_ready(60)
    finally:
        final = launcher.stop()
    assert final.restart_count == 1 and final.detail["pids"][0] == first
    assert len(set(final.detail["pids"])) == 2 and final.detail["exit_codes"][0] == 3


def test_the_code_digest_covers_every_file_of_the_mounts(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("x = 1\n")
    (site / "pkg" / "native.so").write_bytes(b"\x7fELF")
    cache = DigestCache(tmp_path / "cache.json")
    base, n = tree_digest([str(site)], cache)
    assert n == 2
    (site / "pkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"bytecode")
    assert tree_digest([str(site)], cache)[0] == base  # bytecode caches are not hashed
    (site / "inject.pth").write_text("import evil\n")  # a .pth dropped beside the distributions
    with_pth, _ = tree_digest([str(site)], cache)
    assert with_pth != base
    (site / "inject.pth").unlink()
    assert tree_digest([str(site)], cache)[0] == base
    (site / "pkg" / "native.so").write_bytes(b"\x7fELF!")  # rewritten in place: a new ctime, a new digest
    assert tree_digest([str(site)], cache)[0] != base
    (site / "link").symlink_to("/etc/passwd")
    assert tree_digest([str(site)], DigestCache(None))[1] == 3
    # Only what is hashed counts: the digest is the harness's own, over its own walk of the files.
    assert tree_digest([str(site)], DigestCache(None))[0] == tree_digest([str(site)], cache)[0]


@pytest.mark.parametrize("modules", [3, 200])  # in the harness's process; in parallel workers
def test_bytecode_is_compiled_from_the_bytes_there_now_even_when_an_mtime_is_set_back(
    tmp_path: Path, modules: int
) -> None:
    import importlib.util
    import marshal

    site, into = tmp_path / "site-packages", tmp_path / "pycache"
    (site / "pkg").mkdir(parents=True)
    for i in range(modules):
        (site / "pkg" / f"m{i}.py").write_text(f'VALUE = "{i:03d}"\n')
    tag = sys.implementation.cache_tag

    def compiled(i: int) -> tuple[int, object]:
        pyc = into / str(site / "pkg").lstrip("/") / f"m{i}.{tag}.pyc"
        data = pyc.read_bytes()
        assert data[:4] == importlib.util.MAGIC_NUMBER
        return pyc.stat().st_mtime_ns, marshal.loads(data[16:]).co_consts

    tree_digest([str(site)], DigestCache(None), compile_into=into)
    first = [compiled(i) for i in range(modules)]
    assert all(f"{i:03d}" in first[i][1] for i in range(modules))  # type: ignore[operator]
    tree_digest([str(site)], DigestCache(None), compile_into=into)
    assert [compiled(i) for i in range(modules)] == first  # nothing changed: nothing compiled again
    # Same size, mtime set back: Python's own header check would take the old bytecode; the harness's
    # (the source's ctime, which cannot be set back) compiles it again.
    src = site / "pkg" / "m1.py"
    st = src.stat()
    src.write_text('VALUE = "999"\n')
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    tree_digest([str(site)], DigestCache(None), compile_into=into)
    assert "999" in compiled(1)[1] and compiled(0) == first[0]  # type: ignore[operator]


def test_the_code_set_of_a_wrapped_engine_is_its_whole_package_found_without_importing_it() -> None:
    root, files = locate_module("tests.liars.late_exit")
    assert root == ROOT and files == [ROOT / "tests" / "liars", ROOT / "tests" / "__init__.py"]
    code = engine_code("tests.liars.late_exit")
    assert str(ROOT / "tests" / "liars") in code.mounts and str(ROOT / "tests") not in code.mounts
    assert str(ROOT / "tests" / "liars") in code.hashed and code.pythonpath == (str(ROOT),)
    assert str(ROOT / "qualify") in code.mounts and str(ROOT / "kernels") in code.mounts
    assert "tests.liars.late_exit" not in sys.modules  # located, never imported by the harness
    assert str(Path(sys.prefix).resolve()) in code.mounts


def test_engine_env_items_are_checked() -> None:
    assert parse_engine_env(["A=1", "B_C=x=y"]) == {"A": "1", "B_C": "x=y"}
    for bad in ("NOEQUALS", "=1", "1A=2", "PYTHONPATH=/x", "LD_PRELOAD=/x.so", "A-B=1"):
        with pytest.raises(ValueError):
            parse_engine_env([bad])


def test_weight_files_are_byte_deterministic_for_a_seed(tmp_path: Path) -> None:
    digests = []
    for hashseed in ("1", "2"):  # the library's metadata map follows the process's hash seed
        out = tmp_path / f"w{hashseed}.safetensors"
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "QUALIFY_HOME": str(tmp_path / "home")}
        cmd = [sys.executable, "-m", "qualify.engine", "weights", "--preset", "tiny", "--device", "cpu"]
        subprocess.run([*cmd, "--out", str(out)], check=True, env=env, capture_output=True, timeout=180)
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_a_host_without_a_sandbox_is_refused_in_one_line_unless_the_operator_says_so(home: Home) -> None:
    env = home.env(QUALIFY_BWRAP=str(home.path / "no-such-bwrap"))
    ran = home.qualify("run", "--json", env=env)
    assert ran.code == 2 and ran.stdout == ""
    (line,) = ran.stderr.strip().splitlines()
    assert "no sandbox" in line and "--no-sandbox" in line
    assert not (home.path / "runs").exists() and not home.db.exists()  # nothing written
    bad = home.qualify("run", "--engine-env", "PYTHONPATH=/x", env=home.env())
    assert bad.code == 2 and "--engine-env PYTHONPATH" in bad.stderr
