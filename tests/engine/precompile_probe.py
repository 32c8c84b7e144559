"""`python -m tests.engine.precompile_probe record|jit|census` (TRITON_INTERPRET off, TRITON_CACHE_DIR
set): the warm step's parallel compile (qualify/engine/precompile.py) driven on a machine without a GPU.

Triton's JIT asks its active driver for the device, the stream and the target; here a driver that answers
for an H200 (sm_90) stands in, so the reference engine's decode step (its Triton glue: kernels/fused.py,
on CPU tensors) runs through the real JIT path up to the launch. `record` runs it in recording mode and
compiles what it recorded in two worker processes; `jit` runs it as an engine would, the JIT compiling
(or finding in the cache) each kernel and its launcher, with the launch itself a no-op. Each prints one
JSON line: what was recorded and compiled, or every compile the JIT made and whether it was a cache hit,
and whether each launcher's module was in the cache."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

TARGET = GPUTarget("cuda", 90, 32)


class _Utils:
    @staticmethod
    def get_device_properties(device: int) -> dict:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536}

    @staticmethod
    def load_binary(name, kernel, shared, device):  # type: ignore[no-untyped-def]
        return 0, 0, 64, 0, 1024  # module, function, registers, spills, max threads


LAUNCHERS: list[bool] = []


class _Launcher:
    """Records whether the launcher module the real driver would build for this kernel is in the cache."""

    def __init__(self, src, metadata) -> None:  # type: ignore[no-untyped-def]
        from triton.backends.nvidia.driver import make_launcher
        from triton.runtime.build import platform_key
        from triton.runtime.cache import get_cache_manager

        constants = src.constants if hasattr(src, "constants") else {}
        arg = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
        constants = {arg(k): v for k, v in constants.items()}
        code = make_launcher(constants, dict(src.signature), getattr(metadata, "tensordesc_meta", None))
        key = hashlib.sha256((code + platform_key()).encode()).hexdigest()
        LAUNCHERS.append(get_cache_manager(key).get_file("__triton_launcher" + _suffix()) is not None)

    def __call__(self, *args) -> None:  # type: ignore[no-untyped-def]
        return None


def _suffix() -> str:
    import sysconfig

    return sysconfig.get_config_var("EXT_SUFFIX")


class FakeH200Driver:
    """As much of Triton's CUDA driver as the JIT asks of it before a launch, for an sm_90 device."""

    launcher_cls = _Launcher
    utils = _Utils()

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


@triton.jit
def _warmup_probe_kernel(x, y, N: tl.constexpr):
    """A kernel outside the engine's modules that its caller compiles with .warmup(), as b12x does."""
    i = tl.arange(0, N)
    tl.store(y + i, tl.load(x + i) * 2)


def _probe_kernel():  # noqa: ANN202
    """_warmup_probe_kernel as imported by its module's name (run with -m, this file is __main__, a name
    a compile worker cannot import)."""
    from tests.engine import precompile_probe

    return precompile_probe._warmup_probe_kernel


def work() -> list[list[int]]:
    """The decode step's glue of the tiny reference engine, fused (kernels/fused.py), at two batch sizes:
    what Engine.warm reaches for these kernels, in a few steps. The tokens each request generated."""
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine
    from qualify.engine.tokenizer import BOS

    cfg = EngineConfig(preset="tiny", device="cpu", kda_decode_backend="torch", cudagraph_mode="none")
    engine = Engine(cfg, weights=False)
    engine.model.set_fused(True)
    tokens = []
    try:
        for b in (1, 3):
            gens, _ = engine.generate(
                [[BOS, *[65 + (i + j) % 26 for j in range(5)]] for i in range(b)], 2, "eager"
            )
            tokens += [g.token_ids for g in gens]
    finally:
        engine.close()
    return tokens


def _poisoned_empty() -> None:
    """torch.empty and torch.empty_like fill what they return (NaN, -1, True): a recording pass's values
    are whatever memory held, and on a GPU's caching allocator that is anything, not a fresh page's zeros."""

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.fill_(True if t.dtype == torch.bool else -1)

    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison(empty(*a, **k))  # type: ignore[assignment]
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))  # type: ignore[assignment]


def census() -> None:
    """Every kind of work of the warm step (Engine.warm: eager and speculative batches of every size) on the
    Triton backend with the fused glue, weights not loaded, every launch recorded and skipped, every empty
    buffer poisoned: which kinds of work completed and which kernels were recorded (no compile)."""
    import kernels.kda.backend as kb
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    kb._interpreting = lambda: True  # the triton backend on CPU tensors (its kernels are only recorded)
    _poisoned_empty()
    seen: dict[str, set[str]] = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002, ARG001
        seen.setdefault(fn.jit_function.fn.__qualname__, set()).add(compile["specialization_data"])
        return True

    knobs.runtime.jit_cache_hook = hook
    cfg = EngineConfig(preset="tiny", device="cpu", kda_decode_backend="triton", num_spec=3)
    engine = Engine(cfg, weights=False)
    engine.model.set_fused(True)
    try:
        out = engine.warm()
    finally:
        engine.close()
    kernels = {k: len(v) for k, v in sorted(seen.items())}
    print(json.dumps({"ran": out["ran"], "kernels": kernels}), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    driver.set_active(FakeH200Driver())
    if sys.argv[1] == "census":
        census()
        return
    if sys.argv[1] == "ownlog":  # an engine's log of the kernels it compiles itself (log_own_compiles)
        import io

        from bench import sm90
        from qualify.engine.precompile import log_own_compiles

        earlier: list[bool] = []
        knobs.compilation.listener = lambda **kw: earlier.append(kw["cache_hit"])
        out = io.StringIO()
        log_own_compiles(out, limit=5)
        _, fn, sig, constexprs, warps = next(c for c in sm90._decode_cases() if c[0] == "decode gated norm")
        sm90.compile_sm90(fn, sig, constexprs, warps)
        sm90.compile_sm90(fn, sig, constexprs, warps)  # found in the cache: no line
        lines = out.getvalue().splitlines()
        print(json.dumps({"earlier": earlier, "lines": lines, "constexprs": constexprs, "warps": warps}))
        return
    if sys.argv[1] == "record":
        from qualify.engine.precompile import Precompiler

        pre = Precompiler(2)
        try:
            pre.mark("before_recording")
            with pre.recording():
                tokens = work()
                x, y = torch.ones(16), torch.zeros(16)
                warmed = _probe_kernel().warmup(x, y, N=16, grid=(1,))
                warmed[(1,)](x, y)  # as b12x launches what its warmup returned: runs nothing here
            facts = pre.finish()
        except BaseException:
            pre.close()
            raise
        facts["tokens"] = tokens  # an unloaded engine's: whatever its memory held (runs to max_tokens)
        facts["warmup_returned"] = type(warmed).__name__
        facts["launch_wrote"] = bool(y.any())
        print(json.dumps(facts), flush=True)
        return
    compiles: list[dict] = []

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:  # type: ignore[no-untyped-def]
        compiles.append({"kernel": src.name, "cache_hit": cache_hit})

    knobs.compilation.listener = listener
    work()
    _probe_kernel().warmup(torch.ones(16), torch.zeros(16), N=16, grid=(1,))  # b12x's way, in an engine
    print(json.dumps({"compiles": compiles, "launchers_in_cache": LAUNCHERS}), flush=True)


if __name__ == "__main__":
    main()
