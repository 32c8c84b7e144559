"""Weights: seeded random generation (saved once as safetensors under the data dir, reused next boot),
loading into the existing parameters only (`copy_`), and in-place reload with a census of addresses and
checksums before and after (captured graphs keep reading the same parameter storage).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes
from torch import nn


class WeightsError(ValueError):
    """A weights file that does not match the model; nothing was copied."""


def default_weights_path(cfg, seed: int | None = None) -> Path:
    from qualify.settings import data_dir

    s = cfg.shape
    shape_key = hashlib.sha256(repr((s, cfg.layer_pattern, cfg.dtype)).encode()).hexdigest()[:12]
    seed = cfg.seed if seed is None else seed
    return data_dir() / "weights" / f"{cfg.preset}-{cfg.layer_pattern}-seed{seed}-{shape_key}.safetensors"


def _param_seed(seed: int, name: str) -> int:
    # Per-parameter streams: a parameter's values do not depend on the order parameters are visited in.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _init_tensor(
    name: str, shape: tuple[int, ...], dev: torch.device, gen: torch.Generator, num_layers: int
) -> torch.Tensor:
    """Scaled init so hidden states stay O(1) through the stack and greedy text is stable."""
    if name.endswith("norm.weight") or name.endswith("norm_weight"):
        return torch.ones(shape, device=dev)
    if name.endswith("A_log"):
        return torch.empty(shape, device=dev).uniform_(0.0, math.log(16.0), generator=gen)
    if name.endswith("dt_bias"):
        return torch.empty(shape, device=dev).uniform_(-2.0, 0.0, generator=gen)
    if name.endswith("conv_weight"):
        return torch.randn(shape, device=dev, generator=gen) / math.sqrt(shape[-1])
    if name == "embed.weight":
        return torch.randn(shape, device=dev, generator=gen)
    std = 1.0 / math.sqrt(shape[-1])
    if name == "lm_head.weight":
        std *= 4.0  # wider logits: fewer near ties between the top two tokens, so greedy text is stable
    if any(k in name for k in ("out_proj", "o_proj", "down")):
        std /= math.sqrt(2.0 * num_layers)  # residual branches: keep the residual stream's growth bounded
    return torch.randn(shape, device=dev, generator=gen) * std


def generate_one(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int, num_layers: int
) -> torch.Tensor:
    """One parameter's seeded value (its own stream: independent of the order parameters are visited in)."""
    gen = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return _init_tensor(name, tuple(shape), device, gen, num_layers).to(dtype)


def generate(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh weights for every parameter of `model` (on the model's device, in each parameter's dtype)."""
    num_layers = len(getattr(model, "layers", [])) or 1
    return {
        name: generate_one(name, tuple(p.shape), p.dtype, p.device, seed, num_layers)
        for name, p in model.named_parameters()
    }


def canonical_bytes(data: bytes) -> tuple[bytes, memoryview]:
    """A safetensors file's bytes with its JSON header rewritten with sorted keys and no spaces (padded to 8
    bytes as the format asks), so the same tensors and metadata always give the same bytes: the library
    writes its metadata map in hash order, which changes from process to process. Offsets are relative to
    the data section, so the tensor bytes are kept as they are: (new length and header, the tensor bytes),
    written one after the other, once."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, memoryview(data)[8 + n :]


