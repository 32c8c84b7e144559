"""`Engine`: one configured engine on one device — backend resolved once, layout allocated and exported,
arena, model with its weights, runner, counters — and the verbs the HTTP API exposes."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from kernels.kda import BackendUnavailable, get_backend, resolve_backend
from qualify.protocol import PROTOCOL_VERSION, Counters, package_digest, tree_digest

from .arena import build_arena
from .config import EngineConfig
from .layout import allocate_group, plan_layout, release_group
from .model import HybridModel
from .model.attention import AttentionRuntime
from .model.kda_layer import KdaRuntime
from .runner import Runner
from .tokenizer import BOS
from .weights import (
    Phases,
    default_weights_path,
    ensure_weights,
    generate,
    reload,
    reload_state,
    save_streamed,
    snapshot,
    wait_for_file,
)

ENGINE_NAME = "qualify-reference-engine"
SAVE_WAIT_S = 300.0  # a seeded weights file written in the background is done within this
_ENGINE_DIR = Path(__file__).resolve().parent


WARM_EVERY_BATCH_MAX = 16  # the warm step's decode steps at every request count up to this


class EngineConfigError(ValueError):
    """The engine cannot be constructed as configured (one line: what and what to do)."""


def code_digest() -> str:
    """sha256 over the engine's source: qualify/engine, qualify/protocol.py, qualify/shm.py and kernels."""
    root = _ENGINE_DIR.parent.parent
    files = sorted(
        [
            *_ENGINE_DIR.rglob("*.py"),
            root / "qualify" / "protocol.py",
            root / "qualify" / "shm.py",
            *(root / "kernels").rglob("*.py"),
        ]
    )
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    base = "sha256:" + h.hexdigest()
    # Run by another module (`python -m tests.liars.x`, a patched build): that module's code is part of what
    # runs, so the engine names it too (docs/PROTOCOL.md, Identity): sha256(base NUL module NUL its digest).
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = getattr(main, "name", None) or ""
    if module.endswith(".__main__"):
        module = module.removesuffix(".__main__")
    if not module or module == "qualify.engine" or main is None or not main.origin:
        return base
    origin = Path(main.origin).resolve()
    own = (
        package_digest(origin.parent)
        if origin.name == "__main__.py"
        else tree_digest(origin.parent, [origin])
    )
    return "sha256:" + hashlib.sha256(f"{base}\0{module}\0{own}".encode()).hexdigest()


