"""Per-step views handed to every layer: fixed-address arena prefixes for decode, host lists for prefill."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class DecodeContext:
    """n request rows (live + padding) of T tokens each; every tensor is a view of a fixed-address buffer."""

    n: int
    T: int
    positions: Tensor  # [n*T]
    state_slots: Tensor  # [n, T] int32; padding rows hold the null slot 0
    num_accepted: Tensor  # [n] int32
    num_live: Tensor  # [1] int32 device scalar
    seq_lens: Tensor  # [n] context length including this step's tokens; 0 for padding
    block_tables: Tensor  # [n, max_blocks]; padding rows point at the null block 0
    selector_rows: Tensor  # [n*T, topk] written by the selector


@dataclass
class PrefillContext:
    """N whole prompts packed varlen (eager only: host lists are allowed here)."""

    positions: Tensor  # [total]
    bounds: list[tuple[int, int]]
    cu_seqlens: Tensor  # [N+1] int32
    slots: Tensor  # [N] int32: the state slot each prompt's final state goes to
    slots_host: list[int]
    has_initial_state: Tensor  # [N] int32
    chunk_indices: Tensor
    chunk_offsets: Tensor
    num_chunks: int
    seq_lens: Tensor  # [N]
    seq_lens_q: Tensor  # [N] tokens of each prompt in this step (== seq_lens: no prefix cache)
    block_tables: Tensor  # [N, max_blocks]
    selector_rows: Tensor  # [total, topk]
