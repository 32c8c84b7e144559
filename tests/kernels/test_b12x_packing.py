"""The b12x adapter's zero-copy rule: when q, k, v already are one packed `mixed_qkv` row (view logic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.kda.b12x import packed_qkv_view

H, K, V = 2, 4, 4
HK, WIDTH = H * K, 2 * H * K + H * V


def workspace(rows: int, start: int = 0, capacity: int = 6) -> tuple[torch.Tensor, ...]:
    """q, k, v as the engine binds them: views into one [capacity, 3HK] workspace, rows start..start+rows."""
    ws = torch.arange(capacity * WIDTH, dtype=torch.float32).view(capacity, WIDTH).bfloat16()
    sl = ws[start : start + rows]
    return sl[:, :HK].view(rows, H, K), sl[:, HK : 2 * HK].view(rows, H, K), sl[:, 2 * HK :].view(rows, H, V)


def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)


@pytest.mark.parametrize("rows,start", [(1, 0), (1, 3), (4, 0), (4, 2)])
def test_workspace_views_are_one_packed_row_at_batch_one_and_above(rows, start):
    q, k, v = workspace(rows, start)
    view = packed_qkv_view(q, k, v)
    assert view is not None
    assert view.shape == (rows, WIDTH) and view.stride() == (WIDTH, 1)
    assert view.data_ptr() == q.data_ptr()  # zero copy
    assert torch.equal(view, expected(q, k, v))


def test_separately_allocated_neighbours_are_not_one_packed_row():
    # Three allocations that sit back to back (as the CUDA caching allocator places same-size blocks):
    # the addresses line up, but a view across them is out of bounds for torch and not ours to keep.
    buf = np.zeros(3 * HK, dtype=np.int16)
    q, k, v = (
        torch.from_numpy(buf[i * HK : (i + 1) * HK]).view(torch.bfloat16).view(1, H, K) for i in range(3)
    )
    assert k.data_ptr() == q.data_ptr() + 2 * HK and v.data_ptr() == k.data_ptr() + 2 * HK
    assert packed_qkv_view(q, k, v) is None


def test_stacked_q_k_v_are_a_packed_row_only_when_there_is_one_row():
    # [3, rows, H, K]: at rows == 1 q, k, v are consecutive in one storage (a genuine packed row); at rows > 1
    # the next row of q is k's first row, so they are not.
    one = torch.randn(3, 1, H, K).bfloat16()
    view = packed_qkv_view(one[0], one[1], one[2])
    assert view is not None and torch.equal(view, expected(one[0], one[1], one[2]))
    two = torch.randn(3, 2, H, K).bfloat16()
    assert packed_qkv_view(two[0], two[1], two[2]) is None


def test_out_of_order_mixed_storages_and_non_contiguous_heads_are_refused():
    q, k, v = workspace(3)
    assert packed_qkv_view(k, q, v) is None  # k before q
    q2, _, _ = workspace(3)
    assert packed_qkv_view(q2, k, v) is None  # q from another workspace
    ws = torch.zeros(3, 2 * WIDTH).bfloat16()  # heads of v not contiguous within the row
    q3, k3 = ws[:, :HK].view(3, H, K), ws[:, HK : 2 * HK].view(3, H, K)
    v3 = ws[:, 2 * HK : 2 * HK + 2 * H * V].view(3, H, 2 * V)[:, :, :V]
    assert packed_qkv_view(q3, k3, v3) is None


def test_a_packed_row_must_fit_inside_its_storage():
    # q and k are adjacent slices of one storage, but v (and so the packed row) would run past its end.
    ws = torch.zeros(1, 2 * HK + H * V - 1).bfloat16()
    q, k = ws[:, :HK].view(1, H, K), ws[:, HK : 2 * HK].view(1, H, K)
    v = torch.zeros(1, H, V).bfloat16()
    assert packed_qkv_view(q, k, v) is None
