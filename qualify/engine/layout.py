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
from qualify.shm import SHM_PREFIX, shm_dir, sweep_stale_shm  # noqa: F401

ALIGNMENT = 256  # every carved view starts on this many bytes
PROBE_BYTES = 4096  # a page at the end of each allocation for peer verification (pattern + ack halves)


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
    [slots, conv_dim, width-1]; attention: K and V [blocks, dcp, block_size, kv_heads, head_dim]."""
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
            kv = (cfg.num_kv_blocks, cfg.dcp_size, cfg.block_size, s.attn_kv_heads, s.attn_head_dim)
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


def allocation_extent(handle: dict, keep: list) -> int:
    """Bytes the imported allocation really has (the file's size, the IPC storage's size), measured on the
    peer side rather than echoed from the handle, so a short or oversized allocation is caught."""
    if handle["kind"] == "shm":
        return os.stat(handle["path"]).st_size
    return keep[0].nbytes() - handle["storage_offset_bytes"]


def import_allocation(handle: dict) -> tuple[torch.Tensor, list]:
    """The peer side: map an exported allocation as a uint8 tensor (and objects to keep alive)."""
    if handle["kind"] == "shm":
        size = os.stat(handle["path"]).st_size
        if size < handle["nbytes"]:
            raise LayoutError(
                f"shared-memory file {handle['path']} holds {size} bytes but the handle claims "
                f"{handle['nbytes']}; the engine's allocation is not what it registered"
            )
        mm = np.memmap(handle["path"], dtype=np.uint8, mode="r+", shape=(handle["nbytes"],))
        return torch.from_numpy(mm), [mm]
    if handle["kind"] == "cuda-ipc":
        torch.cuda._lazy_init()
        dev = handle["device_index"]
        ev = handle["event_handle"]
        storage = torch.UntypedStorage._new_shared_cuda(
            dev,
            bytes.fromhex(handle["handle"]),
            handle["storage_size_bytes"],
            handle["storage_offset_bytes"],
            bytes.fromhex(handle["ref_counter_handle"]),
            handle["ref_counter_offset"],
            bytes.fromhex(ev) if ev else b"",
            handle["event_sync_required"],
        )
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage, 0, (handle["nbytes"],))
        return t, [storage]
    raise LayoutError(f"unknown handle kind {handle['kind']!r}; expected 'shm' or 'cuda-ipc'")


def release_group(alloc: GroupAllocation) -> None:
    """Remove the shared-memory file behind a CPU allocation and drop its lock (the mapping stays valid
    until dropped). Idempotent."""
    if alloc._finalizer is not None:
        alloc._finalizer()