def save(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write `state` as a byte-deterministic safetensors file (canonical header), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data = save_bytes({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata=metadata)
    head, body = canonical_bytes(data)
    with tmp.open("wb") as f:
        f.write(head)
        f.write(body)
    del body, data
    os.replace(tmp, path)  # atomic: a reader never sees half a file


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_streamed(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """The bytes `save` writes for `state`, atomically, without a host copy of the whole file: the header,
    then each tensor through two pinned buffers (CUDA tensors, copied on a stream of this call's own) or
    from its own memory (CPU). For a writer beside a serving engine (Engine.reload's background save):
    `save` copies every tensor to the host on the current stream, which the engine's next steps queue
    behind, and serializes the file in one call that holds the interpreter; on an H100 host (2026-12-05)
    the request after a seeded reload waited 2.2 s for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    on_cuda = [t.device for t in state.values() if t.is_cuda]
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(tmp.open("wb"))
        if on_cuda:
            stack.enter_context(torch.cuda.device(on_cuda[0]))
            side = torch.cuda.Stream(on_cuda[0])
            side.wait_stream(torch.cuda.current_stream(on_cuda[0]))  # whatever wrote the tensors comes first
            stack.enter_context(torch.cuda.stream(side))
        _write_tensors(out, params, metadata, lambda name: state[name].detach())
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def seeded_layout(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str]
) -> tuple[bytes, list[str]]:
    """The canonical header (length and JSON, as `save` writes it) of a seeded weights file whose tensors
    have these shapes and dtypes, and the order their bytes follow it in: the order is the library's own
    (asked of it with one-element stand-ins), so the file is the one `save` would write."""
    probe = save_bytes({n: torch.zeros(1, dtype=dt) for n, (_, dt) in params.items()}, metadata=metadata)
    placed = json.loads(probe[8 : 8 + int.from_bytes(probe[:8], "little")])
    order = sorted(params, key=lambda n: int(placed[n]["data_offsets"][0]))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        shape, dtype = params[name]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, order


def write_seeded(
    model: nn.Module, seed: int, out: BinaryIO, device: torch.device, metadata: dict[str, str]
) -> int:
    """Write the seeded weights file of `model`'s parameters (shapes and dtypes only: it may live on the
    meta device) to `out` as it is generated, one parameter at a time on `device`: the bytes `save` writes
    for `generate(model, seed)` on `device`, without holding the file in memory or writing it twice
    (a harness reading a pipe hashes it as it comes). The bytes written."""
    num_layers = len(getattr(model, "layers", [])) or 1
    params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}

    def tensor(name: str) -> torch.Tensor:
        shape, dtype = params[name]
        return generate_one(name, shape, dtype, device, seed, num_layers)

    return _write_tensors(out, params, metadata, tensor)


def _write_tensors(
    out: BinaryIO,
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    metadata: dict[str, str],
    tensor: Callable[[str], torch.Tensor],
) -> int:
    """The safetensors file `save` writes for tensors of these shapes and dtypes: the canonical header,
    then `tensor(name)`'s bytes in the library's order, each asked for when its turn comes and dropped
    before the next (CUDA tensors through two pinned buffers, on the current stream; CPU tensors from their
    own memory). The bytes written."""
    head, order = seeded_layout(params, metadata)
    written = _write_all(out, head)
    bufs: list[torch.Tensor] = []
    for name in order:
        flat = tensor(name).contiguous().reshape(-1).view(torch.uint8)
        if flat.is_cuda:
            if not bufs:
                bufs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            written += _write_device(out, flat, bufs)
        else:
            written += _write_all(out, memoryview(flat.numpy()))
        del flat
    return written


def _write_all(out: BinaryIO, data: bytes | memoryview) -> int:
    view = memoryview(data)
    while view:
        n = out.write(view)
        if n is None:  # a non-blocking stream with no room: never ours
            raise OSError("the weights stream would block")
        view = view[n:]
    return len(data)


def _write_device(out: BinaryIO, flat: torch.Tensor, bufs: list[torch.Tensor]) -> int:
    """A CUDA tensor's bytes through two pinned buffers: chunk k+1 is copied while chunk k is written."""
    spans = [(o, min(CHUNK_BYTES, flat.numel() - o)) for o in range(0, flat.numel(), CHUNK_BYTES)]
    ready = [torch.cuda.Event(), torch.cuda.Event()]

    def issue(i: int) -> None:
        o, n = spans[i]
        bufs[i % 2][:n].copy_(flat[o : o + n], non_blocking=True)
        ready[i % 2].record()

    if spans:
        issue(0)
    for i, (_, n) in enumerate(spans):
        ready[i % 2].synchronize()
        view = memoryview(bufs[i % 2].numpy())[:n]
        if i + 1 < len(spans):
            # the other buffer's chunk was written the iteration before: copy the next one into it now
            issue(i + 1)
        _write_all(out, view)
    return flat.numel()


def load_into(model: nn.Module, path: str | Path) -> None:
    """Copy a safetensors file into the existing parameters (`param.data.copy_`), all or nothing."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; pass an existing .safetensors file")
    params = dict(model.named_parameters())
    try:
        # Read on the host and copied into each parameter: no second device copy of each tensor is made.
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError (not a ValueError): a corrupt or foreign file
        raise WeightsError(
            f"weights file {path} is not a readable safetensors file ({e}); pass a .safetensors file"
        ) from e
    with handle as f:
        names = set(f.keys())
        missing, extra = sorted(set(params) - names), sorted(names - set(params))
        if missing or extra:
            raise WeightsError(
                f"weights file {path} does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, p in params.items():
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != tuple(p.shape):
                raise WeightsError(
                    f"weights file {path}: {name} has shape {shape}, the model wants {tuple(p.shape)}"
                )
            dtype = sl.get_dtype()
            want = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[p.dtype]
            if dtype != want:
                raise WeightsError(f"weights file {path}: {name} is {dtype}, the model wants {want}")
        with torch.no_grad():
            for name, p in params.items():
                p.data.copy_(f.get_tensor(name))


# How often an engine told to wait for its weights file (the launch document's weights.wait_s) looks again.
WEIGHTS_POLL_S = 0.02


def wait_for_file(path: Path, timeout_s: float) -> bool:
    """True once `path` is a file (the harness renames or links it into place whole), within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() >= deadline:
            return False
        time.sleep(WEIGHTS_POLL_S)
    return True


def ensure_weights(model: nn.Module, cfg) -> Path:
    """Load the configured weights; generate and save them first if this is the first boot. A named file the
    harness is still seeding (cfg.weights_wait_s) is waited for, bounded."""
    path = Path(cfg.weights) if cfg.weights else default_weights_path(cfg)
    if cfg.weights and not cfg.weights_create and cfg.weights_wait_s > 0:
        wait_for_file(path, cfg.weights_wait_s)
    if not path.is_file():
        if cfg.weights and not cfg.weights_create:
            waited = f" after waiting {cfg.weights_wait_s:g} s for it" if cfg.weights_wait_s > 0 else ""
            raise WeightsError(
                f"weights file {path} does not exist{waited}; omit --weights to generate seeded weights"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        save(generate(model, cfg.seed), path, {"seed": str(cfg.seed), "preset": cfg.preset})
    load_into(model, path)
    return path


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major), wherever it lives."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


# The seeded weights' stream copies device tensors to the host through pinned buffers of this size.
CHUNK_BYTES = 16 << 20


# A CUDA census hashes on the device (kernels/census.py: one launch per parameter, one copy of the block
# words to the host): through the host, each parameter copied through pinned buffers and hashed with
# sha256 in eight threads, one census of the proxy preset took 0.36-0.54 s on an H100 (2026-12-05), two per
# reload. The block words' buffer is made at the first census of a set of parameters and kept: a later
# census (a reload's) allocates no device memory that the harness's monitor would count.
_CENSUS_WORDS: dict[tuple[object, tuple[int, ...]], torch.Tensor] = {}
_CENSUS_LOCK = threading.Lock()


def _device_checksums(tensors: list[torch.Tensor]) -> list[str]:
    """The census digest of each CUDA tensor (kernels/census.py), all on the first one's device."""
    from kernels import census

    sizes = tuple(t.numel() * t.element_size() for t in tensors)
    dev = tensors[0].device
    with _CENSUS_LOCK, torch.cuda.device(dev):
        words = _CENSUS_WORDS.get((dev, sizes))
        if words is None:
            words = torch.empty(census.words_needed(sizes), dtype=torch.int64, device=dev)
            _CENSUS_WORDS[(dev, sizes)] = words
        return census.digests(tensors, words)


@dataclass
class Snapshot:
    pointers: dict[str, int]
    checksums: dict[str, str]

    @property
    def digest(self) -> str:
        blob = "\n".join(f"{n}:{c}" for n, c in sorted(self.checksums.items())).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


# Host checksums run side by side (hashlib's sha256 releases the GIL for large buffers).
CHECKSUM_THREADS = 8


def snapshot(model: nn.Module) -> Snapshot:
    params = dict(model.named_parameters())
    workers = max(1, min(CHECKSUM_THREADS, os.cpu_count() or 1, len(params)))
    sums: dict[str, str] = {}
    cuda = [n for n, p in params.items() if p.is_cuda]
    if cuda:
        torch.cuda.synchronize()  # every write to the parameters is done before the census reads them
        for dev in {params[n].device for n in cuda}:
            names = [n for n in cuda if params[n].device == dev]
            sums.update(zip(names, _device_checksums([params[n] for n in names]), strict=True))
    host = [n for n in params if n not in sums]
    if host:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="census") as pool:
            sums.update(zip(host, pool.map(checksum, [params[n] for n in host]), strict=True))
    return Snapshot({n: p.data_ptr() for n, p in params.items()}, {n: sums[n] for n in params})


def reload(
    model: nn.Module, path: str | Path, phases: dict[str, float] | None = None
) -> tuple[Snapshot, Snapshot]:
    """In-place reload: copy the file into the same parameters, refresh derived tensors, census both sides
    (`phases`, when given, gets the seconds of each: census_before, load, census_after)."""
    t = Phases(phases)
    before = snapshot(model)
    t.mark("census_before")
    load_into(model, path)
    t.mark("load")
    after = _refreshed(model)
    t.mark("census_after")
    return before, after


class Phases:
    """Seconds between marks, into a caller's dict (none kept when it gave none)."""

    def __init__(self, into: dict[str, float] | None) -> None:
        self.into, self.t = into, time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        if self.into is not None:
            self.into[name] = round(now - self.t, 4)
        self.t = now


def reload_state(
    model: nn.Module, state: dict[str, torch.Tensor], phases: dict[str, float] | None = None
) -> tuple[Snapshot, Snapshot]:
    """`reload` from tensors in memory (weights just generated, the bytes their file will hold): every
    parameter named, of its shape and dtype, else WeightsError and nothing copied."""
    params = dict(model.named_parameters())
    if set(state) != set(params):
        raise WeightsError(f"weights do not match the model: {sorted(set(state) ^ set(params))[:5]}")
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape) or state[name].dtype != p.dtype:
            raise WeightsError(f"{name}: {tuple(state[name].shape)} {state[name].dtype}, the model wants "
                               f"{tuple(p.shape)} {p.dtype}")  # fmt: skip
    t = Phases(phases)
    before = snapshot(model)
    t.mark("census_before")
    with torch.no_grad():
        for name, p in params.items():
            p.data.copy_(state[name])
    t.mark("load")
    after = _refreshed(model)
    t.mark("census_after")
    return before, after


def _refreshed(model: nn.Module) -> Snapshot:
    refresh = getattr(model, "refresh_derived", None)
    if refresh is not None:
        refresh()
    return snapshot(model)
