"""The coherence rule as the checks apply it: each comparison says identical, near_tie or differs, and a near
tie is only accepted once teacher forcing (the candidate re-asked through the tie) continues identically."""

from __future__ import annotations

from typing import Any

from qualify.checks.base import coherence
from qualify.checks.speculation import expected_counts, plan
from qualify.protocol import CompletionResponse

PROMPT = [256, 65, 66]
REF = [10, 20, 30, 40, 50]
CAND = [10, 21, 31, 41, 51]  # a different token at 1, and (as greedy runs do) everything after it


def answer(toks: list[int], gaps: list[float], pairs: list[list[int]], prompt: list[int] = PROMPT) -> Any:
    choice = {"index": 0, "token_ids": toks, "text": "", "top2_gaps": gaps, "top2_ids": pairs,
              "finish_reason": "length", "prompt_token_ids": prompt}  # fmt: skip
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return CompletionResponse.model_validate({"choices": [choice], "mode_used": "graph", "usage": usage})


REFERENCE = answer(REF, [1.0, 0.01, 1.0, 1.0, 1.0], [[10, 0], [20, 21], [30, 0], [40, 0], [50, 0]])
TIE = answer(CAND, [1.0, 0.02, 1.0, 1.0, 1.0], [[10, 0], [21, 20], [31, 0], [41, 0], [51, 0]])


class Reask:
    def __init__(self, continuation: list[int]) -> None:
        self.continuation, self.calls = continuation, []

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        self.calls.append((prompt_ids, max_tokens))
        return self.continuation


def test_identical_answers_are_identical_without_reasking() -> None:
    ask = Reask([])
    c = coherence(REFERENCE, REFERENCE, prompts=1, reask=ask)
    assert c["outcome"] == "identical" and c["summary"] == "identical" and c["agrees"] and not ask.calls


def test_a_near_tie_is_forced_through_and_then_agrees_as_near_tie() -> None:
    ask = Reask(REF[2:])
    c = coherence(REFERENCE, TIE, prompts=1, reask=ask)
    # The candidate is re-asked with the reference's tokens through the tie appended to its prompt.
    assert ask.calls == [([*PROMPT, 10, 20], 3)]
    assert c["outcome"] == "near_tie" and c["agrees"] and not c["identical"]
    assert c["summary"].startswith("near_tie at prompt 0 token 1")
    assert c["per_prompt"][0]["outcome"] == "near_tie"


def test_a_second_divergence_after_forcing_differs() -> None:
    c = coherence(REFERENCE, TIE, prompts=1, reask=Reask([30, 99, 50]))
    assert c["outcome"] == "differs" and not c["agrees"]
    assert c["summary"].startswith("differs: prompt 0:") and "diverges again at token 3" in c["summary"]


def test_no_forcing_means_no_near_tie() -> None:
    # Without a way to reask, or when the two runs did not see the same prompt tokens, a tie is unconfirmed.
    assert coherence(REFERENCE, TIE, prompts=1)["outcome"] == "differs"
    other = answer(CAND, TIE.choices[0].top2_gaps, TIE.choices[0].top2_ids, prompt=[256, 65])
    ask = Reask(REF[2:])
    assert coherence(REFERENCE, other, prompts=1, reask=ask)["outcome"] == "differs" and not ask.calls


def test_an_engine_without_top2_ids_gets_exact_identity_only() -> None:
    bare = answer(CAND, [0.0] * 5, [])
    c = coherence(REFERENCE, bare, prompts=1, reask=Reask(REF[2:]))
    assert c["outcome"] == "differs" and "no top-2 token ids" in c["summary"]


def test_draft_plans_alter_draft_j_and_expect_j_accepted_per_step() -> None:
    ref = list(range(100, 120))  # plain greedy output, max_tokens + num_spec long
    rows = plan(ref, 12, 1, 3)
    assert len(rows) == 6 and rows[0] == [101, 103, 103] and rows[1] == [103, 105, 105]
    assert plan(ref, 12, 3, 3) == [[101, 102, 103], [105, 106, 107], [109, 110, 111]]
    assert expected_counts(ref, 1, 3, 6, None) == [1] * 6
    # After a divergence at token 5 the harness's drafts no longer fit: no expectation from step 2 on.
    assert expected_counts(ref, 1, 3, 6, 5) == [1, 1, None, None, None, None]


def test_a_policy_can_require_identical_rather_than_a_near_tie() -> None:
    from qualify.policy import compile_condition

    expr = (
        'receipt.checks.exists(c, c.name == "generation" '
        '&& c.conditions.replay_vs_eager.detail == "identical")'
    )
    want_identical = compile_condition("identical_replay", expr)

    def receipt(summary: str) -> dict:
        cond = {"holds": True, "source": "observed", "detail": summary}
        return {"checks": [{"name": "generation", "conditions": {"replay_vs_eager": cond}}]}

    tie = coherence(REFERENCE, TIE, prompts=1, reask=Reask(REF[2:]))["summary"]
    same = coherence(REFERENCE, REFERENCE, prompts=1)["summary"]
    assert want_identical.evaluate(receipt(same)) is None
    assert want_identical.evaluate(receipt(tie)) == "is false"
