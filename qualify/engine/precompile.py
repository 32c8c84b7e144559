"""The warm step's parallel compile (`python -m qualify.engine warm --jobs N`).

The serial warm step ran the checks' kinds of work once and let Triton compile each kernel specialization
as a launch first asked for it: one after another in one process (on the H200, 2026-12-04: 475 files,
about 80 compiles and their launchers, 50.7 s). Here the same work runs once in recording mode instead:
Triton's `jit_cache_hook` sees every specialization a launch would compile (the kernel, its argument
types, the constexprs, the divisibility attributes, the compile options) before anything is compiled, and
returning True from it skips the compile and the launch. Each new specialization goes at once to a pool
of worker processes, which compile it for the same target with the same options into the same Triton
cache directory (the JIT's own key: source, specialization, options, target, Triton version), and build
its launcher (Triton builds one per signature with the C compiler at a kernel's first launch). A later
process that runs the same work finds every kernel and launcher there and compiles nothing.

Recording runs the engine's host code with no Triton kernel launched: what those kernels would have
written is whatever the memory held, so values are garbage (token ids stay in range: they come from
argmax and top-k). What a launch asks for depends on shapes, dtypes, strides, alignment and constants,
which the host code decides, so the specializations are the ones the real run compiles; a specialization
that only some data would reach is compiled, as before, by the engine that reaches it (the harness counts
those per engine: launch/kernels.py).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

# The reference engine's kernel modules, imported by each worker as it starts (beside the recording pass),
# so a specialization's compile does not wait for the import.
KERNEL_MODULES = (
    "kernels.fused", "kernels.kda.decode", "kernels.kda.chunk", "kernels.kda.chunk_intra", "kernels.census",
)  # fmt: skip
TIMELINE_LAST = 8  # compiles named in finish()'s finished_last
COMPILE_WAIT_S = 300.0  # every compile is done within this (the warm step's own bound is the harness's)


def default_jobs() -> int:
    """Worker processes: the CPUs this process may run on, less two (the engine under test boots and the
    harness hashes the weights beside the warm step), at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus - 2)


def _jit_function(module: str, qualname: str):  # type: ignore[no-untyped-def]
    """The JITFunction `module`.`qualname` (a kernel wrapped by heuristics or an autotuner: its `.fn`)."""
    from triton.runtime.jit import JITFunction

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}.{qualname} is not a Triton kernel")
    return obj


def compile_spec(module: str, qualname: str, data: str, target: Any, launcher: bool = True) -> dict[str, Any]:
    """Compile one recorded specialization (`data`: Triton's specialization_data JSON) for `target` into
    this process's Triton cache, as JITFunction.preload does but for a given target (no device needed),
    then build its launcher where `launcher` and the target is CUDA. Never raises: the outcome."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"kernel": qualname}
    try:
        import triton
        import triton.language as tl
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import convert_to_tuple_if_list

        fn = _jit_function(module, qualname)
        spec = json.loads(data)
        constexprs = {
            tuple(k): tl.dtype(v)
            if tl.dtype.is_dtype(v)
            else tl.constexpr(v["constexpr"])
            if isinstance(v, dict) and "constexpr" in v
            else v
            for k, v in zip(spec["constant_keys"], spec["constant_vals"], strict=True)
        }
        attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"], strict=True)}
        signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
        options = make_backend(target).parse_options(options)
        src = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(src, target=target, options=options.__dict__)
        out["hash"] = kernel.hash
        out["compile_s"] = round(time.perf_counter() - t0, 3)
        if launcher and target.backend == "cuda":
            t1 = time.perf_counter()
            try:
                from triton.backends.nvidia.driver import CudaLauncher

                CudaLauncher(kernel.src, kernel.metadata)  # compiles (or finds) and loads its launcher
                out["launcher_s"] = round(time.perf_counter() - t1, 3)
            except Exception as exc:  # no libcuda here (a CPU machine): the engine builds its own
                out["launcher_error"] = f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def driver_utils() -> dict[str, Any]:
    """Build Triton's CUDA driver helper module (cuda_utils, one per host) into the cache: the recording
    process would otherwise compile it serially at its first kernel."""
    t0 = time.perf_counter()
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()
        return {"seconds": round(time.perf_counter() - t0, 3)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "seconds": round(time.perf_counter() - t0, 3)}


def _outcome(future: Future) -> dict[str, Any] | None:
    """A compile's outcome: its result, an error for a worker that died under it, None while unfinished."""
    if not future.done() or future.cancelled():
        return None
    try:
        return future.result()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _worker_start(modules: tuple[str, ...]) -> None:
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _ready() -> int:
    return os.getpid()