class Engine:
    def __init__(self, cfg: EngineConfig, dcp=None, weights: bool = True):
        """dcp: this process's DcpGroup when the DCP shards run one per rank (qualify/engine/dcp.py).
        weights False: the parameters are left as allocated, never loaded or hashed (the warm step's
        recording pass, which needs their shapes and addresses, not their values: precompile.py)."""
        t0 = time.perf_counter()
        # Seconds per step of construction, each since the one before (the engine's log names them).
        self.boot_phases: dict[str, float] = {}
        self._phase_at = t0
        self.cfg = cfg
        self.dcp = dcp
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and dcp is not None:
            self.device = torch.device("cuda", dcp.rank)  # rank r drives the r-th visible GPU
        elif self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._phase("device")
        try:
            self.resolution = resolve_backend(
                cfg.kda_decode_backend, speculative=cfg.num_spec > 0, device=self.device
            )
        except (BackendUnavailable, ValueError) as e:
            raise EngineConfigError(str(e)) from e
        self._phase("resolve_backend")
        self.backend = get_backend(self.resolution.name)
        self._phase("backend_import")
        self.layout = plan_layout(cfg.layer_pattern, cfg.group_size, cfg.block_size, cfg.dcp_size)
        self.allocations = []
        self._load_weights = weights
        try:
            self._build(cfg)
        except BaseException:
            self.close()  # a failed boot must not leave its shared allocations behind
            raise
        self.boot_seconds = time.perf_counter() - t0

    def _phase(self, name: str) -> None:
        """Record the seconds since the previous step of construction under `name`."""
        now = time.perf_counter()
        self.boot_phases[name] = round(now - self._phase_at, 4)
        self._phase_at = now

    def _build(self, cfg: EngineConfig) -> None:
        for g in self.layout.groups:
            self.allocations.append(allocate_group(g, cfg, self.device))
        self._phase("kv_allocations")
        self.arena = build_arena(cfg, self.device)
        self._phase("arena")
        self.model = HybridModel(cfg, self.device)
        # The decode step's glue (norms, activation, conv, RoPE + K/V write, attention) runs as Triton
        # kernels on CUDA (kernels/fused.py); CPU engines keep the torch reference ops.
        self.model.set_fused(self.device.type == "cuda")
        self._phase("model")
        self.kda_rt = KdaRuntime.build(self.backend, cfg, self.arena, self.device)
        self.attn_rt = AttentionRuntime(cfg, self.device, self.dcp)
        for alloc in self.allocations:
            for layer in alloc.group.layers:
                mixer = self.model.layers[layer].mixer
                if alloc.group.kind == "kda":
                    mixer.attach(self.kda_rt, alloc.views[(layer, "state")], alloc.views[(layer, "conv")])
                else:
                    mixer.attach(self.attn_rt, alloc.views[(layer, "k")], alloc.views[(layer, "v")])
        self._phase("runtimes")
        self.weights_path: Path | None = None
        self.weights_digest: str | None = None
        if self._load_weights:
            if cfg.weights and not cfg.weights_create and cfg.weights_wait_s > 0:
                # the harness still seeding it: waited for here, for the boot phase (ensure_weights's own wait
                # then finds the file; its (model, cfg) call is the seam engine wrappers patch)
                wait_for_file(Path(cfg.weights), cfg.weights_wait_s)
                self._phase("weights_wait")
            self.weights_path = ensure_weights(self.model, cfg)
            self._phase("weights")
            self.weights_digest = snapshot(self.model).digest
            self._phase("weights_digest")
        self.counters = Counters()
        # weights never loaded: every request runs to max_tokens (Runner.stop_at_eos says why)
        self.runner = Runner(
            cfg, self.model, self.arena, self.device, self.counters, stop_at_eos=self._load_weights
        )
        self._phase("runner")

    # ------------------------------------------------------------------ verbs

    def generate(self, prompts: list[list[int]], max_tokens: int, mode: str = "auto"):
        self.counters.requests += 1
        return self.runner.generate(prompts, max_tokens, mode)

    def reload(self, path: str | None = None, seed: int | None = None) -> dict:
        """In-place reload. seed: generate fresh weights with that seed beside the current file first."""
        t0 = time.perf_counter()
        if path is not None and seed is not None:
            raise ValueError("give either path or seed, not both")
        arena_before = self.arena.addresses()
        if seed is not None:
            target = default_weights_path(self.cfg, seed)
            beside = Path(self.weights_path).parent
            if self.cfg.scratch_dir:  # the launch document's one writable directory
                target = Path(self.cfg.scratch_dir) / target.name
            elif beside != target.parent and os.access(beside, os.W_OK):
                target = beside / target.name  # else (a read-only weights mount): under the data dir
        if seed is None:
            target = Path(path) if path is not None else Path(self.weights_path)
        phases: dict[str, float] = {}  # seconds of each part (diagnostic: what a reload costs)
        marks = Phases(phases)
        self._saved(target)  # the file being written in the background, if this reload reads or writes it
        marks.mark("wait_for_background_save")
        if seed is not None and not target.is_file():
            # Loaded from the generated tensors; the file (the same bytes) is written beside the checks.
            state = generate(self.model, seed)
            marks.mark("generate")
            before, after = reload_state(self.model, state, phases)
            meta = {"seed": str(seed), "preset": self.cfg.preset}
            self._saved()  # one background write at a time
            failed: list[BaseException] = []

            def write() -> None:
                try:
                    save_streamed(state, target, meta)
                except BaseException as exc:  # noqa: BLE001 - raised by the next reload that waits for it
                    failed.append(exc)

            thread = threading.Thread(target=write, name="weights-save", daemon=True)
            thread.start()
            self._saving = (thread, target, failed)
        else:
            before, after = reload(self.model, target, phases)
        self.weights_path = target
        self.weights_digest = after.digest
        changed = sorted(n for n in after.checksums if after.checksums[n] != before.checksums[n])
        # Captured graphs read every parameter, pool and buffer in place: none may have moved.
        moved = self.runner.graphs.moved_since_capture() if self.runner.graphs else []
        return {
            "census": {
                "params": len(after.pointers),
                "addresses_unchanged": before.pointers == after.pointers,
                "changed": changed,
                "before_digest": before.digest,
                "after_digest": after.digest,
                "arena_addresses_unchanged": arena_before == self.arena.addresses(),
                "graph_addresses_moved": moved,
            },
            "seconds": time.perf_counter() - t0,
            "seconds_each": phases,
            "weights_path": str(target),
        }

    def probe(self) -> dict:
        """One plain decode step of a throwaway request under the torch profiler: the op/kernel names. On
        CUDA through Kineto (CUPTI names the device kernels); on CPU through the autograd profiler without
        Kineto, which names the same ops (the same RecordFunction events) without Kineto's start-up, most
        of a CPU probe's seconds (3.6 s of 3.7 on the 2-core machine)."""
        r = self.runner
        r.check_admission([[BOS, 65]], 2)
        req = r.admit([BOS, 65], 2)
        try:
            toks, gaps = r.pick(r.prefill([req]))
            r._append(req, toks[0], gaps[0])
            with _profiler(self.device.type == "cuda") as prof:
                r.decode_step([req], "eager")
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            names = sorted({e.key for e in prof.key_averages()})
        finally:
            r.release(req)
        return {"kernel_names": names, "backend": self.resolution.name, "device_type": self.device.type}

    def capture(self) -> dict:
        """FULL CUDA-graph capture of every size (graphs.py); without CUDA nothing is captured, and why."""
        from .graphs import capture_engine

        return capture_engine(self)

    def warm(self) -> dict:
        """The warm step (`python -m qualify.engine warm`): each kind of work the harness's checks ask of an
        engine, run once, so that the kernels they launch are compiled into this process's caches (the
        harness keeps what the step leaves and gives every later engine of the build a copy). Eager and
        speculative batches of every size with prompts whose token counts are and are not multiples of 16
        (Triton specializes integer arguments by divisibility by 16 and by equality with 1), then the FULL
        capture and a replay of each captured size. Nothing here is kept: every request is released."""
        from .spec import speculative_generate

        t0 = time.perf_counter()
        cfg = self.cfg
        sizes = sorted({1, 2, 3, cfg.max_num_seqs})
        ran: list[str] = []
        each: dict[str, float] = {}  # seconds per kind of work (a recording pass: where its time goes)
        mark = time.perf_counter()

        def done(what: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            ran.append(what)
            each[what] = round(now - mark, 3)
            mark = now

        snapshot(self.model)  # the reload census's kernel (a CUDA engine's boot and every reload run it)
        done("census")
        for b in sizes:
            # each prompt of BOS + n tokens (a CUDA engine prefills a request's prompts together: b prompts
            # of a length that is not a multiple of 16, and of one that is)
            for n in (5, 16 * max(1, b) - 1):
                prompts = [[BOS, *[65 + (i + j) % 26 for j in range(n)]] for i in range(b)]
                self.generate(prompts, 3, "eager")
                done(f"eager b={b} n={n + 1}")
                if cfg.num_spec > 0:
                    speculative_generate(self, prompts, 3, "eager")
                    done(f"speculative b={b} n={n + 1}")
        # A batch shrinks as its requests finish, so eager steps run at every count of requests up to
        # max_num_seqs, and a backend may compile per count: b12x compiles a decode kernel per number of
        # requests and tokens each (an engine on an H100, 2026-12-05, compiled one for 5 requests itself).
        every = [b for b in range(1, min(cfg.max_num_seqs, WARM_EVERY_BATCH_MAX) + 1) if b not in sizes]
        for b in every:
            prompts = [[BOS, *[65 + (i + j) % 26 for j in range(5)]] for i in range(b)]
            self.generate(prompts, 2, "eager")  # one decode step of b requests
            if cfg.num_spec > 0:
                speculative_generate(self, prompts, 2, "eager")  # one verify step of b requests
        if every:
            done(f"eager and speculative steps b in {every}")
        captured = self.capture()
        each["capture"] = round(time.perf_counter() - mark, 3)
        mark = time.perf_counter()
        if captured.get("captured"):
            for b in sizes:
                prompts = [[BOS, 65 + i, 66] for i in range(b)]
                self.generate(prompts, 3, "graph")
                if cfg.num_spec > 0:
                    speculative_generate(self, prompts, 3, "graph")
            done(f"graph replay b in {sizes}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {
            "seconds": round(time.perf_counter() - t0, 3),
            "ran": ran,
            "seconds_each": each,
            "captured": {k: captured.get(k) for k in ("captured", "sizes", "reason")},
        }

    def dcp_record(self) -> dict:
        """This process's DCP place: rank, world, pid, device and the allocations it registered."""
        return {
            "rank": 0 if self.dcp is None else self.dcp.rank,
            "world": 1 if self.dcp is None else self.dcp.world,
            "local_shards": self.cfg.dcp_local_shards,
            "pid": os.getpid(),
            "device": str(self.device),
            "groups": [a.record() for a in self.allocations],
        }

    def _saved(self, target: Path | None = None, timeout_s: float = SAVE_WAIT_S) -> None:
        """Wait for the seeded weights file written in the background: always, or (with `target`) only
        when that is the file."""
        saving = getattr(self, "_saving", None)
        if saving is None or (target is not None and Path(target).resolve() != saving[1].resolve()):
            return
        saving[0].join(timeout_s)
        if saving[0].is_alive():
            raise RuntimeError(
                f"the seeded weights file {saving[1]} is still being written after {timeout_s:g} s"
            )
        self._saving = None
        if saving[2]:
            raise RuntimeError(f"writing the seeded weights file {saving[1]} failed: {saving[2][0]}")

    def close(self) -> None:
        self._saved()
        for a in self.allocations:
            release_group(a)

    # ------------------------------------------------------------------ describe

    def describe(self) -> dict:
        cfg = self.cfg
        return {
            "protocol_version": PROTOCOL_VERSION,
            "engine": {
                "name": ENGINE_NAME,
                "version": _qualify_version(),
                "code_digest": code_digest(),
                "weights_digest": self.weights_digest,
                "weights_path": str(self.weights_path),
            },
            "config": cfg.public_dict(),
            "config_digest": cfg.digest(),
            "backend": {
                "requested": cfg.kda_decode_backend,
                "resolved": self.resolution.name,
                "reason": self.resolution.reason,
                "prefill_path": "torch chunk reference"
                if self.backend.name == "torch"
                else "triton chunked prefill",
                "glue": self.model.glue,
            },
            "layout": {
                "spans": self.layout.spans,
                "chunk": self.layout.chunk,
                "ratios": self.layout.ratios,
                "groups": [a.record() for a in self.allocations],
            },
            "dcp_mode": "folded" if self.dcp is None else "distributed",
            "dcp": self.dcp_record(),
            "arenas": self.arena.describe(),
            "capacity": {
                "live_slots": cfg.max_num_seqs,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "graph_max_batch": cfg.graph_max_batch,
                "num_spec": cfg.num_spec,
            },
            "device": device_info(self.device),
            "versions": versions(),
            "counters": self.counters.model_dump(),
            "cudagraph_mode": cfg.cudagraph_mode,
        }


def _profiler(cuda: bool):  # type: ignore[no-untyped-def]
    """The probe's profiler: Kineto with CUDA activity on CUDA, the autograd profiler without Kineto on CPU
    (Kineto where a torch has no such profiler any more)."""
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    try:
        return torch.autograd.profiler.profile(use_kineto=False)
    except (TypeError, RuntimeError, ValueError):
        return profile(activities=[ProfilerActivity.CPU])


def _qualify_version() -> str:
    from qualify import __version__

    return __version__


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine()}
    p = torch.cuda.get_device_properties(device)
    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # NVML is optional evidence: record None rather than fail the describe
        driver = None
    return {
        "type": "cuda",
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "driver": driver,
        "total_memory": p.total_memory,
    }


def versions() -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda,
        "qualify": _qualify_version(),
    }
