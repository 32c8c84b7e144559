"""The engine's sandbox, shared by the launchers (docs/SANDBOX.md has the threat model).

Local engines run under bubblewrap (`bwrap`): their own mount, pid, IPC and UTS namespaces, an identity
that is not the operator's (uid 65534: a real host uid when the harness runs as root, dropped by
util-linux `setpriv` inside the sandbox; else a user namespace's uid 65534 over the operator's own uid),
a root that holds only what the engine needs read-only (the interpreter, the installed distributions,
the engine's packages, the weights file the harness hashed) and one private scratch dir as the only
writable path besides /dev/shm (the CPU KV allocations the peer imports live there; on a GPU the host's
/dev is bound so CUDA and CUDA IPC work). The operator's data dir (keys, store, run dirs) and the rest of
the project checkout are absent. The environment is built from nothing: the variables the engine
protocol names, plus what the operator adds with `--engine-env`, all recorded in the receipt. The network
is its own when the harness runs as root (bwrap --unshare-net: loopback only, no route anywhere; the
harness makes its connections to the engine's 127.0.0.1 port inside that namespace, qualify/netns.py);
a harness without root cannot enter such a namespace, and its engine keeps the host's network, as the
receipt says (docs/SANDBOX.md). `--die-with-parent` and `--new-session` tie it to its harness and keep
it off the operator's terminal.

The code subject is a digest of what the engine can import inside: every file under the code mounts
(bytecode caches aside), through a stat-keyed cache of file digests kept in the harness's cache dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import py_compile
import select
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.launch.base import FAULT_ENV, HARNESS_FD_ENV, LaunchError
from qualify.launch.kernels import CACHE_SUBDIR

BWRAP_ENV = "QUALIFY_BWRAP"  # a bwrap binary to use (a carried copy: its libraries in the same folder)
# Extra code folders the operator gives the engine on purpose (colon-separated; e.g. wheels unpacked with
# pip --target on a GPU host): mounted read-only, on the engine's PYTHONPATH, hashed into the code subject.
# The harness's own PYTHONPATH never reaches the engine.
ENGINE_PATH_ENV = "QUALIFY_ENGINE_PATH"
CACHE_ENV = "QUALIFY_CACHE_DIR"  # the harness's cache (file digests, seeded weights); not the engine's
SANDBOX_UID = SANDBOX_GID = 65534  # nobody/nogroup on Debian
SCRATCH = "/qualify/scratch"  # the engine's only writable folder, inside the sandbox
WEIGHTS_DIR = "/qualify/weights"  # where the harness's weights file appears, read-only
# Where the bytecode the harness compiled from the hashed sources appears, read-only: the engine's
# PYTHONPYCACHEPREFIX, so no __pycache__ beside a source (which the code digest does not cover) is read.
PYCACHE_DIR = "/qualify/pycache"
HOSTNAME = "qualify-engine"
PROBE_TIMEOUT_S = 15.0
INFO_TIMEOUT_S = 30.0
# Variables of the harness's environment the engine gets when they are set (the engine protocol's own,
# and what selects or configures the device). Everything else the engine sees is set here or added by the
# operator with --engine-env.
FORWARDED_ENV = (
    FAULT_ENV,
    "TRITON_INTERPRET",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TRITON_LIBCUDA_PATH",
)
# Top-level folders that are symlinks into /usr on a merged-/usr system, or folders of their own.
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc files a Python process with torch reads (the dynamic loader's cache, time zone, name service).
ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "nsswitch.conf",
    "hosts",
    "alternatives",
)
GPU_EXTRA = ("/usr/local/nvidia", "/usr/local/cuda", "/etc/nvidia", "/run/nvidia-persistenced")
SKIP_DIRS = {"__pycache__"}


class SandboxUnavailable(LaunchError):
    """This host cannot give the engine a sandbox: one line saying why and what to do."""


def pycache_dir() -> Path:
    """The harness's own bytecode of the engine's code mounts (this interpreter's cache tag)."""
    return cache_dir() / f"pycache-{sys.implementation.cache_tag}"


# Compiles the "source\ttarget" lines of the file argv[1] names (run with -I: nothing of any PYTHONPATH); a
# file that does not compile is left to fail in the engine, as Python would fail it there.
_COMPILE_WORKER = """
import py_compile, sys, warnings
warnings.simplefilter("ignore")
for line in open(sys.argv[1], encoding="utf-8"):
    src, _, cfile = line.rstrip("\\n").partition("\\t")
    try:
        py_compile.compile(src, cfile=cfile, dfile=src, doraise=True, quiet=2)
    except Exception:
        pass
"""
COMPILE_INLINE = 64  # fewer stale files than this compile in the harness's own process
COMPILE_TIMEOUT_S = 900.0


def _pyc_path(source: str, into: Path) -> str:
    head, name = os.path.split(source)
    return os.path.join(into, head.lstrip(os.sep), f"{name[:-3]}.{sys.implementation.cache_tag}.pyc")


def _stale(source_st: os.stat_result, target: str) -> bool:
    """Whether `target` was not written after the source last changed. The harness writes every .pyc
    there itself (the engine never sees the cache dir); a source's ctime moves on any write and no process
    can set it back, so a .pyc younger than its source's ctime was compiled from the bytes there now.
    (Python's own check, the header's source size and mtime, stays on at import: an mtime can be set back.)"""
    try:
        return os.stat(target).st_mtime_ns <= source_st.st_ctime_ns
    except OSError:
        return True


def compile_sources(pairs: list[tuple[str, str]], timeout_s: float = COMPILE_TIMEOUT_S) -> None:
    """Bytecode of each (source, target): in this process for a few, else in one `python -I` worker per
    core (a GPU host's site-packages holds tens of thousands of modules)."""
    if len(pairs) < COMPILE_INLINE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a SyntaxWarning of some test file in site-packages is not ours
            for src, cfile in pairs:
                with contextlib.suppress(Exception):
                    py_compile.compile(src, cfile=cfile, dfile=src, doraise=True, quiet=2)
        return
    import tempfile

    n = max(1, min(os.cpu_count() or 1, 16, len(pairs) // COMPILE_INLINE))
    with tempfile.TemporaryDirectory(prefix="qualify-compile-") as tmp:
        procs = []
        for i in range(n):
            todo = Path(tmp) / f"{i}.txt"
            todo.write_text("".join(f"{a}\t{b}\n" for a, b in pairs[i::n]), encoding="utf-8")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-c", _COMPILE_WORKER, str(todo)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        end = time.monotonic() + timeout_s
        try:
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, end - time.monotonic()))
        finally:  # past the bound, or the harness interrupted: no worker outlives the call
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)


