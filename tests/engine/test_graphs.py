"""CPU tests of graph planning: capture sizes, size picking, the inert dummy request that pads a batch,
the address record, and what an engine without CUDA reports when asked to capture."""

from __future__ import annotations

import pytest
import torch

from qualify.engine.graphs import (
    AddressMoved,
    AddressRecord,
    CaptureEnvelope,
    GraphRunner,
    capture_engine,
    capture_sizes,
    captured_tensors,
    pick_size,
)


def make_engine(**fields):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    return Engine(EngineConfig(device="cpu", **fields))


def test_default_capture_sizes_are_powers_of_two_plus_the_full_batch_largest_first():
    assert capture_sizes(8, 0) == [8, 4, 2, 1]
    assert capture_sizes(6, 0) == [6, 4, 2, 1]
    assert capture_sizes(6, 3) == [24, 16, 8, 4]
    assert capture_sizes(1, 2) == [3]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 5, 8, 13])
@pytest.mark.parametrize("num_spec", [0, 1, 3])
def test_every_capture_size_is_a_multiple_of_the_verify_width_and_the_largest_is_included(
    max_num_seqs, num_spec
):
    tpr = 1 + num_spec
    sizes = capture_sizes(max_num_seqs, num_spec)
    assert sizes == sorted(sizes, reverse=True)
    assert all(s % tpr == 0 for s in sizes)
    assert sizes[0] == max_num_seqs * tpr
    assert len(set(sizes)) == len(sizes)


def test_requested_sizes_are_validated_and_kept_as_the_config_gives_them():
    with pytest.raises(ValueError, match="multiples of 1 \\+ num_spec = 4"):
        capture_sizes(4, 3, [4, 6])
    with pytest.raises(ValueError, match="no capture sizes"):
        capture_sizes(4, 3, [])
    assert capture_sizes(4, 3, [8, 4, 8]) == [8, 4]  # a full batch of 4 then runs eagerly, counted
    assert capture_sizes(4, 1, [2, 20]) == [20, 2]  # graph-plan capacity may exceed live capacity


def test_pick_size_chooses_the_smallest_captured_size_that_fits():
    sizes = capture_sizes(8, 1)  # [16, 8, 4, 2]
    assert pick_size(1, sizes, 2) == 2
    assert pick_size(3, sizes, 2) == 8
    assert pick_size(5, sizes, 2) == 16
    assert pick_size(8, sizes, 2) == 16
    assert pick_size(9, sizes, 2) is None


def test_envelope_separates_live_capacity_from_graph_plan_capacity():
    class Cfg:
        max_num_seqs, num_spec, capture_sizes = 4, 1, [2, 20]

    env = CaptureEnvelope.from_config(Cfg)
    assert env.sizes == (20, 2)
    assert env.max_requests == 10 and env.max_num_seqs == 4 and env.tokens_per_request == 2


def test_address_record_detects_a_tensor_that_moved_and_digests_stably():
    a, b = torch.zeros(4), torch.ones(3)
    rec = AddressRecord.of({"a": a, "b": b})
    rec.check()
    assert rec.digest() == AddressRecord.of({"a": a, "b": b}).digest()
    assert rec.same_as({"a": a, "b": b}) == []
    a.copy_(torch.arange(4.0))  # in-place copy keeps the address
    rec.check()
    b.data = torch.ones(3)  # rebinding the storage moves it
    with pytest.raises(AddressMoved, match="b"):
        rec.check()
    assert rec.same_as({"a": a, "b": b, "c": a}) == ["b", "c"]


@pytest.fixture(scope="module")
def small_engine(_engine_home):
    e = make_engine(max_model_len=128, max_num_seqs=8)
    yield e
    e.close()


def _pools(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in captured_tensors(engine).items() if k.startswith("pool.")}


def _restore(engine, saved: dict[str, torch.Tensor]) -> None:
    live = captured_tensors(engine)
    for k, v in saved.items():
        live[k].copy_(v)


def _touched(before: dict, after: dict, engine, owned_slots: set[int], owned_blocks: set[int]) -> list[str]:
    """Pool rows that changed outside the live requests' own slots / blocks and the null slot / block."""
    bad = []
    for k, b in before.items():
        owned = owned_blocks if k.endswith(("k_cache", "v_cache")) else owned_slots
        for row in range(b.shape[0]):
            if row not in owned and row != 0 and not torch.equal(b[row], after[k][row]):
                bad.append(f"{k}[{row}]")
    return bad


