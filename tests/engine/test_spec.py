"""CPU tests of MTP speculative decoding (torch backend): acceptance, equality with plain greedy decoding,
rollback to the state of the last accepted token, counters."""

from __future__ import annotations

import pytest
import torch

from qualify.engine.runner import ModeUnavailable
from qualify.engine.spec import SpecCounters, accept_greedy, speculative_generate, verify_step
from qualify.protocol import compare_greedy


def make_engine(**fields):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    return Engine(EngineConfig(device="cpu", **fields))


NUM_SPEC = 3
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 65], [256, *range(40, 60)]]
EPSILON = 1e-3  # fp32 on CPU: only a genuine near tie may break token equality


@pytest.fixture(scope="module")
def spec_engine(_engine_home):
    e = make_engine(num_spec=NUM_SPEC, max_model_len=128, max_num_seqs=4)
    yield e
    e.close()


@pytest.fixture(scope="module")
def plain_runs(spec_engine):
    gens, _ = spec_engine.generate(PROMPTS, 16, "eager")
    return gens


def oracle_drafter(plain, wrong_at: int):
    """Drafts the plain greedy continuation, with one wrong token at draft index `wrong_at` (none if >= S)."""
    cont = {tuple(p): g.token_ids for p, g in zip(PROMPTS, plain, strict=True)}

    def draft(reqs, hidden, last, S):
        rows = []
        for r in reqs:
            full = cont[tuple(r.prompt)]
            nxt = (full[len(r.output) : len(r.output) + S] + [0] * S)[:S]
            if wrong_at < S:
                nxt[wrong_at] = (nxt[wrong_at] + 1) % 256
            rows.append(nxt)
        return torch.tensor(rows)

    return draft


def test_acceptance_is_the_longest_matching_prefix_plus_a_bonus_token():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 0, 8], [5, 6, 7, 8]])
    assert accept_greedy(draft, target).tolist() == [3, 1, 2, 0]
    assert accept_greedy(torch.zeros(2, 0, dtype=torch.long), torch.ones(2, 1)).tolist() == [0, 0]
    with pytest.raises(ValueError, match="num_spec \\+ 1"):
        accept_greedy(draft, target[:, :3])


def test_speculative_decoding_with_the_mtp_draft_equals_plain_greedy(spec_engine, plain_runs):
    gens, used, stats = speculative_generate(spec_engine, PROMPTS, 16)
    assert used == "eager"
    for ref, got in zip(plain_runs, gens, strict=True):
        report = compare_greedy(ref.token_ids, ref.top2_gaps, got.token_ids, EPSILON)
        assert report.agrees, report
        assert len(got.token_ids) == 16 and got.finish_reason == "length"
    assert stats.emitted == len(PROMPTS) * 15  # the first token of each request comes from prefill
    assert stats.drafted == NUM_SPEC * stats.request_rounds and stats.steps >= 15 // (NUM_SPEC + 1)


@pytest.mark.parametrize("wrong_at", range(NUM_SPEC + 1))
def test_partial_acceptance_still_equals_plain_greedy_and_is_counted(spec_engine, plain_runs, wrong_at):
    before = (spec_engine.counters.spec_drafted, spec_engine.counters.spec_accepted)
    gens, _, stats = speculative_generate(
        spec_engine, PROMPTS, 16, drafter=oracle_drafter(plain_runs, wrong_at)
    )
    for ref, got in zip(plain_runs, gens, strict=True):
        assert compare_greedy(ref.token_ids, ref.top2_gaps, got.token_ids, EPSILON).agrees
    # Every round accepts exactly `wrong_at` drafts (all of them when none is wrong), except that a
    # request's final round may stop early at max_tokens.
    per_round = min(wrong_at, NUM_SPEC)
    assert stats.drafted == NUM_SPEC * stats.request_rounds
    assert stats.accepted <= per_round * stats.request_rounds
    assert stats.accepted >= per_round * (stats.request_rounds - len(PROMPTS))
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    assert spec_engine.counters.spec_drafted - before[0] == stats.drafted
    assert spec_engine.counters.spec_accepted - before[1] == stats.accepted


def _kda_layers(engine):
    return [layer.mixer for layer in engine.model.layers if layer.kind == "K"]


def _prefilled(engine, prompt, max_tokens):
    r = engine.runner
    req = r.admit(prompt, max_tokens)
    toks, gaps = r.pick(r.prefill([req]))
    r._append(req, toks[0], gaps[0])
    return req


