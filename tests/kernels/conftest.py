"""Kernel-test fixtures: one decode-step input factory (the root conftest makes Triton interpret
without a GPU)."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def decode_step(
    n: int,
    T: int,
    *,
    H: int = 2,
    K: int = 16,
    V: int = 32,
    slots: int | None = None,
    seed: int = 0,
    device: str = DEVICE,
) -> dict[str, torch.Tensor]:
    """Random inputs for one decode/verify step; request r owns slots 1 + r*T ... (slot 0 = null)."""
    g = torch.Generator().manual_seed(seed)
    rows = n * T
    slots = slots or rows + 3

    def rnd(*shape: int, s: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(dtype).to(device)

    return {
        "q": rnd(rows, H, K),
        "k": rnd(rows, H, K),
        "v": rnd(rows, H, V),
        "a": rnd(rows, H, K),
        "b": rnd(rows, H),
        "A_log": rnd(H, s=0.5, dtype=torch.float32),
        "dt_bias": rnd(H * K, s=0.5, dtype=torch.float32),
        "z": rnd(rows, H, V),
        "norm_weight": rnd(V, s=0.1, dtype=torch.float32) + 1,
        "state": rnd(slots, H, V, K, s=0.1, dtype=torch.float32),
        "state_indices": torch.arange(1, rows + 1, dtype=torch.int32).view(n, T).to(device),
        "num_accepted": torch.ones(n, dtype=torch.int32).to(device),
        "num_live": torch.tensor([n], dtype=torch.int32).to(device),
        "out": torch.full((rows, H, V), 3.0, dtype=torch.bfloat16).to(device),
    }


@pytest.fixture
def step():
    return decode_step