# The line an engine logs for each kernel it compiles itself (not found in the cache it was given): the
# specialization the warm step's recording did not reach. bench/qualify_run.py gathers these lines.
OWN_COMPILE_LINE = "# compiled here: "
OWN_COMPILE_LIMIT = 60  # lines per process, at most


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def own_compile_record(src: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """One compile's specialization, in words: the kernel, its constexprs, the arguments Triton treated as
    divisible by 16, the other integers and pointers' types, and the launch options."""
    fn = getattr(src, "fn", None)
    names = list(getattr(fn, "arg_names", None) or [])

    def name_of(key: Any) -> str:
        i = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        return names[i] if isinstance(i, int) and 0 <= i < len(names) else str(key)

    attrs = getattr(src, "attrs", None) or {}
    divisible = sorted(
        name_of(k) for k, v in attrs.items() if any(a and a[0] == "tt.divisibility" for a in v or ())
    )
    signature = {k: _plain(v) for k, v in (getattr(src, "signature", None) or {}).items() if v != "constexpr"}
    return {
        "kernel": getattr(src, "name", "?"),
        "module": getattr(getattr(fn, "fn", None), "__module__", None),
        "constexprs": {name_of(k): _plain(v) for k, v in (getattr(src, "constants", None) or {}).items()},
        "divisible_by_16": divisible,
        "signature": signature,
        "num_warps": metadata.get("num_warps"),
        "num_stages": metadata.get("num_stages"),
    }


def log_own_compiles(stream: Any, limit: int = OWN_COMPILE_LIMIT) -> None:
    """From now on, each Triton kernel this process compiles (a cache miss) is written to `stream` as one
    OWN_COMPILE_LINE with its own_compile_record, at most `limit` lines; a listener already set still runs."""
    from triton import knobs

    before = knobs.compilation.listener
    written = [0]

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:  # type: ignore[no-untyped-def]
        if before is not None:
            before(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit
            )
        if cache_hit or written[0] >= limit:
            return
        written[0] += 1
        with contextlib.suppress(Exception):  # a diagnosis: it never stops a compile
            record = own_compile_record(src, metadata)
            stream.write(OWN_COMPILE_LINE + json.dumps(record, default=str)[:4000] + "\n")
            stream.flush()

    knobs.compilation.listener = listener


class DeferredKernel:
    """What a manual `.warmup()` returns inside a recording pass: its specialization went to the workers
    (nothing compiled here), and a launch through it runs nothing, as every launch in the pass runs nothing.
    b12x compiles its decode kernels so, keeps what warmup returns, launches it (`kernel[grid](...)`) and
    reads its compiler keys through `__b12x_programs__` (none here). Anything else a caller reads from it
    stops the pass, naming what was read, and the engines then compile the rest themselves."""

    __b12x_programs__ = ()

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any):  # noqa: ANN204
        return lambda *args, **kwargs: None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{self.kernel} was compiled by the warm step's workers, not in its recording pass: the "
            f"pass has no {name!r} to give"
        )


