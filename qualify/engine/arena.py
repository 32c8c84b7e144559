"""Fixed-address metadata buffers: allocated once for the capture envelope, staged by prefix, never grown.

A captured CUDA graph reads these addresses forever, so a batch that does not fit raises `CapacityError`
(naming the buffer, its capacity and the demand) instead of reallocating.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qualify.protocol import CAPACITY_ERROR


class CapacityError(Exception):
    """A batch does not fit a fixed-capacity buffer; nothing was written or moved."""

    type_name = CAPACITY_ERROR

    def __init__(self, buffer: str, capacity: int, demand: int, unit: str = "entries", hint: str = ""):
        self.buffer, self.capacity, self.demand = buffer, capacity, demand
        msg = f"{buffer} holds {capacity} {unit} but the batch needs {demand}"
        super().__init__(
            msg + (f"; {hint}" if hint else "; send a smaller batch or raise the engine's limits")
        )


@dataclass
class ArenaBuffer:
    name: str
    shape: tuple[int, ...]  # declared shape; storage is flat and staged by prefix
    device: torch.Tensor  # flat, fixed address
    host: torch.Tensor  # pinned mirror on CUDA, the buffer itself on CPU
    done: torch.cuda.Event | None  # last host->device copy from the mirror

    @property
    def capacity(self) -> int:
        return self.device.numel()


class Arena:
    """Named flat buffers: `stage` writes a prefix and fills the rest; `view` reads a prefix as a shape."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, ArenaBuffer] = {}

    def add(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.int32, fill: int = 0) -> None:
        if name in self.buffers:
            raise ValueError(f"arena buffer {name!r} already exists")
        n = math.prod(shape)
        dev = torch.full((n,), fill, dtype=dtype, device=self.device)
        if self.device.type == "cuda":
            host = torch.full((n,), fill, dtype=dtype).pin_memory()
            done = torch.cuda.Event()
        else:
            host, done = dev, None
        self.buffers[name] = ArenaBuffer(name, tuple(shape), dev, host, done)

    def stage(self, name: str, values: torch.Tensor | Sequence, fill: int | float = 0) -> int:
        """Write `values` (flattened) into the prefix of `name` and `fill` into the rest; return the count.

        Raises CapacityError before writing anything when the values do not fit.
        """
        buf = self.buffers[name]
        vals = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=buf.device.dtype)
        vals = vals.reshape(-1)
        n = vals.numel()
        if n > buf.capacity:
            raise CapacityError(f"arena buffer {name!r}", buf.capacity, n)
        if buf.done is not None:
            buf.done.synchronize()  # the previous copy from this mirror must have left before we overwrite it
        buf.host[:n].copy_(vals)
        buf.host[n:].fill_(fill)
        if buf.done is not None:
            buf.device.copy_(buf.host, non_blocking=True)
            buf.done.record()
        return n

    def view(self, name: str, *shape: int) -> torch.Tensor:
        """The prefix of `name` holding `prod(shape)` entries, as `shape` (a fixed-address view)."""
        buf = self.buffers[name]
        n = math.prod(shape)
        if n > buf.capacity:
            raise CapacityError(f"arena buffer {name!r}", buf.capacity, n)
        return buf.device[:n].view(*shape)

    def check_fits(self, name: str, demand: int, unit: str = "entries", hint: str = "") -> None:
        cap = self.buffers[name].capacity
        if demand > cap:
            raise CapacityError(f"arena buffer {name!r}", cap, demand, unit, hint)

    def addresses(self) -> dict[str, int]:
        return {name: b.device.data_ptr() for name, b in self.buffers.items()}

    def describe(self) -> dict[str, dict]:
        return {
            name: {
                "address": b.device.data_ptr(),
                "capacity": b.capacity,
                "shape": list(b.shape),
                "dtype": str(b.device.dtype).removeprefix("torch."),
            }
            for name, b in self.buffers.items()
        }


def build_arena(cfg, device: torch.device, chunk_size: int = 64) -> Arena:
    """The engine's arena, sized for the capture envelope and live capacity together."""
    rows = cfg.plan_rows  # per-request rows: max(live capacity, largest captured batch)
    tpr = cfg.tokens_per_request
    tokens = max(cfg.max_num_batched_tokens, rows * tpr)
    max_chunks = -(-cfg.max_num_batched_tokens // chunk_size) + cfg.max_num_seqs
    a = Arena(device)
    a.add("input_ids", (tokens,))
    a.add("positions", (tokens,))
    a.add("query_start_loc", (rows + 1,))
    a.add("seq_lens", (rows,))
    a.add("state_slots", (rows, tpr))
    a.add("num_accepted", (rows,), fill=1)
    a.add("num_live", (1,))
    a.add("block_tables", (rows, cfg.max_blocks_per_seq))
    a.add("prefill_slots", (cfg.max_num_seqs,))
    a.add("has_initial_state", (cfg.max_num_seqs,))
    a.add("chunk_indices", (max_chunks, 2))
    a.add("chunk_offsets", (cfg.max_num_seqs + 1,))
    a.add("num_chunks", (1,))
    a.add("selector_rows", (tokens, cfg.selector_topk), fill=-1)
    return a
