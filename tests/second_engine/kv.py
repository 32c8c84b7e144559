"""The second engine's KV group allocations: one shared-memory file per group (docs/LAYOUT.md), laid out as
docs/PEER.md says, held with a shared flock while the engine lives (so the harness's sweep leaves it alone),
removed when the engine stops. Its caches are views of these files: the peer sees the memory it computes with.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import uuid

import numpy as np
import torch

SHM_PREFIX = "qualify-kv-lk-"  # the protocol's prefix: the harness sweeps unlocked files of this name
ALIGNMENT, PROBE_BYTES, ECHO_MAX = 256, 4096, 1 << 20
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def layout(pattern: str, group_size: int, geo: dict, cap: dict, dims: dict) -> list[dict]:
    """This engine's own reading of the layout rules: groups of one kind in layer order, KDA first; per
    KDA layer state [slots, H, V, K] fp32 and conv [slots, 3HK, W-1]; per attention layer K and V
    [blocks, shards, block_size, kv_heads, head_dim]; 256-byte aligned views, then a 4096-byte probe page."""
    slots = 1 + cap["max_num_seqs"] * (1 + cap["num_spec"])
    span_a = geo["block_size"] * geo["dcp_size"]
    blocks = 1 + cap["max_num_seqs"] * -(-cap["max_model_len"] // span_a)
    shards = geo["dcp_size"] if geo["dcp_ranks"] == 1 else 1
    dt = geo["kv_dtype"]
    H, K, W = dims["kda_heads"], dims["kda_head_dim"], dims["conv_width"]
    out = []
    for kind, letter in (("kda", "K"), ("attention", "A")):
        layers = [i for i, c in enumerate(pattern) if c == letter]
        for j in range(0, len(layers), group_size):
            views, off = [], 0
            for layer in layers[j : j + group_size]:
                if kind == "kda":
                    parts = [("state", [slots, H, K, K], "float32"), ("conv", [slots, 3 * H * K, W - 1], dt)]
                else:
                    kv = [blocks, shards, geo["block_size"], dims["attn_kv_heads"], dims["attn_head_dim"]]
                    parts = [("k", kv, dt), ("v", kv, dt)]
                for name, shape, dtype in parts:
                    views.append(
                        {"layer": layer, "name": name, "offset": off, "shape": shape, "dtype": dtype}
                    )
                    off = _align(off + math.prod(shape) * ITEMSIZE[dtype])
            out.append({
                "name": f"{kind}{j // group_size}", "kind": kind, "layers": layers[j : j + group_size],
                "span": geo["block_size"] if kind == "kda" else span_a, "nbytes": _align(off + PROBE_BYTES),
                "probe": {"offset": off, "nbytes": PROBE_BYTES}, "views": views,
            })  # fmt: skip
    return out


class Group:
    """One allocation: a file in /dev/shm mapped for the engine's life, its bytes as a uint8 tensor."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.path = os.path.join(
            base, f"{SHM_PREFIX}second-{os.getpid()}-{uuid.uuid4().hex[:8]}-{spec['name']}"
        )
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # held for life: a file nobody locks is a dead engine's
        os.ftruncate(self.fd, spec["nbytes"])
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(spec["nbytes"],))
        self.bytes = torch.from_numpy(self.map)

    def view(self, v: dict) -> torch.Tensor:
        n = math.prod(v["shape"]) * ITEMSIZE[v["dtype"]]
        return self.bytes[v["offset"] : v["offset"] + n].view(TORCH[v["dtype"]]).view(v["shape"])

    def handle(self) -> dict:
        s = self.spec
        return {
            "name": s["name"], "kind": s["kind"], "layers": s["layers"], "nbytes": s["nbytes"],
            "alignment": ALIGNMENT, "device": {"type": "cpu"},
            "handle": {"kind": "shm", "path": self.path, "nbytes": s["nbytes"]},
            "probe": s["probe"], "views": s["views"],
        }  # fmt: skip

    def fill(self, offset: int, length: int, nonce: str) -> str:
        lo = self.spec["probe"]["offset"]
        if not (lo <= offset and offset + length <= lo + PROBE_BYTES):
            raise ValueError(
                f"kv-fill writes only inside {self.spec['name']}'s probe page [{lo}, {lo + PROBE_BYTES})"
            )
        raw, i = bytearray(), 0
        while len(raw) < length:
            raw += hashlib.sha256(f"{nonce}:{i}".encode()).digest()
            i += 1
        self.map[offset : offset + length] = np.frombuffer(bytes(raw[:length]), dtype=np.uint8)
        self.map.flush()
        return self.echo(offset, length)

    def echo(self, offset: int, length: int) -> str:
        if length > ECHO_MAX or offset + length > self.spec["nbytes"]:
            raise ValueError(
                f"{offset}+{length} lies outside {self.spec['name']} ({self.spec['nbytes']} bytes)"
            )
        return "sha256:" + hashlib.sha256(self.map[offset : offset + length].tobytes()).hexdigest()

    def close(self) -> None:
        """Remove the file and drop the lock; the mapping goes with the process."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
