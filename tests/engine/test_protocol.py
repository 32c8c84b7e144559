"""The shared protocol: the coherence rule and request validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qualify.protocol import CompletionRequest, ReloadRequest, compare_greedy


def test_identical_runs_agree_with_no_divergence():
    r = compare_greedy([1, 2, 3], [1.0, 2.0, 3.0], [1, 2, 3], epsilon=0.1)
    assert r.agrees and r.first_divergence is None and r.gap is None
    assert "epsilon=0.1" in r.rule


def test_difference_at_a_near_tie_agrees_and_reports_the_gap():
    r = compare_greedy([1, 2, 3], [1.0, 0.05, 3.0], [1, 7, 9], epsilon=0.1)
    assert r.agrees and r.first_divergence == 1 and r.gap == pytest.approx(0.05)


def test_difference_at_a_clear_choice_disagrees():
    r = compare_greedy([1, 2, 3], [1.0, 0.5, 3.0], [1, 7, 3], epsilon=0.1)
    assert not r.agrees and r.first_divergence == 1 and r.gap == pytest.approx(0.5)


def test_gap_equal_to_epsilon_is_not_a_near_tie():
    assert not compare_greedy([1, 2], [0.1, 0.1], [2, 2], epsilon=0.1).agrees


def test_length_mismatch_is_a_divergence_without_a_gap():
    r = compare_greedy([1, 2], [1.0, 1.0], [1, 2, 3], epsilon=10.0)
    assert not r.agrees and r.first_divergence == 2 and r.gap is None


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
