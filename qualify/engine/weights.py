"""Weights: seeded random generation (saved once as safetensors under the data dir, reused next boot),
loading into the existing parameters only (`copy_`), and in-place reload with a census of addresses and
checksums before and after (captured graphs keep reading the same parameter storage).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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


def _init_value(name: str, p: torch.Tensor, gen: torch.Generator, num_layers: int) -> torch.Tensor:
    """Scaled init so hidden states stay O(1) through the stack and greedy text is stable."""
    dev = p.device
    if name.endswith("norm.weight") or name.endswith("norm_weight"):
        return torch.ones(p.shape, device=dev)
    if name.endswith("A_log"):
        return torch.empty(p.shape, device=dev).uniform_(0.0, math.log(16.0), generator=gen)
    if name.endswith("dt_bias"):
        return torch.empty(p.shape, device=dev).uniform_(-2.0, 0.0, generator=gen)
    if name.endswith("conv_weight"):
        return torch.randn(p.shape, device=dev, generator=gen) / math.sqrt(p.shape[-1])
    if name == "embed.weight":
        return torch.randn(p.shape, device=dev, generator=gen)
    std = 1.0 / math.sqrt(p.shape[-1])
    if name == "lm_head.weight":
        std *= 4.0  # wider logits: fewer near ties between the top two tokens, so greedy text is stable
    if any(k in name for k in ("out_proj", "o_proj", "down")):
        std /= math.sqrt(2.0 * num_layers)  # residual branches: keep the residual stream's growth bounded
    return torch.randn(p.shape, device=dev, generator=gen) * std


def generate(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh weights for every parameter of `model` (on the model's device, in each parameter's dtype)."""
    num_layers = len(getattr(model, "layers", [])) or 1
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
        out[name] = _init_value(name, p, gen, num_layers).to(p.dtype)
    return out


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


def load_into(model: nn.Module, path: str | Path) -> None:
    """Copy a safetensors file into the existing parameters (`param.data.copy_`), all or nothing."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; pass an existing .safetensors file")
    params = dict(model.named_parameters())
    dev = next(iter(params.values())).device
    try:
        handle = safe_open(str(path), framework="pt", device=str(dev))
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


def ensure_weights(model: nn.Module, cfg) -> Path:
    """Load the configured weights; generate and save them first if this is the first boot."""
    path = Path(cfg.weights) if cfg.weights else default_weights_path(cfg)
    if not path.is_file():
        if cfg.weights and not cfg.weights_create:
            raise WeightsError(
                f"weights file {path} does not exist; omit --weights to generate seeded weights"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        save(generate(model, cfg.seed), path, {"seed": str(cfg.seed), "preset": cfg.preset})
    load_into(model, path)
    return path


def checksum(t: torch.Tensor) -> str:
    data = t.detach().contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


@dataclass
class Snapshot:
    pointers: dict[str, int]
    checksums: dict[str, str]

    @property
    def digest(self) -> str:
        blob = "\n".join(f"{n}:{c}" for n, c in sorted(self.checksums.items())).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


# Checksums run side by side: the copy to the host and hashlib's sha256 both release the GIL, and a
# single thread hashed the proxy preset's 2.9 GB in several seconds, twice per reload.
CHECKSUM_THREADS = 8


def snapshot(model: nn.Module) -> Snapshot:
    params = dict(model.named_parameters())
    workers = max(1, min(CHECKSUM_THREADS, os.cpu_count() or 1, len(params)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="census") as pool:
        sums = dict(zip(params, pool.map(checksum, params.values()), strict=True))
    return Snapshot({n: p.data_ptr() for n, p in params.items()}, sums)


def reload(model: nn.Module, path: str | Path) -> tuple[Snapshot, Snapshot]:
    """In-place reload: copy the file into the same parameters, refresh derived tensors, census both sides."""
    before = snapshot(model)
    load_into(model, path)
    refresh = getattr(model, "refresh_derived", None)
    if refresh is not None:
        refresh()
    return before, snapshot(model)
