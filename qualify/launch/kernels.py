"""The harness's kernel cache: compiled Triton kernels that the reference engine's warm step leaves, kept by
the harness and copied, never shared, into the scratch dir of every engine process it starts later.

Every engine process starts with an empty Triton cache of its own, and compiling the decode step's kernels
is most of what a GPU engine's first requests cost (16.7 s of the H200 boot in bench/results). Sharing one
cache directory between the engine under test and the reference engines the harness compares it with would
give a lying engine a channel to them (and a place to plant binaries that the receipt does not name). So:

- the cache is filled only by the harness's own reference engine (`python -m qualify.engine warm`, in the
  same sandbox as every engine process, with no secret of the run: the handed weights and the launch
  document are what the engine under test gets anyway), never by the engine under test;
- the harness copies what the step left (regular files and folders only, bounded in count and bytes) into
  its cache under a key of the reference engine's code, the configuration and the device, with a manifest
  and a digest over every file;
- each engine process gets a fresh copy in its own scratch dir (`$HOME/.triton/cache`), checked against the
  manifest's digest as it is copied: what one process writes there reaches no other;
- the receipt names the copy each process got (its digest, where it came from, or why there was none);
- an engine that starts while the step still runs gets the entries the step has finished so far (its
  b12x conformance check's kernels, compiled first, among them), read without following a link, and the
  rest before its first request (`give_live`); once the step is kept, the receipt says whether what it got
  early is what was kept.

A kernel in the cache is used only when Triton's own key matches (the kernel's source and its
dependencies, the Triton version, the target and the compile options), so an engine whose kernels differ
from the reference engine's compiles its own, as it did before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CACHE_SUBDIR = ".triton/cache"  # under the engine's HOME ($SCRATCH/home): where Triton looks by default
MANIFEST = "qualify-kernel-cache.json"
MAX_FILES = 20_000
MAX_BYTES = 4 << 30
WARM_STEP_TIMEOUT_S = 600.0
KEEP_ENTRIES = 8  # kept caches per folder (one per reference engine build and configuration), newest first
ORIGIN = "compiled by the reference engine's warm step (python -m qualify.engine warm), cached by the harness"


# The warm step builds an engine beside the engine under test: it runs only where the smallest GPU holds
# this many times the weights (both engines' weights, their caches and workspaces). The step itself
# applies the rule (`warm --room-factor`: it knows the weights' size before they are seeded) and exits
# EXIT_NO_ROOM, saying why, where the GPU is smaller.
WARM_MEMORY_FACTOR = 4
EXIT_NO_ROOM = 3


def precompile_jobs() -> int:
    """The warm step's compile workers: the CPUs the harness may run on, less two (the engine under test
    boots and the harness keeps the seeded weights beside it), at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus - 2)


class KernelCacheError(RuntimeError):
    """A tree that cannot be kept or given (too large, unreadable, not what its manifest says)."""


