"""Lying engines about generation, through the real `qualify run` path (local launcher, CPU, tiny preset):
one that ignores speculative=true, one that claims every draft accepted, and one whose zero gaps dress a
changed token as a near tie. Each is rejected by the condition that catches its lie; the honest engine
qualifies with --spec mtp:3 and records an acceptance histogram covering 0..3."""

from __future__ import annotations

import os

import pytest

from .conftest import ROOT, Home, check

pytestmark = pytest.mark.slow


def _run(home: Home, liar: str | None, *args: str) -> tuple[dict, dict]:
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if liar:
        extra["QUALIFY_ENGINE_MODULE"] = f"tests.liars.{liar}"
    ran = home.qualify("run", "--json", *args, env=home.env(**extra), timeout=300)
    assert ran.code in (0, 1), ran.stderr[-2000:]
    (p,) = home.predicates()
    return ran.summary(), p


def _failed(p: dict, name: str) -> dict[str, str]:
    return {k: c["detail"] for k, c in check(p, name)["conditions"].items() if not c["holds"]}


def test_the_honest_engine_qualifies_with_mtp3_and_every_acceptance_length_is_exercised(home: Home) -> None:
    s, p = _run(home, None, "--spec", "mtp:3")
    assert s["verdict"] == "qualified", s
    gen = check(p, "generation")
    hist = gen["evidence"]["acceptance_histogram"]
    assert sorted(hist) == ["0", "1", "2", "3"] and all(hist[k] > 0 for k in hist)
    sources = {k: c["source"] for k, c in gen["conditions"].items()}
    assert sources["speculative_drafts_reproduce_plain"] == sources["speculative_vs_plain"] == "observed"
    assert sources["spec_counters_moved"] == sources["spec_accepts_exactly_j"] == "engine"
    assert sources["spec_claims_match_output"] == "derived"
    drafted = gen["evidence"]["comparisons"]["speculative_drafts"]
    assert [d["j"] for d in drafted] == [0, 1, 2, 3]
    for d in drafted:
        # Every step the harness can predict accepts exactly j: those whose drafts lie inside the plain
        # reference and come before any divergence, a non-empty prefix of the steps. The steps after a stop
        # token in the reference (a run's random prompt and weights can greedily reach one) or after a near
        # tie are unpredictable, and an honest engine may accept fewer there.
        want, claimed = d["expected_per_step"], d["accepted_per_step"]
        known = [w for w in want if w is not None]
        assert known and want[: len(known)] == known == [d["j"]] * len(known), d
        assert claimed[: len(known)] == known, d
    assert gen["evidence"]["comparisons"]["speculative_vs_plain"]["outcome"] == "identical"


def test_an_engine_that_ignores_speculative_is_rejected(home: Home) -> None:
    s, p = _run(home, "spec_ignored", "--spec", "mtp:3")
    assert s["verdict"] == "rejected" and check(p, "generation")["status"] == "fail"
    # Its tokens are plain greedy ones, so the comparisons hold; what it cannot show is speculation.
    assert set(_failed(p, "generation")) == {
        "spec_counters_moved",
        "spec_accepts_exactly_j",
        "spec_claims_match_output",
    }
    assert "spec_drafted +0" in _failed(p, "generation")["spec_counters_moved"]


def test_an_engine_that_claims_every_draft_accepted_is_caught_by_its_own_output(home: Home) -> None:
    s, p = _run(home, "spec_claims_all", "--spec", "mtp:3")
    assert s["verdict"] == "rejected"
    failed = _failed(p, "generation")
    # Its counters and its per-step reports agree with each other; the drafts it says it accepted (one of
    # them altered by the harness) are not in the tokens it returned.
    assert "spec_counters_moved" not in failed
    assert "not those drafts" in failed["spec_claims_match_output"]
    assert "spec_accepts_exactly_j" in failed


def test_zero_gaps_dressing_a_changed_token_as_a_near_tie_are_rejected_by_teacher_forcing(home: Home) -> None:
    s, p = _run(home, "zero_gaps", "--spec", "mtp:3")
    assert s["verdict"] == "rejected"
    reload_failed = _failed(p, "reload")
    detail = reload_failed["output_same_after_same_reload"]
    assert detail.startswith("differs") and "diverges again" in detail
    assert "replay_after_reload_equals_fresh_eager" in reload_failed
    assert _failed(p, "generation")["before_vs_after_reload"].startswith("differs")
    same = check(p, "reload")["evidence"]["before_vs_after_same_reload"]
    assert same["outcome"] == "differs" and same["per_prompt"][0]["first_divergence"] == 1


@pytest.mark.gpu
def test_stale_graphs_behind_zero_gaps_are_rejected_on_a_gpu(home: Home) -> None:
    s, p = _run(home, "stale_graphs", "--preset", "proxy", "--timeout", "280")
    assert s["verdict"] == "rejected", s
    failed = _failed(p, "reload")
    # The graphs replay the old weights while an eager step runs the new ones: the harness's own
    # comparison differs, whatever gaps and runner-ups the engine reports.
    reload = {k: v for k, v in check(p, "reload").items() if k != "evidence"}
    assert failed.get("other_weights_replay_equals_eager", "").startswith("differs"), reload


def test_an_engine_whose_every_reference_stops_at_once_earns_no_acceptance_length(home: Home) -> None:
    # Nothing a drafted step must accept can be predicted on any prompt: the harness tries three, then
    # refuses to credit the acceptance lengths it never saw, whatever the engine says it accepted.
    s, p = _run(home, "always_stops", "--spec", "mtp:3")
    assert s["verdict"] == "rejected"
    failed = _failed(p, "generation")
    assert "acceptance histogram" in failed["spec_accepts_exactly_j"]
    comparisons = check(p, "generation")["evidence"]["comparisons"]
    assert len(comparisons["speculative_drafts_set_aside"]) == 2  # three prompts tried in all
    for one in [*comparisons["speculative_drafts_set_aside"], comparisons["speculative_drafts"]]:
        assert all(w is None for d in one for w in d["expected_per_step"])
