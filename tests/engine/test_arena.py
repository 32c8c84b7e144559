"""Fixed-address arena: prefix staging, fills, and overflow refused without moving anything."""

from __future__ import annotations

import pytest
import torch

from qualify.engine.arena import Arena, CapacityError, build_arena
from qualify.engine.config import EngineConfig


def test_stage_writes_a_prefix_and_fills_the_rest():
    a = Arena(torch.device("cpu"))
    a.add("x", (6,), fill=9)
    a.stage("x", [1, 2, 3], fill=-1)
    assert a.buffers["x"].device.tolist() == [1, 2, 3, -1, -1, -1]
    assert a.view("x", 3).tolist() == [1, 2, 3]


def test_overflow_is_refused_without_moving_addresses_or_data():
    a = build_arena(EngineConfig(device="cpu"), torch.device("cpu"))
    before = a.addresses()
    a.stage("seq_lens", [5, 6])
    with pytest.raises(CapacityError) as exc:
        a.stage("seq_lens", list(range(100)))
    msg = str(exc.value)
    assert "seq_lens" in msg and "holds 8" in msg and "needs 100" in msg
    assert a.addresses() == before
    assert a.view("seq_lens", 2).tolist() == [5, 6]  # nothing was written


def test_state_slots_are_sized_for_one_plus_num_spec_columns():
    cfg = EngineConfig(device="cpu", num_spec=2, max_num_seqs=4, max_num_batched_tokens=64)
    a = build_arena(cfg, torch.device("cpu"))
    assert a.buffers["state_slots"].shape == (4, 3)
    assert a.view("state_slots", 4, 3).shape == (4, 3)


def test_engine_refuses_a_batch_beyond_live_capacity_and_keeps_addresses(tiny_engine):
    before = tiny_engine.arena.addresses()
    n = tiny_engine.cfg.max_num_seqs + 1
    with pytest.raises(CapacityError) as exc:
        tiny_engine.generate([[256, 65]] * n, 2)
    assert "live state slots" in str(exc.value) and f"needs {n}" in str(exc.value)
    assert tiny_engine.arena.addresses() == before
    assert len(tiny_engine.runner.pool.groups) == tiny_engine.cfg.max_num_seqs  # nothing leaked
