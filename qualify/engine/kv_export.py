"""The engine's side of the KV-transfer peer protocol: export each group allocation's handle and views
(never its span), fill a probe region with a nonce pattern, and hash a region as the engine reads it."""

from __future__ import annotations

import hashlib

import torch

from qualify.protocol import KV_ECHO_MAX_BYTES, pattern_bytes

from .layout import ALIGNMENT, PROBE_BYTES, GroupAllocation, LayoutError


def _device(buf: torch.Tensor) -> dict:
    if buf.device.type == "cuda":
        props = torch.cuda.get_device_properties(buf.device)
        return {"type": "cuda", "index": buf.device.index, "uuid": str(getattr(props, "uuid", ""))}
    return {"type": "cpu"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _views(a: GroupAllocation) -> list[dict]:
    base = a.buffer.data_ptr()
    return [
        {
            "layer": layer,
            "name": name,
            "offset": v.data_ptr() - base,
            "shape": list(v.shape),
            "dtype": _dtype_name(v.dtype),
        }
        for (layer, name), v in a.views.items()
    ]


def kv_handles(engine) -> dict:
    """GET /qualify/kv-handles: what a peer imports; spans are left for the peer to derive."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {
        "groups": [
            {
                "name": a.group.name,
                "kind": a.group.kind,
                "layers": list(a.group.layers),
                "nbytes": a.nbytes,
                "alignment": ALIGNMENT,
                "device": _device(a.buffer),
                "handle": a.handle,
                "probe": {"offset": a.probe_offset, "nbytes": PROBE_BYTES},
                "views": _views(a),
            }
            for a in engine.allocations
        ]
    }


def _group(engine, name: str) -> GroupAllocation:
    for a in engine.allocations:
        if a.group.name == name:
            return a
    raise LayoutError(
        f"no KV group named {name!r}; the engine has {[a.group.name for a in engine.allocations]}"
    )


def _sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _read(a: GroupAllocation, offset: int, length: int) -> bytes:
    if a.buffer.device.type == "cuda":
        torch.cuda.synchronize(a.buffer.device)
    return a.buffer[offset : offset + length].cpu().numpy().tobytes()


def kv_echo(engine, group: str, offset: int, length: int) -> dict:
    """POST /qualify/kv-echo: sha256 of `length` bytes at `offset` of a group's allocation as the engine
    reads them; a range outside the allocation is refused."""
    a = _group(engine, group)
    if length < 1 or length > KV_ECHO_MAX_BYTES or offset < 0 or offset + length > a.nbytes:
        raise LayoutError(
            f"echo of {length} bytes at offset {offset} falls outside the {a.nbytes}-byte allocation of "
            f"{group} (or exceeds {KV_ECHO_MAX_BYTES} bytes)"
        )
    return {"group": group, "offset": offset, "length": length, "sha256": _sha(_read(a, offset, length))}


def kv_fill(engine, group: str, offset: int, length: int, nonce: str) -> dict:
    """POST /qualify/kv-fill: write pattern_bytes(nonce, length) into the group's probe page (only there,
    so the caches are never touched) and hash what is then in memory."""
    a = _group(engine, group)
    lo, hi = a.probe_offset, a.probe_offset + PROBE_BYTES
    if length < 1 or offset < lo or offset + length > hi:
        raise LayoutError(
            f"fill of {length} bytes at offset {offset} falls outside the probe page [{lo}, {hi}) of {group}"
        )
    raw = torch.frombuffer(bytearray(pattern_bytes(nonce, length)), dtype=torch.uint8)
    a.buffer[offset : offset + length].copy_(raw.to(a.buffer.device))
    return {"group": group, "offset": offset, "length": length, "sha256": _sha(_read(a, offset, length))}
