"""FULL CUDA graphs, speculative decoding and reload under captured graphs on the proxy preset (run on an
H200 by scripts/gpu-check): every size captured, replay equals eager, addresses fixed across a thousand
replays and a reload, new weights reach the graphs, num_spec = 3 equals plain greedy, probe names."""

from __future__ import annotations

import pytest
import torch

from qualify.protocol import compare_greedy

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

EPSILON = 0.05  # bf16 logits: the harness's coherence epsilon (qualify/checks/base.py)
NUM_SPEC = 3


def _engine(**fields):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    return Engine(EngineConfig(preset="proxy", device="cuda", **fields))


def _prompts(n: int) -> list[list[int]]:
    return [[256, *f"prompt {i}: graphs replay the decode step".encode()] for i in range(n)]


def _agree(ref, got, prompts=None, force=None) -> None:
    """The coherence rule with both sides' evidence; a near tie is forced through with `force(prompt ids,
    max_tokens) -> tokens` (the candidate's configuration), given the batch's `prompts`."""
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        kw = {"reference_top2": a.top2_ids, "candidate_gaps": b.top2_gaps, "candidate_top2": b.top2_ids}
        report = compare_greedy(a.token_ids, a.top2_gaps, b.token_ids, EPSILON, **kw)
        if report.forcing == "missing" and force is not None:
            d = report.first_divergence
            forced = force([*prompts[i], *a.token_ids[: d + 1]], len(a.token_ids) - d - 1)
            report = compare_greedy(
                a.token_ids, a.top2_gaps, b.token_ids, EPSILON, forced_continuation=forced, **kw
            )
        assert report.agrees, report


def _graph_of(engine):
    return lambda prompt, n: engine.generate([prompt], n, "graph")[0][0].token_ids


def _speculative_of(engine):
    from qualify.engine.spec import speculative_generate

    return lambda prompt, n: speculative_generate(engine, [prompt], n, "graph")[0][0].token_ids


@pytest.fixture(scope="module")
def plain(_engine_home):
    from qualify.engine.graphs import capture_engine

    e = _engine()
    e.capture_report = capture_engine(e)
    yield e
    e.close()


@pytest.fixture(scope="module")
def spec(_engine_home, plain):
    from qualify.engine.graphs import capture_engine

    e = _engine(num_spec=NUM_SPEC)
    e.capture_report = capture_engine(e)
    yield e
    e.close()


def test_every_size_is_captured_once_into_one_pool(plain):
    from qualify.engine.graphs import capture_engine

    rep, c = plain.capture_report, plain.counters
    assert rep["captured"], rep["reason"]
    assert sorted(rep["sizes"]) == sorted(plain.cfg.capture_sizes) == [1, 2, 4, 8]
    assert rep["pool_bytes"] > 0 and rep["seconds"] > 0 and rep["address_digest"].startswith("sha256:")
    assert c.graph_captures == 4
    assert capture_engine(plain) is rep and c.graph_captures == 4 and c.graph_recaptures == 0


@pytest.mark.parametrize("batch", range(1, 9))
def test_replay_equals_eager_for_every_batch_size(plain, batch):
    prompts = _prompts(batch)
    eager, used_e = plain.generate(prompts, 10, "eager")
    replays = plain.counters.graph_replays
    graph, used_g = plain.generate(prompts, 10, "graph")
    assert (used_e, used_g) == ("eager", "graph")
    steps = max(len(g.token_ids) for g in graph) - 1  # the first token of each request comes from prefill
    assert plain.counters.graph_replays == replays + steps
    _agree(eager, graph, prompts, _graph_of(plain))


def test_addresses_stay_fixed_across_a_thousand_replays(plain):
    g = plain.runner.graphs
    digest = plain.capture_report["address_digest"]
    arenas = plain.arena.addresses()
    before = plain.counters.graph_replays
    while plain.counters.graph_replays - before < 1000:  # every replay checks the recorded addresses first
        plain.generate(_prompts(3), 251, "graph")
    assert plain.counters.graph_replays - before >= 1000
    assert g.moved_since_capture() == [] and g.record.digest() == digest
    assert plain.arena.addresses() == arenas and plain.counters.graph_recaptures == 0


def test_reload_with_the_same_weights_keeps_addresses_and_replay_output(plain):
    g, c = plain.runner.graphs, plain.counters
    first, _ = plain.generate(_prompts(4), 12, "graph")
    captures = c.graph_captures
    out = plain.reload()
    census = out["census"]
    assert census["addresses_unchanged"] and census["arena_addresses_unchanged"] and census["changed"] == []
    assert g.moved_since_capture() == []
    again, used = plain.generate(_prompts(4), 12, "graph")
    assert used == "graph" and c.graph_captures == captures and c.graph_recaptures == 0
    assert [x.token_ids for x in again] == [x.token_ids for x in first]