class Precompiler:
    """A pool of `jobs` compile workers (started at once: each imports Triton and the kernel modules while
    the caller builds its engine) and, inside `recording()`, the hook that sends each new specialization
    to them and keeps the launch from compiling or running."""

    def __init__(self, jobs: int, modules: tuple[str, ...] = KERNEL_MODULES, launchers: bool = True) -> None:
        import multiprocessing

        self.jobs = max(1, jobs)
        self.launchers = launchers
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._futures: list[tuple[dict[str, Any], Future]] = []
        self._target: Any = None
        self.record_s: float | None = None
        self.record_error: str | None = None
        self.deferred: list[str] = []  # manual warmups, compiled by the workers (see _hook)
        self.marks: dict[str, float] = {}  # where the step was, seconds since the pool started (mark())
        # spawn: a fork of a process that holds a CUDA context is unusable, and the workers need none
        self.pool = ProcessPoolExecutor(
            self.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
            initargs=(modules,),
        )  # fmt: skip
        self._utils = self.pool.submit(driver_utils) if launchers else None
        for _ in range(self.jobs - 1):
            self.pool.submit(_ready)  # every worker starts now, not at the first specialization

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002, ARG002
        jit = fn.jit_function
        data = compile["specialization_data"]
        record: dict[str, Any] = {"module": jit.fn.__module__, "kernel": jit.fn.__qualname__}
        with self._lock:
            if data in self._seen:
                return True
            self._seen.add(data)
            if is_manual_warmup:
                # kernel.warmup(...) hands the compiled kernel to its caller, who keeps it and launches it
                # (b12x prepares its decode kernels so, one per batch shape). Compiled here they came one
                # after another: on an H100 (2026-12-05) the first request of each batch shape took 10.3 of
                # the recording's 14.8 s. Sent to the workers like any other specialization; the caller
                # gets a DeferredKernel (recording(): the patched warmup).
                self.deferred.append(record["kernel"])
            if self._target is None:
                from triton.runtime.driver import driver

                self._target = driver.active.get_current_target()
            record["at_s"] = self._since_start()
            try:
                future = self.pool.submit(
                    compile_spec, record["module"], record["kernel"], data, self._target, self.launchers
                )
            except Exception as exc:  # a broken pool (a worker died): this one is the engines' to compile
                future = Future()
                future.set_exception(exc)
            future.add_done_callback(lambda _f, rec=record: rec.__setitem__("done_at_s", self._since_start()))
            self._futures.append((record, future))
        return True  # compiled by a worker: nothing compiles or launches here

    def _since_start(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def mark(self, name: str) -> None:
        """Note that the step reached `name` now (finish() reports the marks: where the step's time went)."""
        self.marks[name] = self._since_start()

    @contextlib.contextmanager
    def recording(self):  # type: ignore[no-untyped-def]
        """Inside: every Triton launch records its specialization for the workers and runs nothing, and a
        manual warmup does the same and returns a DeferredKernel."""
        from triton import knobs
        from triton.runtime.jit import JITFunction

        before, warmup = knobs.runtime.jit_cache_hook, JITFunction.warmup

        def deferred_warmup(fn, *args, **kwargs):  # noqa: ANN001, ANN202
            got = warmup(fn, *args, **kwargs)
            return DeferredKernel(fn.fn.__qualname__) if got is None else got

        knobs.runtime.jit_cache_hook = self._hook
        JITFunction.warmup = deferred_warmup  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            knobs.runtime.jit_cache_hook = before
            JITFunction.warmup = warmup  # type: ignore[method-assign]
            # summed over the passes (the warm step records b12x's conformance check in one of its own)
            self.record_s = round((self.record_s or 0.0) + time.perf_counter() - t0, 3)

    def finish(self, timeout_s: float = COMPILE_WAIT_S) -> dict[str, Any]:
        """Wait (bounded) for every compile; what was compiled, how long, and what failed."""
        t0 = time.perf_counter()
        with self._lock:
            futures = list(self._futures)
        pending = [f for _, f in futures] + ([self._utils] if self._utils is not None else [])
        _, not_done = wait(pending, timeout=timeout_s)
        results = [_outcome(f) for _, f in futures]
        if not_done:
            self.close()
        else:
            self.pool.shutdown(wait=True)
        failed = [
            {**rec, "error": (r or {}).get("error", f"not compiled within {timeout_s:g} s")}
            for (rec, _), r in zip(futures, results, strict=True)
            if r is None or "error" in r
        ]
        done = [r for r in results if r is not None and "error" not in r]
        at = [rec["at_s"] for rec, _ in futures if "at_s" in rec]
        launcher_errors = sorted({r["launcher_error"] for r in done if "launcher_error" in r})
        utils = _outcome(self._utils) if self._utils is not None else None
        slowest = sorted(done, key=lambda r: -r["seconds"])[:5]
        return {
            "jobs": self.jobs,
            "specializations": len(futures),
            "compiled": len(done),
            "failed_count": len(failed),
            "failed": failed[:20],
            "kernels": sorted({rec["kernel"] for rec, _ in futures}),
            "launchers_built": sum(1 for r in done if "launcher_s" in r),
            "launcher_errors": launcher_errors[:3],
            "driver_utils": utils,
            "record_s": self.record_s,
            "record_error": self.record_error,
            "deferred": sorted(self.deferred),
            "wait_after_record_s": round(time.perf_counter() - t0, 3),
            "compile_cpu_s": round(sum(r["seconds"] for r in done), 3),
            "slowest": [{"kernel": r["kernel"], "seconds": r["seconds"]} for r in slowest],
            # the step's clock (seconds since its pool started): its marks, when the first and the last
            # specialization were recorded, and the compiles that finished last (what the step waited on)
            "marks": dict(self.marks),
            "recorded_at_s": [min(at), max(at)] if at else None,
            "finished_last": [
                {k: rec.get(k) for k in ("kernel", "at_s", "done_at_s")}
                for rec in sorted(
                    (rec for rec, _ in futures if rec.get("done_at_s") is not None),
                    key=lambda rec: -rec["done_at_s"],
                )[:TIMELINE_LAST]
            ],
            "seconds": round(time.perf_counter() - self.t0, 3),
        }

    def close(self) -> None:
        """Stop the workers now (an interrupted step, compiles past their bound): queued compiles are
        dropped and running ones killed, so the step's exit waits for none of them."""
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