def _walk(root: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of every regular file below `root`, sorted; links and anything that is
    neither a file nor a folder are left out (never followed)."""
    out: list[tuple[str, Path]] = []
    total = 0
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                if e.is_symlink():
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
                    out.append((str(Path(e.path).relative_to(root)), Path(e.path)))
                    if len(out) > MAX_FILES or total > MAX_BYTES:
                        raise KernelCacheError(
                            f"the kernel cache at {root} holds more than {MAX_FILES} files or "
                            f"{MAX_BYTES >> 20} MiB"
                        )
    return sorted(out)


def _hash_file(h: Any, rel: str, data: bytes) -> None:
    """One file's part of a cache's digest: sha256 over (relative path NUL sha256 of the file NUL) in path
    order, the same for a kept cache, each copy of it and a step's entries given early."""
    h.update(rel.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\0")


def _copy(
    files: Sequence[tuple[str, Path | bytes]], dest: Path, owner: tuple[int, int] | None
) -> tuple[str, int]:
    """Copy `files` (each a path to read, or bytes already read) into `dest` (created), hashing what was
    read: (digest, bytes), the digest as _hash_file makes it."""
    h = hashlib.sha256()
    nbytes = 0
    dest.mkdir(parents=True, exist_ok=True)
    dirs = {dest}
    for rel, src in files:
        if rel == MANIFEST:
            continue
        target = dest / rel
        for parent in reversed(target.relative_to(dest).parents):
            d = dest / parent
            if d not in dirs:
                d.mkdir(exist_ok=True)
                dirs.add(d)
        data = src if isinstance(src, bytes) else src.read_bytes()
        nbytes += len(data)
        with open(target, "xb") as f:  # never through a link or over a file already there
            f.write(data)
        _hash_file(h, rel, data)
    if owner is not None:
        for d in dirs:
            os.chown(d, *owner)
        for rel, _ in files:
            if rel != MANIFEST:
                os.chown(dest / rel, *owner)
    return "sha256:" + h.hexdigest(), nbytes


def keep(step_cache: Path, cached: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """Copy the warm step's cache folder into the harness's cache at `cached` (atomically: a folder beside
    it, renamed), with a manifest of its digest, size and `facts`; the manifest."""
    files = _walk(step_cache) if step_cache.is_dir() else []
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        digest, nbytes = _copy(files, tmp, None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = {"digest": digest, "files": len(files), "bytes": nbytes, "origin": ORIGIN, **facts}
    (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
    os.chmod(tmp, 0o700)
    try:
        os.rename(tmp, cached)
    except OSError:  # another harness kept the same key first: theirs stands
        shutil.rmtree(tmp, ignore_errors=True)
        return read_manifest(cached)
    return manifest


def prune(folder: Path, keep_entries: int = KEEP_ENTRIES) -> list[str]:
    """Remove all but the `keep_entries` newest kept caches in `folder` (by their manifest's mtime): the
    harness's cache stays bounded however many builds a host qualifies. The names removed."""
    entries = []
    for d in folder.iterdir() if folder.is_dir() else []:
        m = d / MANIFEST
        if d.is_dir() and not d.is_symlink() and m.is_file():
            entries.append((m.stat().st_mtime, d))
    entries.sort(reverse=True)
    removed = []
    for _, d in entries[keep_entries:]:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


def read_manifest(cached: Path) -> dict[str, Any]:
    try:
        m = json.loads((cached / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise KernelCacheError(f"the kernel cache {cached} has no readable manifest: {exc}") from exc
    if not isinstance(m, dict) or not isinstance(m.get("digest"), str):
        raise KernelCacheError(f"the kernel cache {cached} has a manifest without a digest")
    return m


def _new_cache_dir(home: Path, owner: tuple[int, int] | None) -> Path:
    """`home`/CACHE_SUBDIR for a copy, which must not exist yet (its parent made, owned by `owner`)."""
    dest = home / CACHE_SUBDIR
    if dest.exists() or dest.is_symlink():
        raise KernelCacheError(f"{dest} exists already: a kernel cache is only given to a new scratch dir")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(dest.parent, *owner)
    return dest


def give(cached: Path, home: Path, owner: tuple[int, int] | None) -> dict[str, Any]:
    """A fresh copy of the kept cache into `home`/CACHE_SUBDIR (which must not exist yet), checked against
    the manifest's digest; what the receipt says about it."""
    manifest = read_manifest(cached)
    dest = _new_cache_dir(home, owner)
    digest, nbytes = _copy(_walk(cached), dest, owner)
    if digest != manifest["digest"]:
        shutil.rmtree(dest, ignore_errors=True)
        raise KernelCacheError(
            f"the kernel cache {cached} does not match its manifest ({digest} != {manifest['digest']})"
        )
    return {"digest": digest, "files": manifest.get("files"), "bytes": nbytes}


def _read_at(name: str, dir_fd: int) -> bytes | None:
    """A regular file's bytes under the directory `dir_fd`, never through a link; None if it is not one."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with open(fd, "rb", closefd=False) as f:
            return f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def finished_entries(step_cache: Path) -> list[tuple[str, bytes]]:
    """The files of the entries a warm step still running has finished in its Triton cache, read through
    directory descriptors that never follow a link: a kernel's folder once Triton wrote its group file
    (`__grp__*.json`, written after every file it names, each renamed into place) and every file the group
    names is there; a folder of one shared library (a launcher module or the driver's helper, written by
    one rename). Triton's temporary folders are not entries. Bounded as a kept cache is."""
    out: list[tuple[str, bytes]] = []
    total = 0
    try:
        root = os.open(step_cache, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        for key in sorted(os.listdir(root)):
            if key.startswith((".", "tmp.")):
                continue
            try:
                entry = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
            except OSError:
                continue  # not a folder (or a link)
            try:
                files = {n: _read_at(n, entry) for n in sorted(os.listdir(entry))}
            finally:
                os.close(entry)
            if any(data is None for data in files.values()):
                continue
            groups = [n for n in files if n.startswith("__grp__")]
            if groups:
                try:
                    named = json.loads(files[groups[0]] or b"")["child_paths"].values()
                    if not all(Path(str(p)).name in files for p in named):
                        continue
                except (ValueError, KeyError, AttributeError, TypeError):
                    continue
            elif not (len(files) == 1 and next(iter(files)).endswith(".so")):
                continue  # a kernel whose group is not written yet
            for n, data in files.items():
                assert data is not None
                total += len(data)
                out.append((f"{key}/{n}", data))
            if len(out) > MAX_FILES or total > MAX_BYTES:
                raise KernelCacheError(
                    f"the warm step's cache at {step_cache} holds more than {MAX_FILES} files or "
                    f"{MAX_BYTES >> 20} MiB"
                )
    finally:
        os.close(root)
    return out


def give_partial(step_cache: Path, home: Path, owner: tuple[int, int] | None) -> dict[str, Any]:
    """The entries a warm step still running has finished (finished_entries), copied into `home`'s Triton
    cache (which must not exist yet) before an engine's first process; what the receipt says about them.
    `rels` (the files' relative paths) stays with the caller to check against the kept cache later."""
    files = finished_entries(step_cache)
    dest = _new_cache_dir(home, owner)
    digest, nbytes = _copy(files, dest, owner)
    entries = len({rel.split("/", 1)[0] for rel, _ in files})
    return {"entries": entries, "files": len(files), "bytes": nbytes, "digest": digest,
            "rels": [rel for rel, _ in files]}  # fmt: skip


def matches_kept(cached: Path, rels: list[str], digest: str) -> bool:
    """Whether the kept cache's files at `rels` are the bytes given early (the digest give_partial took)."""
    h = hashlib.sha256()
    for rel in rels:
        try:
            data = (cached / rel).read_bytes()
        except OSError:
            return False
        _hash_file(h, rel, data)
    return "sha256:" + h.hexdigest() == digest


def _subdir(parent_fd: int, name: str, owner: tuple[int, int] | None) -> int:
    """`name` under the directory `parent_fd` as a directory fd, made if missing; never through a link."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        made = True
    except FileExistsError:
        made = False
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    if made and owner is not None:
        os.fchown(fd, *owner)
    return fd


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def give_live(cached: Path, home: Path, owner: tuple[int, int] | None) -> dict[str, Any]:
    """The kept cache copied into the Triton cache of an engine that is already running (`home` is its
    writable HOME): entry by entry, each built under a name of the harness's and renamed into place, so
    the engine sees an entry whole or not at all, and one it compiled itself meanwhile stays its own.
    The engine can write there: every step goes through directory descriptors and never follows a link
    (O_NOFOLLOW, files created with O_EXCL), so nothing it planted moves a write out of its scratch dir.
    Checked against the manifest's digest as it is read; what the receipt says about it."""
    manifest = read_manifest(cached)
    files = [(rel, src) for rel, src in _walk(cached) if rel != MANIFEST]
    h = hashlib.sha256()
    nbytes = 0
    entries: dict[str, list[tuple[str, bytes]]] = {}
    for rel, src in files:
        data = src.read_bytes()
        nbytes += len(data)
        _hash_file(h, rel, data)
        top, _, rest = rel.partition("/")
        entries.setdefault(top, []).append((rest, data))
    digest = "sha256:" + h.hexdigest()
    if digest != manifest["digest"]:
        raise KernelCacheError(
            f"the kernel cache {cached} does not match its manifest ({digest} != {manifest['digest']})"
        )
    given = kept_own = 0
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    fds = [root]
    try:
        for part in Path(CACHE_SUBDIR).parts:
            fds.append(_subdir(fds[-1], part, owner))
        cache = fds[-1]
        for key, members in sorted(entries.items()):
            if any("/" in rest or not rest for rest, _ in members):
                continue  # Triton's entries are one level deep: anything else is not given late
            if _exists(key, cache):  # the engine compiled this one itself: its own stays
                kept_own += 1
                continue
            tmp = f".qualify-given.{key}"
            try:
                os.mkdir(tmp, 0o755, dir_fd=cache)
            except FileExistsError:
                kept_own += 1
                continue
            entry = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cache)
            try:
                for rest, data in members:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                    fd = os.open(rest, flags, 0o644, dir_fd=entry)
                    try:
                        with open(fd, "wb", closefd=False) as f:
                            f.write(data)
                        if owner is not None:
                            os.fchown(fd, *owner)
                    finally:
                        os.close(fd)
                if owner is not None:
                    os.fchown(entry, *owner)
                try:
                    os.rename(tmp, key, src_dir_fd=cache, dst_dir_fd=cache)
                    given += 1
                except OSError:  # the engine compiled this one itself meanwhile: its own stays
                    kept_own += 1
                    for rest, _ in members:  # what was built goes (through the descriptor: never a link)
                        with contextlib.suppress(OSError):
                            os.unlink(rest, dir_fd=entry)
                    with contextlib.suppress(OSError):
                        os.rmdir(tmp, dir_fd=cache)
            finally:
                os.close(entry)
    finally:
        for fd in reversed(fds):
            os.close(fd)
    return {"digest": digest, "files": manifest.get("files"), "bytes": nbytes, "entries": given,
            "entries_it_had": kept_own}  # fmt: skip


def compiled_itself(home: Path, given: set[str], limit: int = 30) -> dict[str, Any]:
    """What an engine compiled into its own Triton cache beyond the entries it was given (read at its stop:
    names only, never following a link, bounded): the kernels the warm step did not compile for it."""
    root = home / CACHE_SUBDIR
    names: set[str] = set()
    count = 0
    try:
        with os.scandir(root) as it:
            for e in it:
                if count >= MAX_FILES:
                    break
                if e.name in given or e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                    continue
                count += 1
                with contextlib.suppress(OSError), os.scandir(e.path) as members:
                    for m in members:
                        if len(names) < limit and not m.name.startswith("__grp__"):
                            names.add(m.name.split(".", 1)[0])
    except OSError:
        return {"entries": 0}
    return {"entries": count, "kernels": sorted(names)}


class KernelCache:
    """One run's kernel cache: found in the harness's cache, or filled by a warm step in the background
    (`start`); `give` copies it into an engine's scratch, `wait` bounds how long a launcher waits for it."""

    def __init__(self, cached: Path | None, reason: str | None = None) -> None:
        self.cached = cached
        self.reason = reason  # why there is no cache (None while there may be one)
        self.manifest: dict[str, Any] | None = None
        self.filled_this_run = False
        self.warm_step_s: float | None = None
        self.given: dict[str, Any] = {}
        self.settled_s: float | None = None  # how long the harness waited for the warm step (settle)
        self.live: Path | None = None  # the running warm step's Triton cache (what it finished so far)
        self._early: dict[str, tuple[list[str], str]] = {}  # per engine: the files given early, their digest
        self._done = threading.Event()
        self._lock = threading.Lock()
        if cached is None:
            self._done.set()
        elif (cached / MANIFEST).is_file():
            self._found()

    def _found(self) -> None:
        assert self.cached is not None
        try:
            self.manifest = read_manifest(self.cached)
        except KernelCacheError as exc:
            self.reason = str(exc)
        self._done.set()

    @property
    def ready(self) -> bool:
        return self.manifest is not None

    def start(
        self,
        step: Callable[[], tuple[Path | None, str | None, dict[str, Any]]],
        cleanup: Callable[[], None] = lambda: None,
    ) -> None:
        """Run the warm step `step` (-> the folder it left, why not, facts) on a thread unless the cache was
        found, then `cleanup`; a step that fails leaves the run without a cache (the reason is recorded)."""
        if self._done.is_set():
            return

        def work() -> None:
            t0 = time.monotonic()
            try:
                folder, why, facts = step()
                self.warm_step_s = round(time.monotonic() - t0, 3)
                if folder is None:
                    self.reason = f"the warm step left no kernel cache: {why}"
                else:
                    assert self.cached is not None
                    self.cached.parent.mkdir(parents=True, exist_ok=True)
                    self.manifest = keep(folder, self.cached, {**facts, "warm_step_s": self.warm_step_s})
                    self.filled_this_run = True
                    prune(self.cached.parent)
            except Exception as exc:  # the run goes on without a cache; the receipt says why
                self.reason = f"the warm step's kernel cache could not be kept: {exc}"
            finally:
                with contextlib.suppress(Exception):
                    cleanup()
                self._done.set()

        threading.Thread(target=work, name="kernel-cache-warm-step", daemon=True).start()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def give(self, name: str, home: Path, owner: tuple[int, int] | None) -> dict[str, Any]:
        """Copy the cache (when ready) into an engine process's `home`; the record kept under `name`."""
        if not self.ready:
            why = self.reason or "the warm step was still running when this engine started"
            record: dict[str, Any] = {"given": False, "reason": why}
            if self.live is not None and not self._done.is_set():
                try:
                    early = give_partial(self.live, home, owner)
                    rels = early.pop("rels")
                    if early["files"]:
                        record["early"] = early
                        with self._lock:
                            self._early[name] = (rels, early["digest"])
                except (OSError, KernelCacheError) as exc:
                    record["early"] = {"error": str(exc)[:300]}
        else:
            assert self.cached is not None
            try:
                record = {"given": True, **give(self.cached, home, owner)}
            except (OSError, KernelCacheError) as exc:
                record = {"given": False, "reason": str(exc)}
        with self._lock:
            self.given.setdefault(name, record)
        return record

    def has_given(self, name: str) -> bool:
        with self._lock:
            return bool(self.given.get(name, {}).get("given"))

    def give_late(
        self, name: str, home: Path, owner: tuple[int, int] | None, waited_s: float
    ) -> dict[str, Any]:
        """Copy the cache (when ready) into the running engine `name` that got none at its start
        (give_live): the record says it came late, after how long a wait, and why none came at start."""
        with self._lock:
            before = dict(self.given.get(name, {}))
        if before.get("given"):
            return before
        if not self.ready:
            why = self.reason or "the warm step was still running"
            record: dict[str, Any] = {**before, "late": {"given": False, "waited_s": waited_s, "reason": why}}
        else:
            assert self.cached is not None
            try:
                late = {"given": True, "waited_s": waited_s, **give_live(self.cached, home, owner)}
            except (OSError, KernelCacheError) as exc:
                late = {"given": False, "waited_s": waited_s, "reason": str(exc)}
            record = {"given": late["given"], "at_start": before.get("reason"), "late": late}
            if "early" in before:
                record["early"] = before["early"]
                with self._lock:
                    early = self._early.get(name)
                if early is not None:  # what came early, held against what the step left in the end
                    record["early"]["matches_kept"] = matches_kept(self.cached, *early)
            if late["given"]:
                record.update({k: late[k] for k in ("digest", "files", "bytes")})
        with self._lock:
            self.given[name] = record
        return record

    def account(self, name: str, home: Path) -> None:
        """Record what the engine `name` compiled itself (its scratch's Triton cache, read at its stop)."""
        given: set[str] = set()
        if self.ready and self.cached is not None:
            with contextlib.suppress(OSError):
                given = {p.name for p in self.cached.iterdir() if p.name != MANIFEST}
        own = compiled_itself(home, given)
        with self._lock:
            if name in self.given:
                self.given[name]["compiled_itself"] = own

    def evidence(self) -> dict[str, Any]:
        m = self.manifest or {}
        with self._lock:
            given = {k: dict(v) for k, v in self.given.items()}
        return {
            "origin": ORIGIN if self.ready else None,
            "reason": None if self.ready else self.reason,
            "digest": m.get("digest"),
            "files": m.get("files"),
            "bytes": m.get("bytes"),
            "filled_this_run": self.filled_this_run,
            "warm_step_s": self.warm_step_s,
            # how the step compiled (precompile.py: the workers, the specializations, the seconds), as the
            # step that filled this cache reported it (an earlier run's when this run found it kept)
            "precompile": m.get("precompile"),
            # the step's own seconds per kind of work (its recording pass: where the step's time goes)
            "warm_seconds_each": (m.get("warm") or {}).get("seconds_each"),
            "waited_before_timed_checks_s": self.settled_s,
            "path": f"$HOME/{CACHE_SUBDIR}",
            "given": given,
        }