def test_reload_with_new_weights_reaches_the_captured_graphs(plain):
    g = plain.runner.graphs
    old, _ = plain.generate(_prompts(4), 12, "graph")
    original = plain.weights_path
    out = plain.reload(seed=plain.cfg.seed + 7919)
    try:
        assert out["census"]["addresses_unchanged"] and out["census"]["changed"]
        assert g.moved_since_capture() == []
        new, used = plain.generate(_prompts(4), 12, "graph")
        assert used == "graph"
        assert [x.token_ids for x in new] != [x.token_ids for x in old]
        fresh = _engine(seed=plain.cfg.seed + 7919, cudagraph_mode="none")
        try:
            ref, used_f = fresh.generate(_prompts(4), 12, "eager")
            assert used_f == "eager"
            _agree(ref, new, _prompts(4), _graph_of(plain))
        finally:
            fresh.close()
            del fresh
            torch.cuda.empty_cache()
    finally:
        plain.reload(path=str(original))
    restored, _ = plain.generate(_prompts(4), 12, "graph")
    assert [x.token_ids for x in restored] == [x.token_ids for x in old]


def test_speculative_decoding_with_three_drafts_equals_plain_greedy(spec, plain):
    from qualify.engine.spec import speculative_generate

    rep = spec.capture_report
    assert rep["captured"], rep["reason"]
    assert sorted(rep["sizes"]) == [4, 8, 16, 32]
    prompts = _prompts(5)
    ref, _ = plain.generate(prompts, 24, "graph")
    own, used_p = spec.generate(prompts, 24, "graph")  # plain decode graphs (T = 1) of the spec engine
    gens, used, stats = speculative_generate(spec, prompts, 24, "graph")
    assert used_p == "graph" and used == "graph"
    assert stats.drafted == NUM_SPEC * stats.request_rounds > 0
    assert spec.counters.spec_drafted >= stats.drafted and spec.counters.graph_recaptures == 0
    _agree(ref, gens, prompts, _speculative_of(spec))
    _agree(own, gens, prompts, _speculative_of(spec))
    # The backend resolved at construction serves plain and speculative steps alike.
    names = spec.probe()["kernel_names"]
    assert f"kda::{spec.resolution.name}" in names


def test_probe_names_the_kernels_of_the_resolved_backend(plain):
    probe = plain.probe()
    assert probe["backend"] == plain.resolution.name == "triton" and probe["device_type"] == "cuda"
    names = probe["kernel_names"]
    assert "kda::triton" in names
    assert any("_kda_decode_kernel" in n for n in names), names
    assert [n for n in names if n.startswith("kda::") and not n.startswith("kda::triton")] == []


def test_a_batch_above_the_largest_capture_runs_eagerly_and_is_counted(plain):
    from qualify.engine.graphs import capture_engine
    from qualify.engine.runner import ModeUnavailable

    e = _engine(capture_sizes=[1, 2], max_num_seqs=4)
    try:
        assert capture_engine(e)["captured"] and e.counters.graph_captures == 2
        _, used = e.generate(_prompts(2), 4, "auto")
        assert used == "graph" and e.counters.graph_oversize_eager == 0
        _, used = e.generate(_prompts(3), 4, "auto")
        assert used == "eager" and e.counters.graph_oversize_eager == e.counters.eager_steps >= 1
        with pytest.raises(ModeUnavailable):
            e.generate(_prompts(3), 4, "graph")
        assert e.counters.graph_captures == 2 and e.counters.graph_recaptures == 0
    finally:
        e.close()


def test_reload_with_new_weights_reaches_the_speculative_graphs(spec):
    """The verify graphs bind the KDA backend of a speculative engine (b12x where it runs): nothing that
    backend derived from A_log / dt_bias / norm weights at bind time may survive a reload."""
    from qualify.engine.spec import speculative_generate

    g = spec.runner.graphs
    prompts = _prompts(3)
    old, _, _ = speculative_generate(spec, prompts, 12, "graph")
    original = spec.weights_path
    seed = spec.cfg.seed + 104729
    out = spec.reload(seed=seed)
    try:
        assert out["census"]["addresses_unchanged"] and out["census"]["changed"]
        assert g.moved_since_capture() == []
        new, used, _ = speculative_generate(spec, prompts, 12, "graph")
        assert used == "graph"
        assert [x.token_ids for x in new] != [x.token_ids for x in old]
        fresh = _engine(seed=seed, cudagraph_mode="none")
        try:
            ref, _ = fresh.generate(prompts, 12, "eager")
            _agree(ref, new, prompts, _speculative_of(spec))
        finally:
            fresh.close()
            del fresh
            torch.cuda.empty_cache()
    finally:
        spec.reload(path=str(original))
    restored, _, _ = speculative_generate(spec, prompts, 12, "graph")
    assert [x.token_ids for x in restored] == [x.token_ids for x in old]
