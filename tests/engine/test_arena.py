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


def _contents(arena) -> dict[str, list]:
    return {name: b.device.tolist() for name, b in arena.buffers.items()}


def test_stage_decode_refuses_rows_beyond_the_envelope_before_staging_anything(_engine_home):
    from tests.engine.conftest import make_engine

    # 2 rows of 2 columns: a flat count (3 rows x 1 token = 3 <= 4 entries) must not let 3 rows through.
    e = make_engine(num_spec=1, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64)
    try:
        r = e.runner
        req = r.admit([256, 65, 66], 2)
        r.stage_decode([req], 2, 1)
        before, addresses = _contents(e.arena), e.arena.addresses()
        with pytest.raises(CapacityError) as exc:
            r.stage_decode([req], 3, 1)
        assert "'state_slots' holds 2 request rows but the batch needs 3" in str(exc.value)
        with pytest.raises(CapacityError, match="holds 2 tokens per request but the batch needs 3"):
            r.stage_decode([req], 1, 3, [[1, 2, 3]])
        assert _contents(e.arena) == before and e.arena.addresses() == addresses
        r.release(req)
    finally:
        e.close()


def test_a_capture_plan_beyond_live_capacity_fits_the_arena_and_runs_at_its_largest_shape(_engine_home):
    from qualify.engine.graphs import GraphRunner
    from tests.engine.conftest import make_engine

    # Graph-plan capacity 6 requests x 2 tokens = 12 > max_num_seqs * (1 + num_spec) = 4.
    e = make_engine(num_spec=1, max_num_seqs=2, capture_sizes=[2, 12], max_model_len=64)
    try:
        assert e.cfg.graph_max_batch == 6 and e.cfg.num_state_slots == 1 + 2 * 2  # live slots stay 2
        assert e.arena.buffers["state_slots"].shape == (6, 2)
        r = e.runner
        req = r.admit([256, 65, 66], 4)
        toks, gaps = r.pick(r.prefill([req]))
        r._append(req, toks[0], gaps[0])
        addresses = e.arena.addresses()
        plans = GraphRunner(e).plans()
        assert plans[0] == (6, 2) and (6, 1) in plans
        for n_pad, T in plans:
            r.stage_decode([req], n_pad, T, [[req.output[-1]] * T])
            logits = r.forward_decode_static(n_pad, T)
            assert logits.shape == (n_pad * T, e.cfg.shape.vocab) and torch.isfinite(logits).all()
        assert e.arena.addresses() == addresses
        with pytest.raises(CapacityError, match="'state_slots' holds 6 request rows but the batch needs 7"):
            r.stage_decode([req], 7, 1)
        r.release(req)
    finally:
        e.close()
