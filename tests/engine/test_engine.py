"""The tiny engine on CPU: greedy determinism, prefill/decode agreement, in-place reload, probe."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qualify.engine.tokenizer import ByteTokenizer
from qualify.engine.weights import WeightsError

from .conftest import prefill_row

TOK = ByteTokenizer()
PROMPTS = [TOK.encode("The quick brown fox"), TOK.encode("hybrid KDA engines"), TOK.encode("x")]


def tokens(engine, prompts=PROMPTS, n=6):
    gens, _ = engine.generate(prompts, n)
    return [g.token_ids for g in gens]


def test_greedy_generation_is_deterministic_and_batch_independent(tiny_engine):
    gens1, mode = tiny_engine.generate(PROMPTS, 6)
    gens2, _ = tiny_engine.generate(PROMPTS, 6)
    assert mode == "eager"
    assert [g.token_ids for g in gens1] == [g.token_ids for g in gens2]
    assert [g.top2_gaps for g in gens1] == [g.top2_gaps for g in gens2]
    alone = [tokens(tiny_engine, [p])[0] for p in PROMPTS]
    assert alone == [g.token_ids for g in gens1]  # batching (and padding rows) change nothing
    assert all(len(g.token_ids) == len(g.top2_gaps) for g in gens1)


def test_a_prompts_prefill_is_bit_identical_alone_and_among_fillers(tiny_engine):
    # The harness compares answers given in batches of different composition; a prompt's logits must not
    # move with the batch around it. One varlen forward over the batch (the engine's prefill before
    # 2026-12-05) moves them on this CPU too: the fp32 head's sums change order with its row count.
    r = tiny_engine.runner
    fillers = [TOK.encode(t) for t in ("a filler of another length", "f", "more filler text, longer")]
    moved = 0.0
    for p in PROMPTS:
        alone, h_alone = prefill_row(r, [p], 0)
        for at in range(len(fillers) + 1):
            batch = [*fillers[:at], p, *fillers[at:]]
            got, h_got = prefill_row(r, batch, at)
            assert torch.equal(got, alone) and torch.equal(h_got, h_alone)
            one, _ = prefill_row(r, batch, at, one_forward=True)
            moved = max(moved, float((one - alone).abs().max()))
    assert moved > 0.0  # what the per-prompt prefill removes, seen here so the equality above can fail


def test_decode_agrees_with_prefill_of_the_generated_text(tiny_engine):
    prompt = TOK.encode("Prefill and decode must agree on every step, well past the selector's dense range")
    gen = tiny_engine.generate([prompt], 8)[0][0]
    r = tiny_engine.runner
    for k in (1, 7):
        req = r.admit(prompt + gen.token_ids[:k], 1)
        try:
            logits = r.prefill([req])
        finally:
            r.release(req)
        top = torch.topk(logits[0], 2)
        assert int(top.indices[0]) == gen.token_ids[k]
        assert float(top.values[0] - top.values[1]) == pytest.approx(gen.top2_gaps[k], abs=1e-3)


def test_reload_keeps_addresses_and_changes_outputs_only_when_weights_change(fresh_engine):
    e = fresh_engine
    original = e.weights_path
    before = tokens(e)
    params = {n: p.data_ptr() for n, p in e.model.named_parameters()}
    same = e.reload()
    assert same["census"]["addresses_unchanged"] and same["census"]["changed"] == []
    assert same["census"]["before_digest"] == same["census"]["after_digest"]
    assert tokens(e) == before
    parts = ["wait_for_background_save", "census_before", "load", "census_after"]
    assert list(same["seconds_each"]) == parts  # where a reload's seconds go (a diagnostic)
    assert sum(same["seconds_each"].values()) <= same["seconds"]
    new = e.reload(seed=1234)
    assert list(new["seconds_each"]) == ["wait_for_background_save", "generate", *parts[1:]]
    c = new["census"]
    assert c["addresses_unchanged"] and c["arena_addresses_unchanged"]
    assert "lm_head.weight" in c["changed"] and c["before_digest"] != c["after_digest"]
    assert {n: p.data_ptr() for n, p in e.model.named_parameters()} == params
    assert tokens(e) != before
    back = e.reload(path=str(original))
    assert back["census"]["addresses_unchanged"]
    assert tokens(e) == before


def test_a_seeded_reload_loads_the_bytes_its_file_then_holds(fresh_engine):
    """`{"seed"}` loads the generated tensors and writes their file in the background: a reload of another
    file does not wait for that write, a reload of that file does, and the file holds exactly what was
    loaded (reloading it changes nothing); a second reload of the same seed loads that file."""
    e = fresh_engine
    original = str(e.weights_path)
    new = e.reload(seed=4321)
    path = new["weights_path"]
    e.reload(path=original)
    assert e._saving is not None and str(e._saving[1]) == path  # not waited for: another file was read
    e.reload(seed=4321)  # the same file: waited for, then loaded from it
    assert e._saving is None
    again = e.reload(path=path)
    assert (
        again["census"]["changed"] == [] and again["census"]["before_digest"] == new["census"]["after_digest"]
    )
    assert e.reload(seed=4321)["weights_path"] == path and e._saving is None  # nothing written again


def test_a_failed_background_write_is_reported_by_the_reload_that_needs_the_file(fresh_engine, monkeypatch):
    from qualify.engine import engine as engine_mod

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    e = fresh_engine
    monkeypatch.setattr(engine_mod, "save_streamed", full_disk)
    path = e.reload(seed=999)["weights_path"]
    with pytest.raises(RuntimeError, match="No space left on device"):
        e.reload(path=path)
    assert e._saving is None


def test_reload_refuses_a_mismatched_file_and_copies_nothing(fresh_engine, tmp_path):
    e = fresh_engine
    before = tokens(e)
    bad = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    bad["lm_head.weight"] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="lm_head.weight has shape"):
        e.reload(path=str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="does not exist"):
        e.reload(path=str(tmp_path / "missing.safetensors"))
    assert tokens(e) == before


def test_decode_step_has_no_host_sync_outside_the_kda_backend(tiny_engine):
    """forward_decode_static must be capturable: any .item()/.tolist() may only come from the torch
    reference backend (which graphs never capture), never from the engine's own ops."""
    from torch.profiler import ProfilerActivity, profile

    r = tiny_engine.runner
    req = r.admit(TOK.encode("sync free"), 4)
    try:
        r._append(req, r.pick(r.prefill([req]))[0][0], 0.0)
        r.stage_decode([req], 4, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r.forward_decode_static(4, 1)
    finally:
        r.release(req)
    events = prof.events()
    kda = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("kda::")]
    syncs = [e for e in events if e.name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")]
    assert kda, "the KDA call site must be recognisable in a profile"
    outside = [e.name for e in syncs if not any(lo <= e.time_range.start <= hi for lo, hi in kda)]
    assert outside == []


def test_probe_names_the_kda_call_site_of_the_resolved_backend(tiny_engine):
    out = tiny_engine.probe()
    assert out["backend"] == "torch" and out["device_type"] == "cpu"
    assert "kda::torch" in out["kernel_names"]
    assert len(tiny_engine.runner.pool.groups) == tiny_engine.cfg.max_num_seqs


def test_token_ids_outside_the_vocabulary_are_refused(tiny_engine):
    with pytest.raises(ValueError, match="token ids"):
        tiny_engine.generate([[999_999]], 1)


@pytest.mark.parametrize(
    "prompts,max_tokens,needle",
    [([[]], 2, "has no tokens"), ([[256, 65]], 0, "max_tokens must be at least 1")],
)
def test_requests_that_cannot_be_served_are_refused_before_anything_is_admitted(
    tiny_engine, prompts, max_tokens, needle
):
    with pytest.raises(ValueError, match=needle):
        tiny_engine.generate(prompts, max_tokens)
    assert len(tiny_engine.runner.pool.groups) == tiny_engine.cfg.max_num_seqs


def test_an_engine_without_its_weights_decodes_past_eos_and_a_loaded_one_stops_there(
    tiny_engine, monkeypatch
):
    """The warm step's recording pass runs an engine whose weights were never loaded (Engine(weights=False):
    its tokens come from whatever memory held) and must reach every decode step whose kernels it records.
    A token that happens to be EOS after prefill ended the request there, and the decode kernels went
    unrecorded (tests/engine/test_precompile.py failed so, now and then, under load). Such an engine runs
    every request to max_tokens; one with its weights stops at EOS as before."""
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine
    from qualify.engine.runner import Runner
    from qualify.engine.tokenizer import EOS

    def always_eos(logits):
        rows = logits.shape[0]
        return [EOS] * rows, [1.0] * rows, [0] * rows

    monkeypatch.setattr(Runner, "pick_top2", staticmethod(always_eos))
    steps = []
    decode_step = Runner.decode_step
    monkeypatch.setattr(
        Runner, "decode_step", lambda self, *a: steps.append(len(a[0])) or decode_step(self, *a)
    )

    gens, _ = tiny_engine.generate(PROMPTS, 3)
    assert [(g.token_ids, g.finish_reason) for g in gens] == [([EOS], "stop")] * len(PROMPTS) and steps == []

    unloaded = Engine(EngineConfig(preset="tiny", device="cpu"), weights=False)
    try:
        gens, _ = unloaded.generate(PROMPTS, 3)
    finally:
        unloaded.close()
    assert [(g.token_ids, g.finish_reason) for g in gens] == [([EOS] * 3, "length")] * len(PROMPTS)
    assert steps == [len(PROMPTS)] * 2  # both decode steps ran, for every request