@pytest.mark.parametrize("accepted", range(NUM_SPEC + 1))
def test_rollback_restores_exactly_the_state_of_the_last_accepted_token(_engine_home, accepted):
    # KDA layers before any attention layer: their inputs do not pass through attention, whose
    # reductions round differently for 4 query tokens than for 1, so the comparison can be bitwise.
    e = make_engine(num_spec=NUM_SPEC, max_model_len=128, max_num_seqs=4, layer_pattern="KKKKAA")
    try:
        r, prompt = e.runner, PROMPTS[0]
        plain, _ = e.generate([prompt], 8, "eager")
        cont = plain[0].token_ids
        drafts = list(cont[1 : 1 + NUM_SPEC])
        if accepted < NUM_SPEC:
            drafts[accepted] = (drafts[accepted] + 1) % 256
        a = _prefilled(e, prompt, 8)
        logits, _, _ = verify_step(e, [a], [[a.output[-1], *drafts]], [1], "eager")
        target = torch.tensor(r.pick(logits)[0]).view(1, NUM_SPEC + 1)
        assert accept_greedy(torch.tensor([drafts]), target).item() == accepted
        # Plain decode of the accepted tokens (the first token and `accepted` drafts), one at a time.
        # Padded to the verify step's row count with dummy requests so projections share GEMM shapes.
        b = _prefilled(e, prompt, 8)
        for j in range(accepted + 1):
            if j:
                r._append(b, cont[j], 0.0)
            r.stage_decode([b], NUM_SPEC + 1, 1)
            r.forward_decode_static(NUM_SPEC + 1, 1)
        for layer in _kda_layers(e):
            assert torch.equal(layer.state[a.slots[accepted]], layer.state[b.slots[0]])
            assert torch.equal(layer.conv_state[a.slots[accepted]], layer.conv_state[b.slots[0]])
        r.release(a)
        r.release(b)
    finally:
        e.close()


def test_state_after_the_last_accepted_token_ignores_the_rejected_drafts(spec_engine, plain_runs):
    e, r = spec_engine, spec_engine.runner
    cont = plain_runs[0].token_ids
    keep = 1  # the first draft is right, the second and third are wrong (differently in each run)
    states = []
    for junk in (7, 99):
        req = _prefilled(e, PROMPTS[0], 8)
        drafts = [cont[1], (cont[2] + junk) % 256, junk]
        verify_step(e, [req], [[req.output[-1], *drafts]], [1], "eager")
        states.append([(lay.state[req.slots[keep]].clone(), lay.conv_state[req.slots[keep]].clone())
                       for lay in _kda_layers(e)])  # fmt: skip
        r.release(req)
    for (s0, c0), (s1, c1) in zip(*states, strict=True):
        assert torch.equal(s0, s1) and torch.equal(c0, c1)


def test_speculative_decoding_needs_num_spec_and_a_graph_for_mode_graph(tiny_engine, spec_engine):
    with pytest.raises(ModeUnavailable, match="num_spec > 0"):
        speculative_generate(tiny_engine, [[256, 65]], 4)
    with pytest.raises(ModeUnavailable, match="captured verify graph"):
        speculative_generate(spec_engine, [[256, 65]], 4, "graph")
    assert len(spec_engine.runner.pool.groups) == spec_engine.cfg.max_num_seqs  # slots given back


def test_acceptance_rate_of_no_drafts_is_zero():
    assert SpecCounters().acceptance_rate == 0.0
    c = SpecCounters(steps=2, drafted=6, accepted=3, emitted=5)
    assert c.acceptance_rate == 0.5 and c.as_dict()["spec_acceptance_rate"] == 0.5


def test_the_api_serves_speculative_completions_and_counts_them(spec_engine):
    from fastapi.testclient import TestClient

    from qualify.engine.server import create_app
    from qualify.protocol import CaptureResponse, CompletionResponse, Describe

    with TestClient(create_app(spec_engine)) as c:
        body = {"prompt": ["The hybrid engine", "KDA"], "max_tokens": 9}
        plain = CompletionResponse.model_validate(c.post("/v1/completions", json=body).json())
        before = Describe.model_validate(c.get("/v1/describe").json()).counters
        got = c.post("/v1/completions", json={**body, "speculative": True})
        assert got.status_code == 200, got.text
        spec = CompletionResponse.model_validate(got.json())
        for a, b in zip(plain.choices, spec.choices, strict=True):
            assert compare_greedy(a.token_ids, a.top2_gaps, b.token_ids, EPSILON).agrees
        after = Describe.model_validate(c.get("/v1/describe").json()).counters
        assert after.spec_drafted > before.spec_drafted and after.requests == before.requests + 1
        rate = after.spec_accepted / after.spec_drafted
        assert after.model_extra["spec_acceptance_rate"] == pytest.approx(rate)
        metrics = c.get("/metrics").text
        assert f"qualify_engine_spec_drafted_total {after.spec_drafted}" in metrics
        assert f"qualify_engine_spec_acceptance_rate {rate:.6f}" in metrics
        assert "qualify_engine_graph_recaptures_total 0" in metrics
        cap = CaptureResponse.model_validate(c.post("/qualify/capture").json())
        assert not cap.captured and "CUDA device" in cap.reason and sorted(cap.sizes) == [4, 8, 16]
        refused = c.post("/v1/completions", json={**body, "speculative": True, "mode": "graph"})
        assert refused.status_code == 409 and "captured verify graph" in refused.json()["error"]["message"]