def test_dummy_requests_are_inert(small_engine):
    e, r = small_engine, small_engine.runner
    n, n_pad = 3, 8
    reqs = [r.admit([256, 40 + i, 41 + i], 4) for i in range(n)]
    try:
        toks, gaps = r.pick(r.prefill(reqs))
        for q, t, g in zip(reqs, toks, gaps, strict=True):
            r._append(q, t, g)
        slots = {s for q in reqs for s in q.slots}
        blocks = {b for q in reqs for b in q.blocks}
        start = _pools(e)

        r.stage_decode(reqs, n_pad)
        a = e.arena
        assert a.view("state_slots", n_pad, 1)[n:].eq(0).all()  # the null state slot
        assert a.view("num_accepted", n_pad)[n:].eq(1).all()
        assert a.view("seq_lens", n_pad)[n:].eq(0).all()  # attends to nothing: output zero
        assert a.view("block_tables", n_pad, e.cfg.max_blocks_per_seq)[n:].eq(0).all()  # the null block
        assert a.view("query_start_loc", n_pad + 1)[n:].eq(n).all()  # repeated: zero query tokens
        padded = r.forward_decode_static(n_pad)[:n].clone()
        assert e.kda_rt.ws.out[n:n_pad].eq(0).all()  # the KDA backend outputs zero for the null slot
        after_padded = _pools(e)
        assert _touched(start, after_padded, e, slots, blocks) == []

        # Other contents in the dummy rows cannot reach the live rows or the live state.
        _restore(e, start)
        r.stage_decode(reqs, n_pad)
        ids = a.view("input_ids", n_pad).clone()
        ids[n:] = torch.tensor([7, 99, 3, 250, 12])
        a.stage("input_ids", ids)
        a.stage("positions", torch.cat([a.view("positions", n), torch.tensor([5, 77, 0, 120, 9])]))
        assert torch.equal(r.forward_decode_static(n_pad)[:n], padded)
        other = _pools(e)
        for k in start:
            assert torch.equal(other[k][1:], after_padded[k][1:]), k  # every row but the null one

        # And the unpadded step computes the same (up to GEMM rounding for another row count).
        _restore(e, start)
        r.stage_decode(reqs, n)
        torch.testing.assert_close(r.forward_decode_static(n), padded, rtol=1e-5, atol=1e-5)
        for k, v in _pools(e).items():
            torch.testing.assert_close(v[1:], after_padded[k][1:], rtol=1e-5, atol=1e-5)
    finally:
        for q in reqs:
            r.release(q)


def test_an_engine_without_cuda_captures_nothing_says_why_and_runs_eagerly(small_engine):
    e = small_engine
    report = capture_engine(e)
    assert report["captured"] is False and "CUDA device" in report["reason"]
    assert report["sizes"] == sorted(e.cfg.capture_sizes, reverse=True)
    assert report["pool_bytes"] == 0 and report["address_digest"] is None
    assert capture_engine(e) is report  # asking again captures nothing
    assert e.runner.graphs.padded_size(1, 1) is None
    before = e.counters.eager_steps
    gens, used = e.generate([[256, 65]], 3, "auto")
    assert used == "eager" and e.counters.eager_steps == before + 2
    assert (
        e.counters.graph_captures == 0 and e.counters.graph_replays == 0 and e.counters.graph_recaptures == 0
    )


def test_captured_tensors_name_every_parameter_pool_and_arena_buffer(small_engine):
    e = small_engine
    names = captured_tensors(e)
    params = {f"param.{n}" for n, _ in e.model.named_parameters()}
    assert params <= set(names)
    assert {f"arena.{b}" for b in e.arena.buffers} <= set(names)
    assert {"static.logits", "static.hidden", "pool.0.state", "pool.0.conv_state", "pool.3.k_cache"} <= set(
        names
    )
    rec = AddressRecord.of(names)
    before = e.reload()  # same weights, copied in place
    assert before["census"]["addresses_unchanged"]
    assert rec.same_as(captured_tensors(e)) == []
    rec.check()


def test_scratch_bound_later_for_an_uncaptured_eager_shape_is_not_reported_as_moved(small_engine):
    """Only the captured plans' KDA scratch is read by graphs: a backend that binds scratch for a new eager
    shape after capture (b12x does) must not make a reload report captured addresses as moved."""
    e = small_engine
    g = GraphRunner(e)
    plans = [(8, 1), (4, 1)]
    saved = dict(e.kda_rt._scratch)
    for key in plans:  # what capture's warm-up binds
        e.kda_rt._scratch[key] = {"b12x": torch.zeros(1, dtype=torch.uint8)}
    g.graphs = {p: object() for p in plans}
    g.record = AddressRecord.of(captured_tensors(e, g.graphs))
    assert "kda.scratch.8x1.b12x" in g.record.names
    e.kda_rt._scratch[(3, 1)] = {"b12x": torch.zeros(1, dtype=torch.uint8)}  # an eager step of 3 rows
    try:
        assert g.moved_since_capture() == []
        e.kda_rt._scratch[(8, 1)]["b12x"] = torch.zeros(1, dtype=torch.uint8)  # a captured one replaced
        assert g.moved_since_capture() == ["kda.scratch.8x1.b12x"]
    finally:
        e.kda_rt._scratch.clear()
        e.kda_rt._scratch.update(saved)


def test_a_cuda_oom_during_capture_propagates_to_be_counted(small_engine, monkeypatch):
    e = small_engine
    g = GraphRunner(e)
    g.reason = None  # as on a CUDA device with cudagraph_mode full

    def oom(*_a, **_k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_a, **_k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(e.runner, "stage_decode", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        g.capture()
    assert g.graphs == {} and g.report is None  # nothing half-captured, and a later capture may retry
