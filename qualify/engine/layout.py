"""The registered KV layout: groups of layers, spans, transfer chunk and ratios, one allocation per group,
per-layer views carved from it, and handles that let a peer process import it (CUDA IPC or shared memory).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import uuid
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

# The files, their flock and the sweep live in qualify.shm, which the harness (no torch) shares.
from qualify.protocol import KV_ALIGNMENT, KV_PROBE_BYTES
from qualify.shm import SHM_PREFIX, shm_dir, sweep_stale_shm  # noqa: F401

ALIGNMENT = KV_ALIGNMENT  # every carved view starts on this many bytes
PROBE_BYTES = KV_PROBE_BYTES  # a page at the end of each allocation: engine-written half, peer-written half


class LayoutError(ValueError):
    """A view or handle that does not fit its allocation."""


@dataclass(frozen=True)
class KvGroup:
    name: str
    kind: str  # "kda" | "attention"
    layers: tuple[int, ...]
    span: int  # tokens one block of this group covers


@dataclass(frozen=True)
class LayoutSpec:
    groups: tuple[KvGroup, ...]

    @property
    def spans(self) -> list[int]:
        return [g.span for g in self.groups]

    @property
    def chunk(self) -> int:
        """The transfer chunk: the smallest token count every group's blocks tile exactly."""
        return math.lcm(*self.spans)

    @property
    def ratios(self) -> list[int]:
        return [self.chunk // s for s in self.spans]


def group_span(kind: str, block_size: int, dcp_size: int) -> int:
    """Tokens one block of a group covers: `block_size` for KDA, `block_size * dcp_size` for attention,
    because each of the DCP shards holds an interleaved `block_size` of every attention block. The one
    place this number is computed (config, attention geometry and the registered layout all ask here)."""
    if kind == "kda":
        return block_size
    if kind == "attention":
        return block_size * dcp_size
    raise LayoutError(f"unknown group kind {kind!r}; expected 'kda' or 'attention'")


def plan_layout(layer_pattern: str, group_size: int, block_size: int, dcp_size: int) -> LayoutSpec:
    """Group layers of one kind in layer order; KDA groups first, then attention groups (registration order).

    Span per group: `group_span`.
    """
    groups: list[KvGroup] = []
    for kind, letter in (("kda", "K"), ("attention", "A")):
        span = group_span(kind, block_size, dcp_size)
        layers = [i for i, c in enumerate(layer_pattern) if c == letter]
        if len(layers) % group_size:
            raise LayoutError(f"{len(layers)} {kind} layers do not split into groups of {group_size}")
        for j in range(0, len(layers), group_size):
            groups.append(KvGroup(f"{kind}{j // group_size}", kind, tuple(layers[j : j + group_size]), span))
    return LayoutSpec(tuple(groups))


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def carve(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A typed view of `shape` at byte `offset` of a uint8 allocation; refuses anything outside it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    size = buffer.numel()
    if offset < 0 or offset % ALIGNMENT or offset + nbytes > size:
        raise LayoutError(
            f"view of {nbytes} bytes at offset {offset} falls outside the {size}-byte allocation "
            f"(or is not {ALIGNMENT}-byte aligned); views must lie inside their group's allocation"
        )
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


@dataclass
class ViewSpec:
    layer: int
    name: str  # "state" | "conv" | "k" | "v"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0


@dataclass
class GroupAllocation:
    """One device allocation holding every per-layer cache of a group, plus its export handle."""

    group: KvGroup
    buffer: torch.Tensor  # uint8 [nbytes]
    views: dict[tuple[int, str], torch.Tensor]
    probe_offset: int
    handle: dict
    _keepalive: list = field(default_factory=list, repr=False)
    # CPU: removes the shm file and drops its lock on release, garbage collection or interpreter exit.
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def record(self) -> dict:
        """What the engine registers for this allocation: group, layers, span, size, alignment, handle."""
        return {
            "name": self.group.name,
            "kind": self.group.kind,
            "layers": list(self.group.layers),
            "span": self.group.span,
            "nbytes": self.nbytes,
            "alignment": ALIGNMENT,
            "handle_kind": self.handle["kind"],
        }


def group_view_specs(group: KvGroup, cfg) -> list[ViewSpec]:
    """Per-layer caches of a group. KDA: fp32 state pool [slots, H, V, K] and conv state
    [slots, conv_dim, width-1]; attention: K and V [blocks, local shards, block_size, kv_heads, head_dim]
    (local shards: dcp folded, 1 on each rank of a distributed DCP)."""
    s = cfg.shape
    dtype = getattr(torch, cfg.dtype)
    specs: list[ViewSpec] = []
    for layer in group.layers:
        if group.kind == "kda":
            conv_dim = s.kda_heads * s.kda_head_dim * 3
            specs.append(
                ViewSpec(
                    layer,
                    "state",
                    (cfg.num_state_slots, s.kda_heads, s.kda_head_dim, s.kda_head_dim),
                    torch.float32,
                )
            )
            specs.append(ViewSpec(layer, "conv", (cfg.num_state_slots, conv_dim, s.conv_width - 1), dtype))
        else:
            kv = (cfg.num_kv_blocks, cfg.dcp_local_shards, cfg.block_size, s.attn_kv_heads, s.attn_head_dim)
            specs.append(ViewSpec(layer, "k", kv, dtype))
            specs.append(ViewSpec(layer, "v", kv, dtype))
    return specs


def _shm_dir() -> str:
    return shm_dir()


def _unlink_and_close(path: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def _shm_buffer(nbytes: int) -> tuple[torch.Tensor, dict, list, int]:
    """A file-backed shared mapping (POSIX shm on Linux) the peer maps by path, locked by this process.

    The file is created under a hidden name, locked, sized, and only then renamed to its public name, so a
    sweeping engine never sees it unlocked."""
    base = _shm_dir()
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp = os.path.join(base, f".{SHM_PREFIX}{token}.tmp")
    path = os.path.join(base, f"{SHM_PREFIX}{token}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        os.rename(tmp, path)
    except BaseException:
        _unlink_and_close(tmp, fd)
        raise
    mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
    buf = torch.from_numpy(mm)
    return buf, {"kind": "shm", "path": path, "nbytes": nbytes}, [mm], fd


def _cuda_handle(buf: torch.Tensor) -> dict:
    dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = buf.untyped_storage()._share_cuda_()
    props = torch.cuda.get_device_properties(buf.device)
    return {
        "kind": "cuda-ipc",
        "nbytes": buf.numel(),
        "device_index": dev,
        "device_uuid": str(getattr(props, "uuid", "")),
        "handle": handle.hex(),
        "storage_size_bytes": size,
        "storage_offset_bytes": offset,
        "ref_counter_handle": rc_handle.hex(),
        "ref_counter_offset": rc_offset,
        "event_handle": ev_handle.hex() if ev_handle else None,
        "event_sync_required": bool(ev_sync),
    }


def allocate_group(group: KvGroup, cfg, device: torch.device) -> GroupAllocation:
    specs = group_view_specs(group, cfg)
    offset = 0
    for spec in specs:
        spec.offset = offset
        offset = _align(offset + math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size())
    probe_offset = offset
    nbytes = _align(probe_offset + PROBE_BYTES)
    keep: list = []
    fd = None
    if device.type == "cuda":
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        handle = _cuda_handle(buf)
    else:
        sweep_stale_shm()  # files of engines that died without cleaning up (SIGKILL, crash, OOM kill)
        buf, handle, keep, fd = _shm_buffer(nbytes)
    views = {(s.layer, s.name): carve(buf, s.offset, s.shape, s.dtype) for s in specs}
    alloc = GroupAllocation(group, buf, views, probe_offset, handle, keep)
    if fd is not None:
        alloc._finalizer = weakref.finalize(alloc, _unlink_and_close, handle["path"], fd)
    return alloc


def release_group(alloc: GroupAllocation) -> None:
    """Remove the shared-memory file behind a CPU allocation and drop its lock (the mapping stays valid
    until dropped). Idempotent."""
    if alloc._finalizer is not None:
        alloc._finalizer()
