"""The run's prompts (qualify/checks/probes.py): drawn fresh from a seed, never repeated, sent among fillers
in requests of varying size and order; decoys are shaped exactly like a teacher-forcing request."""

from __future__ import annotations

from qualify.checks.probes import Probes
from qualify.protocol import Choice, CompletionResponse, Usage

BOS = 256


def _answer(texts: list[str], prefix: list[int] | None = None) -> CompletionResponse:
    pre = [BOS] if prefix is None else prefix
    choices = [
        Choice(index=i, token_ids=[1], text="", top2_gaps=[1.0], finish_reason="length",
               prompt_token_ids=[*pre, *t.encode()])
        for i, t in enumerate(texts)
    ]  # fmt: skip
    return CompletionResponse(choices=choices, mode_used="eager", usage=Usage(prompt_tokens=1,
                              completion_tokens=1, total_tokens=2))  # fmt: skip


def test_two_runs_draw_different_prompts_and_one_seed_draws_the_same() -> None:
    a, b = Probes(), Probes()
    assert a.seed != b.seed and a.fresh(5) != b.fresh(5)
    assert Probes(seed=7).fresh(5) == Probes(seed=7).fresh(5)


def test_a_run_never_draws_the_same_prompt_twice() -> None:
    p = Probes(seed=1)
    drawn = [tuple(x) if isinstance(x, list) else x for x in p.fresh(400)]
    assert len(set(drawn)) == 400


def test_the_tokenization_is_learned_only_when_it_is_a_prefix_plus_bytes() -> None:
    p = Probes(seed=2)
    texts = [p.text() for _ in range(3)]
    p.learn(texts, _answer(texts))
    assert p.prefix == [BOS] and p.fresh(1)[0][0] == BOS
    q = Probes(seed=3)
    texts = [q.text() for _ in range(3)]
    odd = _answer(texts)
    odd.choices[1].prompt_token_ids = [BOS, 9, 9]  # not its bytes: another tokenizer
    q.learn(texts, odd)
    assert q.prefix is None and isinstance(q.fresh(1)[0], str)


def test_batches_vary_in_size_and_order_and_keep_track_of_the_wanted_prompts() -> None:
    p = Probes(seed=4, prefix=[BOS], learned=True)
    wanted = p.fresh(3)
    shapes = set()
    for _ in range(30):
        batch, where = p.batch(wanted, capacity=8)
        assert [batch[i] for i in where] == wanted and 4 <= len(batch) <= 5
        shapes.add((len(batch), tuple(where)))
    assert len(shapes) > 4  # never one request repeated


def test_a_decoy_is_shaped_like_a_forcing_request_at_the_most_tie_like_position() -> None:
    p = Probes(seed=5, prefix=[BOS], learned=True)
    prompt = p.fresh(1)[0]
    answer = Choice(index=0, token_ids=[10, 11, 12, 13], text="", top2_gaps=[0.9, 0.01, 0.5, 0.2],
                    finish_reason="length", top2_ids=[[10, 1], [11, 77], [12, 2], [13, 3]])  # fmt: skip
    p.remember(prompt, answer)
    # What teacher forcing after a near tie at token 1 would send: the prompt, the tokens before it, and the
    # other half of the swapped pair.
    assert p.decoy() == [*prompt, 10, 77]


def test_the_seed_is_recorded_so_that_a_reviewer_can_draw_the_same_prompts() -> None:
    p = Probes()
    drawn = p.fresh(4)
    again = Probes(seed=int(p.evidence()["seed"], 16))
    assert again.fresh(4) == drawn
