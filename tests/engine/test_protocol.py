"""The shared protocol: the coherence rule and request validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qualify.protocol import CompletionRequest, ReloadRequest, compare_greedy


def test_identical_runs_agree_with_no_divergence():
    r = compare_greedy([1, 2, 3], [1.0, 2.0, 3.0], [1, 2, 3], epsilon=0.1)
    assert r.agrees and r.outcome == "identical" and r.first_divergence is None and r.gap is None
    assert "epsilon=0.1" in r.rule


# Reference [1, 2, 3, 4] and candidate [1, 7, ...]: token 1 is a near tie between 2 and 7 when both runs
# report that pair, swapped, with gaps below epsilon.
REF, REF_GAPS, REF_TOP2 = [1, 2, 3, 4], [1.0, 0.01, 2.0, 2.0], [[1, 5], [2, 7], [3, 0], [4, 0]]
CAND, CAND_GAPS, CAND_TOP2 = [1, 7, 9, 9], [1.0, 0.02, 2.0, 2.0], [[1, 5], [7, 2], [9, 0], [9, 0]]


def near_tie(**changes):
    kw = {
        "reference_top2": REF_TOP2,
        "candidate_gaps": CAND_GAPS,
        "candidate_top2": CAND_TOP2,
        "forced_continuation": [3, 4],
    } | changes
    return compare_greedy(REF, REF_GAPS, CAND, 0.1, **kw)


def test_a_near_tie_both_runs_report_and_teacher_forcing_confirms_agrees_as_near_tie():
    r = near_tie()
    assert r.agrees and r.outcome == "near_tie" and r.forcing == "identical"
    assert r.first_divergence == 1 and r.gap == pytest.approx(0.01) and r.candidate_gap == pytest.approx(0.02)


def test_a_near_tie_over_a_different_token_pair_differs():
    r = near_tie(candidate_top2=[[1, 5], [7, 8], [9, 0], [9, 0]])
    assert not r.agrees and r.outcome == "differs" and "swapped pair" in r.reason


def test_a_gap_claimed_by_one_side_only_differs():
    # The reference reports a near tie, the candidate a clear choice (or the other way round): no tie.
    assert near_tie(candidate_gaps=[1.0, 0.5, 2.0, 2.0]).outcome == "differs"
    assert (
        compare_greedy(
            REF,
            [1.0, 0.5, 2.0, 2.0],
            CAND,
            0.1,
            reference_top2=REF_TOP2,
            candidate_gaps=CAND_GAPS,
            candidate_top2=CAND_TOP2,
            forced_continuation=[3, 4],
        ).outcome
        == "differs"
    )
    # The old rule's hole: the reference's gap alone (no candidate evidence) never makes a near tie.
    r = compare_greedy(REF, REF_GAPS, CAND, 0.1)
    assert not r.agrees and r.gap == pytest.approx(0.01) and "no top-2 token ids" in r.reason


def test_zero_gaps_reported_by_both_sides_do_not_hide_a_different_pair():
    # A stale engine that reports gaps of 0.0 everywhere still has to report the swapped pair.
    zeros = [0.0] * 4
    r = compare_greedy(
        REF,
        zeros,
        CAND,
        0.1,
        reference_top2=REF_TOP2,
        candidate_gaps=zeros,
        candidate_top2=[[t, 0] for t in CAND],
        forced_continuation=[3, 4],
    )
    assert r.outcome == "differs" and "swapped pair" in r.reason


def test_a_second_divergence_after_teacher_forcing_differs():
    r = near_tie(forced_continuation=[3, 5])
    assert not r.agrees and r.forcing == "diverged" and "again at token 3" in r.reason
    assert near_tie(forced_continuation=[3]).forcing == "diverged"  # a shorter continuation too


def test_a_near_tie_without_teacher_forcing_is_not_confirmed_unless_it_is_the_last_token():
    r = near_tie(forced_continuation=None)
    assert not r.agrees and r.forcing == "missing"
    last = compare_greedy(
        [1, 2],
        [1.0, 0.01],
        [1, 7],
        0.1,
        reference_top2=[[1, 0], [2, 7]],
        candidate_gaps=[1.0, 0.01],
        candidate_top2=[[1, 0], [7, 2]],
    )
    assert last.agrees and last.outcome == "near_tie" and last.forcing == "not_needed"


def test_difference_at_a_clear_choice_disagrees():
    r = near_tie(candidate_gaps=[1.0, 0.5, 2.0, 2.0])
    assert not r.agrees and r.first_divergence == 1 and r.candidate_gap == pytest.approx(0.5)


def test_gap_equal_to_epsilon_is_not_a_near_tie():
    r = compare_greedy(
        [1, 2],
        [0.1, 0.1],
        [2, 2],
        epsilon=0.1,
        reference_top2=[[1, 2], [2, 0]],
        candidate_gaps=[0.1, 0.1],
        candidate_top2=[[2, 1], [2, 0]],
        forced_continuation=[2],
    )
    assert not r.agrees and "below epsilon" in r.reason


@pytest.mark.parametrize(
    ("ref_gap", "cand_gap", "agrees"),
    [
        (0.0017, 0.084, True),  # the H200's b12x replay vs eager: numerics within epsilon explain it
        (0.00135, 0.0567, True),  # a b12x fresh reference against the engine (tests/data/monitor)
        (0.04, 0.04, True),
        (0.03, 0.08, False),  # the sum is 2 x epsilon or more
        (0.0, 0.1, False),  # the candidate's gap alone at 2 x epsilon
        (0.06, 0.0, False),  # the reference is no near tie, whatever the candidate reports
    ],
)
def test_a_swap_agrees_when_the_gaps_sum_below_twice_epsilon(ref_gap, cand_gap, agrees):
    r = compare_greedy(
        [1, 2],
        [ref_gap, 1.0],
        [2, 2],
        epsilon=0.05,
        reference_top2=[[1, 2], [2, 0]],
        candidate_gaps=[cand_gap, 1.0],
        candidate_top2=[[2, 1], [2, 0]],
        forced_continuation=[2],
    )
    assert r.agrees is agrees, r.reason
    assert agrees or "epsilon" in r.reason


def test_length_mismatch_is_a_divergence_without_a_gap():
    r = compare_greedy([1, 2], [1.0, 1.0], [1, 2, 3], epsilon=10.0)
    assert not r.agrees and r.outcome == "differs" and r.first_divergence == 2 and r.gap is None


def test_negative_epsilon_is_refused():
    with pytest.raises(ValueError):
        compare_greedy([1], [1.0], [1], epsilon=-1.0)


@pytest.mark.parametrize(
    "prompt,expected",
    [("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_every_prompt_shape_becomes_a_batch(prompt, expected):
    assert CompletionRequest(prompt=prompt, max_tokens=1).prompts() == expected


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [], "max_tokens": 1},
        {"prompt": [[]], "max_tokens": 1},
        {"prompt": [-1], "max_tokens": 1},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": 1, "mode": "fast"},
        {"prompt": "x", "max_tokens": 1, "temperature": 0.7},
        {"max_tokens": 1},
    ],
)
def test_malformed_completion_requests_are_refused(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_reload_request_refuses_unknown_fields():
    with pytest.raises(ValidationError):
        ReloadRequest.model_validate({"file": "x"})


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"prompt": "x", "max_tokens": 4, "drafts": [[1, 2, 3]]}, "speculative=true"),
        ({"prompt": ["x", "y"], "max_tokens": 4, "speculative": True, "drafts": [[1, 2, 3]]}, "batch of one"),
        ({"prompt": "x", "max_tokens": 1, "speculative": True, "drafts": [[1], [2]]}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4, "speculative": True, "drafts": [[]]}, "1 to 64"),
        ({"prompt": "x", "max_tokens": 4, "speculative": True, "drafts": [[-1]]}, "non-negative"),
    ],
)
def test_drafts_must_say_exactly_what_one_speculative_request_verifies(fields, needle):
    with pytest.raises(ValidationError, match=needle):
        CompletionRequest(**fields)
    ok = CompletionRequest(prompt=[[256, 65]], max_tokens=4, speculative=True, drafts=[[1, 2, 3]])
    assert ok.drafts == [[1, 2, 3]]