def cache_dir() -> Path:
    """$QUALIFY_CACHE_DIR, else the user cache dir: what the harness may recompute (never the engine's)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("qualify", appauthor=False))


# ---------------------------------------------------------------------------------------------- the tool


@dataclass(frozen=True)
class Bwrap:
    path: str
    lib_dir: str | None  # LD_LIBRARY_PATH for bwrap's own exec only (a carried copy with its libraries)
    version: str
    userns: bool  # the harness is not root: the sandbox's identity comes from a user namespace

    def exec_env(self) -> dict[str, str]:
        """bwrap's own environment: nothing of the harness's (the engine's is set with --setenv)."""
        env = {"PATH": "/usr/bin:/bin"}
        if self.lib_dir:
            env["LD_LIBRARY_PATH"] = self.lib_dir
        return env


_PROBED: dict[str, Bwrap | str] = {}


def libcuda_dir() -> str | None:
    """The folder of the driver's libcuda.so.1 as this host's loader cache names it (read outside the
    sandbox, where `ldconfig -p` works), or None."""
    try:
        out = subprocess.run(
            ["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and path:
            return str(Path(path).parent)
    return None


def find_bwrap(env: dict[str, str] | None = None) -> Bwrap:
    """The bwrap to use ($QUALIFY_BWRAP, else `bwrap` on PATH), probed once: SandboxUnavailable (one line)
    when there is none or it cannot build a sandbox here (no user namespaces, say)."""
    env = os.environ if env is None else env
    named = env.get(BWRAP_ENV)
    path = named or shutil.which("bwrap", path=env.get("PATH")) or shutil.which("bwrap")
    if not path:
        raise SandboxUnavailable(
            "no sandbox: bubblewrap (bwrap) is not installed; run scripts/bootstrap (installs Debian's "
            f"bubblewrap as root), set {BWRAP_ENV}=/path/to/bwrap, or pass --no-sandbox (it is recorded)"
        )
    got = _PROBED.get(path)
    if got is None:
        got = _probe(path)
        _PROBED[path] = got
    if isinstance(got, str):
        raise SandboxUnavailable(got)
    return got


def _probe(path: str) -> Bwrap | str:
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        return f"no sandbox: {path} is not an executable file; fix {BWRAP_ENV} or pass --no-sandbox"
    libs = [f for f in p.parent.iterdir() if ".so" in f.name] if path != "/usr/bin/bwrap" else []
    lib_dir = str(p.parent) if libs else None
    tool = Bwrap(str(p), lib_dir, "unknown", os.geteuid() != 0)
    try:
        run = {"capture_output": True, "text": True, "timeout": PROBE_TIMEOUT_S, "env": tool.exec_env()}
        ver = subprocess.run([str(p), "--version"], **run)  # type: ignore[call-overload]
        version = (ver.stdout.strip() or ver.stderr.strip()).splitlines()[0] if ver.returncode == 0 else ""
        args = [str(p), *_namespace_args(tool), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        r = subprocess.run(
            [*args, "--", "/bin/true"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=tool.exec_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no sandbox: {path} could not run ({exc}); pass --no-sandbox to run unsandboxed (recorded)"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
        return (
            f"no sandbox: bwrap cannot create namespaces on this host ({why}); enable unprivileged user "
            "namespaces or run as root, or pass --no-sandbox (the receipt records it)"
        )
    return Bwrap(str(p), lib_dir, version or "bubblewrap", tool.userns)


def own_network(tool: Bwrap) -> bool:
    """Whether the engine gets a network namespace of its own: only where the harness can enter it to
    connect (CAP_SYS_ADMIN in its own user namespace, i.e. root; qualify/netns.py)."""
    from qualify.netns import can_enter

    return not tool.userns and can_enter()


def _namespace_args(tool: Bwrap) -> list[str]:
    args = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if own_network(tool):
        args.append("--unshare-net")
    if tool.userns:
        args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    return args


# ---------------------------------------------------------------------------------------------- the code


@dataclass(frozen=True)
class CodeSet:
    """What the engine's interpreter can import: read-only mounts, what is hashed, PYTHONPATH inside."""

    mounts: tuple[str, ...]  # read-only, each at its own path
    hashed: tuple[str, ...]  # files and folders the code digest covers
    hidden: tuple[str, ...]  # folders inside a mount replaced by an empty read-only tmpfs
    pythonpath: tuple[str, ...]  # the engine module's root (a package outside site-packages)
    module: str
    module_files: tuple[str, ...]  # what of the engine module's own package is mounted

    def scope(self) -> str:
        """What the code digest covers, in words (the receipt's code_scope)."""
        text = (
            f"the harness's tree digest of every file the engine ({self.module}) can import in its sandbox "
            "(bytecode caches aside): " + ", ".join(self.hashed)
        )
        tail = "; /usr outside these is mounted read-only and not hashed"
        return text[: 1000 - len(tail) - 1] + tail


def _dir_of(spec: Any) -> Path | None:
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).resolve()
    return None


def locate_module(module: str) -> tuple[Path, list[Path]]:
    """Where `module` lives, found without running any of its code (nor its packages' __init__): (the
    sys.path entry it is found under, what to mount: the innermost package holding it, whole, plus the
    __init__ files of the packages above). LaunchError when it cannot be found."""
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: asks the finders, imports nothing
    except (ImportError, ValueError) as exc:
        raise LaunchError(f"engine module {module} cannot be found: {exc}") from exc
    first = _dir_of(spec)
    if first is None:
        raise LaunchError(f"engine module {module} cannot be found on this harness's path")
    chain = [first]
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations or []))
        got = _dir_of(spec)
        if spec is None or got is None:
            raise LaunchError(f"engine module {module} cannot be found (no {name})")
        chain.append(got)
    last = chain[-1]
    if len(chain) == 1:
        return first.parent, [first]
    holder = last if last.is_dir() else last.parent
    inits = [p / "__init__.py" for p in chain[:-1] if p != holder and (p / "__init__.py").is_file()]
    return first.parent, [holder, *inits]


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    out: list[Path] = []
    for d in (paths.get("purelib"), paths.get("platlib"), *site.getsitepackages()):
        if d and Path(d).is_dir() and Path(d).resolve() not in out:
            out.append(Path(d).resolve())
    return out


def engine_code(
    module: str, python: str = sys.executable, extra_path: str = "", harness_pythonpath: str | None = None
) -> CodeSet:
    """The code of an engine run as `python -m module` from this harness's installation: what to mount
    read-only (outside /usr, which is mounted whole), and what the code digest covers (every mount, plus
    the interpreter and its Python folders where they lie under /usr)."""
    prefix, base = Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()
    paths = sysconfig.get_paths()
    stdlib = sorted({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if paths.get(k)})
    sites = _site_dirs()
    real = Path(python).resolve()
    mounts: list[Path] = []
    hashed: list[Path] = []

    def add(p: Path, mount: bool = True) -> None:
        if not p.exists():
            return
        p = p.absolute()
        if not any(p.is_relative_to(h) for h in hashed):
            hashed[:] = [h for h in hashed if not h.is_relative_to(p)]
            hashed.append(p)
        if mount and not p.is_relative_to("/usr") and not any(p.is_relative_to(m) for m in mounts):
            mounts[:] = [m for m in mounts if not m.is_relative_to(p)]
            mounts.append(p)

    if prefix != base:
        add(prefix)  # the venv: bin/python, pyvenv.cfg, its site-packages
    add(real)
    if not real.is_relative_to("/usr"):
        add(real.parent)  # the interpreter's bin (the venv's python links through it)
        for lib in sorted((base / "lib").glob("libpython*")):
            add(lib)
    for d in (*stdlib, *sites):
        add(d)
    hidden: list[str] = []
    if prefix != base:  # the base interpreter's own site-packages is not on a venv's path: hide it
        gpaths = sysconfig.get_paths(vars={"base": str(base), "platbase": str(base)})
        for key in ("purelib", "platlib"):
            g = gpaths.get(key)
            gp = Path(g).resolve() if g else None
            if gp is not None and gp.is_dir() and gp not in sites and str(gp) not in hidden:
                hidden.append(str(gp))
    pythonpath: list[str] = []
    # Where this harness found its own packages through PYTHONPATH (a checkout run in place, as on a GPU
    # host without an install), the engine gets that folder on its path too (only the mounts exist there).
    hp = os.environ.get("PYTHONPATH", "") if harness_pythonpath is None else harness_pythonpath
    harness_path = {str(Path(p).resolve()) for p in hp.split(os.pathsep) if p}
    for name in ("qualify", "kernels"):  # the reference engine and what it imports of this project
        d = _dir_of(importlib.util.find_spec(name))
        if d is not None:
            add(d)
            if str(d.parent) in harness_path and str(d.parent) not in pythonpath:
                pythonpath.append(str(d.parent))
    module_files: list[str] = []
    if module.split(".")[0] not in ("qualify", "kernels"):
        root, files = locate_module(module)
        for f in files:
            add(f)
        module_files = [str(f) for f in files]
        if not any(root.resolve().is_relative_to(s) for s in sites) and str(root) not in pythonpath:
            pythonpath.append(str(root))
    for entry in filter(None, extra_path.split(os.pathsep)):
        if not Path(entry).is_dir():
            raise LaunchError(f"{ENGINE_PATH_ENV} names {entry}, which is not a folder")
        add(Path(entry).resolve())
        pythonpath.append(str(Path(entry).resolve()))
    return CodeSet(
        mounts=tuple(str(m) for m in mounts),
        hashed=tuple(str(h) for h in hashed),
        hidden=tuple(hidden),
        pythonpath=tuple(pythonpath),
        module=module,
        module_files=tuple(module_files),
    )


# ---------------------------------------------------------------------------------------------- digests


class DigestCache:
    """sha256 of files keyed by (device, inode, size, mtime, ctime): a file rewritten in any way gets a new
    ctime, which no process can set back. Kept in the harness's cache dir, which the engine never sees."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, list[Any]] = {}
        self.seen: set[str] = set()
        self.dirty = False
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                self.entries = json.loads(path.read_text())

    @staticmethod
    def _key(st: os.stat_result) -> list[int]:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def lookup(self, f: str, st: os.stat_result) -> str | None:
        """The cached digest of `f` if the file is unchanged since, else None."""
        self.seen.add(f)
        got = self.entries.get(f)
        return str(got[5]) if got is not None and got[:5] == self._key(st) else None

    def store(self, f: str, st: os.stat_result, hexdigest: str) -> None:
        self.seen.add(f)
        self.entries[f] = [*self._key(st), hexdigest]
        self.dirty = True

    def digest(self, f: Path, st: os.stat_result) -> str:
        got = self.lookup(str(f), st)
        if got is None:
            got = _sha256_file(str(f))
            self.store(str(f), st, got)
        return got

    def save(self) -> None:
        """Write the cache back, keeping only the files this digest met (gone files drop out)."""
        if self.path is None:
            return
        if len(self.seen) < len(self.entries):
            self.entries = {k: v for k, v in self.entries.items() if k in self.seen}
            self.dirty = True
        if not self.dirty:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.entries, separators=(",", ":")))
            os.replace(tmp, self.path)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)  # releases the GIL: the threads of tree_digest hash files side by side
    return h.hexdigest()


def _sha256_or_none(path: str) -> str | None:
    try:
        return _sha256_file(path)
    except OSError:
        return None


HASH_THREADS = 8


def tree_digest(
    roots: list[str] | tuple[str, ...],
    cache: DigestCache | None = None,
    exclude: tuple[str, ...] = (),
    compile_into: Path | None = None,
) -> tuple[str, int]:
    """sha256 over every regular file and symlink under `roots` (files or folders; __pycache__ skipped),
    sorted by path: (path NUL `f` sha256-of-bytes NUL) or (path NUL `l` link-target NUL). (digest, files).
    One lstat per entry (os.scandir): a virtual environment's tens of thousands of files take well under a
    second once the cache knows their bytes; files it does not know are hashed by a few threads at once.
    With `compile_into`, every .py file hashed also gets its bytecode there, compiled again where the
    source changed since (`_stale`; in parallel, `compile_sources`)."""
    cache = cache or DigestCache(None)
    entries: list[tuple[str, str]] = []
    files: list[tuple[str, os.stat_result]] = []

    def walk(folder: str) -> None:
        try:
            it = os.scandir(folder)
        except OSError:
            return
        with it:
            for e in it:
                path = os.path.join(folder, e.name)
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    with contextlib.suppress(OSError):
                        entries.append((path, "l" + os.readlink(path)))
                elif stat.S_ISDIR(st.st_mode):
                    if e.name not in SKIP_DIRS and path not in exclude:
                        walk(path)
                elif stat.S_ISREG(st.st_mode):
                    files.append((path, st))

    for root in roots:
        r = str(Path(root))
        if os.path.isfile(r):
            with contextlib.suppress(OSError):
                files.append((r, os.stat(r)))
        else:
            walk(r)
    known = {path: cache.lookup(path, st) for path, st in files}
    misses = [(path, st) for path, st in files if known[path] is None]
    if misses:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(misses) // 16 + 1))) as pool:
            hashed = pool.map(_sha256_or_none, [m[0] for m in misses])
            for (path, st), got in zip(misses, hashed, strict=True):
                if got is not None:  # a file that vanished or cannot be read is left out, as before
                    cache.store(path, st, got)
                    known[path] = got
    entries += [(path, "f" + str(known[path])) for path, _ in files if known[path] is not None]
    if compile_into is not None:
        stale = []
        for path, st in files:
            if path.endswith(".py") and known[path] is not None:
                target = _pyc_path(path, compile_into)
                if _stale(st, target):
                    stale.append((path, target))
        compile_sources(stale)
    entries.sort()
    h = hashlib.sha256()
    for path, what in entries:
        h.update(path.encode() + b"\0" + what.encode() + b"\0")
    cache.save()
    return "sha256:" + h.hexdigest(), len(entries)


def code_digest(code: CodeSet) -> tuple[str, int]:
    """(digest, files) of what `code` covers, its hidden folders left out. The cache of file digests is
    kept per set of roots, so one run loads only the entries its own code can use."""
    key = hashlib.sha256("\0".join(code.hashed).encode()).hexdigest()[:16]
    cache = DigestCache(cache_dir() / f"code-digests-{key}.json")
    return tree_digest(code.hashed, cache, code.hidden, compile_into=pycache_dir())


# ---------------------------------------------------------------------------------------------- sandbox


def parse_engine_env(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`K=V` items of --engine-env -> {K: V}; ValueError (one line) for anything else."""
    out: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not k.replace("_", "a").isalnum() or k[0].isdigit():
            raise ValueError(f"--engine-env {item!r} is not NAME=VALUE")
        if k in (HARNESS_FD_ENV, "PYTHONPATH", "LD_PRELOAD", "PYTHONSTARTUP", "PYTHONHOME"):
            raise ValueError(f"--engine-env {k}: the harness sets or forbids this variable in the sandbox")
        out[k] = v
    return out


@dataclass
class Sandbox:
    """One engine build's sandbox; `command` wraps each engine process of it (boot, refusal probe,
    reference engine, seeding step) with its own scratch dir."""

    bwrap: Bwrap
    code: CodeSet
    gpu: bool
    operator_env: dict[str, str] = field(default_factory=dict)
    meta_dir: Path | None = None

    @classmethod
    def for_engine(
        cls,
        module: str,
        *,
        gpu: bool,
        operator_env: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        env = os.environ if env is None else env
        code = engine_code(
            module, extra_path=env.get(ENGINE_PATH_ENV, ""), harness_pythonpath=env.get("PYTHONPATH", "")
        )
        return cls(find_bwrap(env), code, gpu, dict(operator_env or {}))

    @property
    def root(self) -> bool:
        return not self.bwrap.userns

    @property
    def own_net(self) -> bool:
        """The engine's processes share one network namespace of their own (loopback only)."""
        return own_network(self.bwrap)

    def engine_env(self, harness_env: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
        """The engine's whole environment: nothing of the harness's but FORWARDED_ENV."""
        venv_bin = str(Path(sys.prefix) / "bin")
        env = {
            "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": f"{SCRATCH}/home",
            "TMPDIR": "/tmp",
            "QUALIFY_HOME": f"{SCRATCH}/home/qualify",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
            "PYTHONPYCACHEPREFIX": PYCACHE_DIR,
        }
        if self.code.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.code.pythonpath)
        for k in FORWARDED_ENV:
            if k in harness_env:
                env[k] = harness_env[k]
        if self.gpu:  # Triton's cache: the copy the harness gives each process (launch/kernels.py)
            env["TRITON_CACHE_DIR"] = f"{SCRATCH}/home/{CACHE_SUBDIR}"
        if self.gpu and "TRITON_LIBCUDA_PATH" not in env:
            found = libcuda_dir()
            if found is not None:  # Triton finds libcuda through `ldconfig -p`, which fails in the sandbox
                env["TRITON_LIBCUDA_PATH"] = found
        env.update(self.operator_env)
        env.update(extra or {})
        return env

    def prepare_scratch(self, scratch: Path) -> None:
        """The engine's only writable folder, owned by the sandbox's uid when the harness can give it."""
        for sub in ("", "home", "home/qualify", "tmp"):
            d = scratch / sub
            d.mkdir(parents=True, exist_ok=True)
            if self.root:
                os.chown(d, SANDBOX_UID, SANDBOX_GID)
            os.chmod(d, 0o700)

    def _meta(self) -> Path:
        """passwd and group files naming the sandbox's identity (so getpwuid works), harness-owned."""
        if self.meta_dir is None:
            d = Path(cache_dir()) / "sandbox-etc"
            d.mkdir(parents=True, exist_ok=True)
            home = f"{SCRATCH}/home"
            (d / "passwd").write_text(f"qualify-engine:x:{SANDBOX_UID}:{SANDBOX_GID}::{home}:/bin/false\n")
            (d / "group").write_text(f"qualify-engine:x:{SANDBOX_GID}:\n")
            for f in ("passwd", "group"):
                os.chmod(d / f, 0o644)
            self.meta_dir = d
        return self.meta_dir

    def command(
        self,
        argv: list[str],
        scratch: Path,
        env: dict[str, str],
        *,
        weights: Path | None = None,
        weights_folder: Path | None = None,
        info_fd: int | None = None,
    ) -> list[str]:
        """`argv` (python -m MODULE ...) inside the sandbox; `weights` appears read-only at weights_path(), or
        (before the file exists) `weights_folder`, where the harness links it in later, read-only at
        WEIGHTS_DIR."""
        b = self.bwrap
        cmd = [b.path, "--die-with-parent", "--new-session", *_namespace_args(b), "--hostname", HOSTNAME]
        if b.userns:
            cmd.append("--disable-userns")
        cmd += ["--ro-bind", "/usr", "/usr"]
        for name in ROOT_LINKS:
            p = Path("/") / name
            if p.is_symlink():
                cmd += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                cmd += ["--ro-bind", str(p), str(p)]
        cmd += ["--proc", "/proc"]
        if self.gpu:
            cmd += ["--dev-bind", "/dev", "/dev"]  # the NVIDIA device nodes; CUDA IPC needs them
        else:
            cmd += ["--dev", "/dev", "--bind", "/dev/shm", "/dev/shm"]  # CPU KV allocations the peer maps
        # bwrap makes /etc 0700 for the binds below, which the sandbox's uid could not read through (no
        # getpwuid, no name service: b12x's start-up check failed on "uid not found").
        cmd += ["--ro-bind", "/sys", "/sys", "--perms", "0755", "--dir", "/etc"]
        for name in ETC_FILES:
            cmd += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        meta = self._meta()
        for name in ("passwd", "group"):
            cmd += ["--ro-bind", str(meta / name), f"/etc/{name}"]
        if self.gpu:
            for p in GPU_EXTRA:
                if p.startswith("/usr/"):
                    continue  # visible through the /usr bind (and maybe a symlink: binding onto it fails)
                cmd += ["--ro-bind-try", p, p]
        # bwrap makes a mount point's missing parents 0700, which the sandbox's uid could not traverse.
        made: set[str] = set()

        def parents(*dests: str) -> None:
            for dest in dests:
                for parent in reversed(Path(dest).parents):
                    p = str(parent)
                    if p in ("/", "/usr", "/tmp") or p in made or p.startswith("/usr/"):
                        continue
                    made.add(p)
                    cmd.extend(["--perms", "0755", "--dir", p])

        parents(SCRATCH)
        # Scratch and the private /tmp first, then the code mounts' parents and the mounts: a code folder
        # below /tmp (a checkout cloned there, the GPU host's unpacked wheels in /tmp/site) lands on top of
        # the private /tmp, with traversable parents, instead of being hidden by it.
        cmd += ["--bind", str(scratch), SCRATCH, "--bind", str(scratch / "tmp"), "/tmp"]
        handed = [self.weights_path(weights)] if weights is not None else []
        parents(*self.code.mounts, *handed, *([WEIGHTS_DIR] if weights_folder is not None else []))
        for m in self.code.mounts:
            cmd += ["--ro-bind", m, m]
        for h in self.code.hidden:
            cmd += ["--tmpfs", h, "--remount-ro", h]
        if weights is not None:
            cmd += ["--ro-bind", str(weights), self.weights_path(weights)]
        elif weights_folder is not None:
            cmd += ["--ro-bind", str(weights_folder), WEIGHTS_DIR]
        pyc = pycache_dir()
        pyc.mkdir(parents=True, exist_ok=True)
        cmd += ["--ro-bind", str(pyc), PYCACHE_DIR]
        cmd += ["--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
        for k, v in sorted(env.items()):
            cmd += ["--setenv", k, v]
        if info_fd is not None:
            cmd += ["--info-fd", str(info_fd)]
        cmd.append("--")
        if self.root:
            setpriv = shutil.which("setpriv", path="/usr/bin:/bin") or "/usr/bin/setpriv"
            cmd += [setpriv, "--reuid", str(SANDBOX_UID), "--regid", str(SANDBOX_GID), "--clear-groups"]
            cmd += ["--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs", "--"]
        return cmd + list(argv)

    def absent(self) -> list[str]:
        """What the engine cannot reach, in words (not mounted in its sandbox)."""
        from qualify import settings

        checkout = Path(__file__).resolve().parents[2]
        return [
            f"the operator's data dir {settings.data_dir()} (keys, store, run dirs)",
            f"the harness's cache {cache_dir()}, but for the handed weights file (read-only; before it is "
            "kept, a folder of its own, empty until the file is linked in)",
            f"the project checkout {checkout}, but for the code mounts",
            "every other host path outside /usr, /sys, /dev and the code mounts",
        ]

    @staticmethod
    def weights_path(weights: Path) -> str:
        return f"{WEIGHTS_DIR}/{weights.name}"

    def describe(self, env: dict[str, str]) -> dict[str, Any]:
        """The receipt's account of the sandbox (EngineInfo.sandbox)."""
        ident = (
            f"host uid {SANDBOX_UID} (setpriv inside bwrap; the harness runs as root)"
            if self.root
            else f"uid {SANDBOX_UID} in a user namespace over the operator's uid {os.getuid()}"
        )
        return {
            "enabled": True,
            "tool": f"{self.bwrap.version} ({self.bwrap.path})",
            "identity": ident,
            "namespaces": ["mount", "pid", "ipc", "uts", "cgroup"]
            + (["net"] if self.own_net else [])
            + (["user"] if self.bwrap.userns else []),
            "network": (
                "its own namespace: loopback only (the harness connects to its 127.0.0.1 port from inside "
                "that namespace)"
                if self.own_net
                else "the host's (a harness without root cannot enter a network namespace to connect; "
                "the engine serves on 127.0.0.1 and can reach other addresses)"
            ),
            "writable": [SCRATCH, "/tmp (the scratch dir)", "/dev/shm (the host's: KV allocations)"],
            "devices": "the host's /dev (GPU)" if self.gpu else "a minimal /dev",
            "code_mounts": list(self.code.mounts),
            "bytecode": (
                f"compiled by the harness from the hashed sources, read-only at {PYCACHE_DIR} "
                "(PYTHONPYCACHEPREFIX); no __pycache__ beside a source is read"
            ),
            "absent": self.absent(),
            "engine_module": self.code.module,
            "env": dict(sorted(env.items())),
            "operator_env": dict(sorted(self.operator_env.items())),
        }


def unsandboxed(why: str) -> dict[str, Any]:
    return {"enabled": False, "why": why}


# ---------------------------------------------------------------------------------------------- pids


def read_info(fd: int, timeout_s: float = INFO_TIMEOUT_S) -> dict[str, Any] | None:
    """bwrap's --info-fd JSON (`child-pid`: the sandbox's pid 1 as the host sees it); None if none came."""
    data = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not r:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            return json.loads(data)
    with contextlib.suppress(ValueError):
        return json.loads(data) if data else None
    return None


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def engine_pid(init_pid: int, timeout_s: float = 5.0) -> int | None:
    """The engine's host pid: the one child of the sandbox's init (bwrap's pid 1)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        kids = children(init_pid)
        if kids:
            return kids[0]
        if not os.path.exists(f"/proc/{init_pid}"):
            return None
        time.sleep(0.01)
    return None


def ns_pids(pid: int) -> list[int] | None:
    """/proc/PID/status NSpid: the pid in each pid namespace, the host's first."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def namespace_pids(root: int) -> dict[int, int]:
    """{pid inside the sandbox's pid namespace: host pid} for `root` (the engine's host pid) and every
    process below it, from /proc/PID/status NSpid (the innermost namespace's pid last)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
    out: dict[int, int] = {}
    for pid in parent:
        up, hops = pid, 0
        while up != root and up in parent and hops < 64:
            up, hops = parent[up], hops + 1
        if up == root:
            ns = ns_pids(pid)
            if ns:
                out[ns[-1]] = pid
    return out