def test_plain_and_speculative_steps_run_through_the_one_resolved_backend(spec_engine, plain_runs):
    e = spec_engine
    speculative_generate(e, PROMPTS[:1], 6)
    e.generate(PROMPTS[:1], 3, "eager")
    bindings = list(e.kda_rt._bindings.values())
    widths = {b.plan.caps.tokens_per_request for b in bindings}
    assert widths == {1, NUM_SPEC + 1}  # both plain decode and verify steps have run
    assert {b.plan.backend for b in bindings} == {e.resolution.name}
    assert e.kda_rt.backend is e.backend
    assert e.describe()["backend"]["resolved"] == e.resolution.name


# ---------------------------------------------------------------- harness-supplied drafts


@pytest.fixture(scope="module")
def long_plain(spec_engine):
    """Plain greedy output of PROMPTS[0], num_spec tokens longer than the speculative runs below."""
    gens, _ = spec_engine.generate([PROMPTS[0]], 16 + NUM_SPEC, "eager")
    return gens[0]


@pytest.mark.parametrize("j", range(NUM_SPEC + 1))
def test_harness_drafts_with_draft_j_altered_are_accepted_exactly_j_per_step(spec_engine, long_plain, j):
    from qualify.checks.speculation import claims_refusal, plan

    drafts = plan(long_plain.token_ids, 16, j, NUM_SPEC)
    gens, _, stats = speculative_generate(spec_engine, [PROMPTS[0]], 16, drafts=drafts)
    (g,) = gens
    assert g.token_ids == long_plain.token_ids[:16]  # every acceptance length reproduces plain greedy output
    assert g.accepted_per_step == [j] * len(drafts) and stats.accepted == j * len(drafts)
    assert claims_refusal(drafts, g.accepted_per_step, g.token_ids, NUM_SPEC) is None
    assert [pair[0] for pair in g.top2_ids] == g.token_ids
    assert all(pair[1] != pair[0] and pair[1] >= 0 for pair in g.top2_ids)


def test_a_claim_of_more_accepted_drafts_than_the_output_shows_is_refused(long_plain):
    from qualify.checks.speculation import claims_refusal, plan

    out = long_plain.token_ids[:16]
    drafts = plan(long_plain.token_ids, 16, 1, NUM_SPEC)  # draft 1 altered: one accepted per step
    assert claims_refusal(drafts, [1] * len(drafts), out, NUM_SPEC) is None
    # Claiming all three accepted would put the altered draft into the output: it is not there.
    assert "not those drafts" in claims_refusal(drafts, [NUM_SPEC] * len(drafts), out, NUM_SPEC)
    # Claiming none at every step accounts for fewer tokens than were returned.
    assert "account for" in claims_refusal(drafts, [0] * len(drafts), out, NUM_SPEC)


def test_drafts_past_the_given_steps_come_from_the_mtp_layer(spec_engine, long_plain):
    from qualify.checks.speculation import plan

    drafts = plan(long_plain.token_ids, 16, NUM_SPEC, NUM_SPEC)[:1]
    (g,), _, _ = speculative_generate(spec_engine, [PROMPTS[0]], 16, drafts=drafts)
    assert g.token_ids == long_plain.token_ids[:16] and g.accepted_per_step[0] == NUM_SPEC
    assert len(g.accepted_per_step) > 1


def test_drafts_of_the_wrong_shape_are_refused_before_any_work(spec_engine):
    free = len(spec_engine.runner.pool.groups)
    with pytest.raises(ValueError, match="num_spec = 3"):
        speculative_generate(spec_engine, [PROMPTS[0]], 8, drafts=[[1, 2]])
    with pytest.raises(ValueError, match="one prompt"):
        speculative_generate(spec_engine, PROMPTS[:2], 8, drafts=[[1, 2, 3]])
    with pytest.raises(ValueError, match="lie in"):
        speculative_generate(spec_engine, [PROMPTS[0]], 8, drafts=[[1, 2, 10_000]])
    assert len(spec_engine.runner.pool.groups) == free


def test_the_api_verifies_harness_drafts_and_reports_accepted_counts(spec_engine, long_plain):
    from fastapi.testclient import TestClient

    from qualify.checks.speculation import plan
    from qualify.engine.server import create_app
    from qualify.protocol import CompletionResponse

    drafts = plan(long_plain.token_ids, 16, 2, NUM_SPEC)
    body = {"prompt": [PROMPTS[0]], "max_tokens": 16, "speculative": True, "drafts": drafts}
    with TestClient(create_app(spec_engine)) as c:
        got = c.post("/v1/completions", json=body)
        assert got.status_code == 200, got.text
        (choice,) = CompletionResponse.model_validate(got.json()).choices
        assert choice.accepted_per_step == [2] * len(drafts) and choice.prompt_token_ids == PROMPTS[0]
        assert choice.token_ids == long_plain.token_ids[:16] and len(choice.top2_ids) == 16
        plain = c.post("/v1/completions", json={"prompt": [PROMPTS[0]], "max_tokens": 4}).json()
        assert plain["choices"][0]["accepted_per_step"] is None
        for bad, status in (({**body, "speculative": False}, 422), ({**body, "drafts": [[1]]}, 400)):
            r = c.post("/v1/completions", json=bad)
            assert r.status_code == status and r.json()["error"]["message"]
