"""The verdict policy: only listed skips are acceptable for a target; failures reject; interruption aborts."""

from __future__ import annotations

from typing import Any

from qualify.run.verdict import (
    ACCEPTABLE_SKIPS,
    REQUIRED_CHECKS,
    REQUIRED_MONITORED,
    REQUIRED_OBSERVED,
    judge,
)


def _observed_conditions(check: str) -> dict[str, dict[str, Any]]:
    """One holding condition for each GPU-required pattern of `check` (a '*' becomes 'x'): observed, or
    monitored for the monitor's."""
    out = {}
    for patterns, source in (
        (REQUIRED_OBSERVED["gpu"], "observed"),
        (REQUIRED_MONITORED["gpu"], "monitored"),
    ):
        for pattern in patterns:
            name, cond = pattern.split(".", 1)
            if name == check:
                out[cond.replace("*", "x")] = {"holds": True, "source": source, "detail": None}
    return out


ALL_PASS = [{"name": n, "status": "pass", "conditions": _observed_conditions(n)} for n in REQUIRED_CHECKS]


def with_status(name: str, status: str) -> list[dict[str, Any]]:
    return [{**r, "status": status} if r["name"] == name else r for r in ALL_PASS]


def with_condition(check: str, cond: str, **fields: Any) -> list[dict[str, Any]]:
    out = []
    for r in ALL_PASS:
        if r["name"] == check:
            conds = dict(r["conditions"])
            conds[cond] = {**conds.get(cond, {"holds": True, "source": "observed", "detail": None}), **fields}
            r = {**r, "conditions": conds}
        out.append(r)
    return out


def test_a_gpu_condition_that_rests_on_the_engines_word_does_not_qualify() -> None:
    j = judge(with_condition("layout", "spans_equal_request", source="engine"), "gpu")
    assert j.verdict == "rejected"
    assert j.reasons == ["not observed: layout.spans_equal_request: source is engine, observed required"]
    # A CPU target demands no observation of these conditions (its receipt proves less; policies decide).
    assert (
        judge(with_condition("layout", "spans_equal_request", source="engine"), "cpu").verdict == "qualified"
    )


def test_a_required_condition_that_is_missing_does_not_pass_by_absence() -> None:
    results = [{**r, "conditions": {}} if r["name"] == "faults" else r for r in ALL_PASS]
    j = judge(results, "gpu")
    assert j.verdict == "rejected"
    assert "not observed: faults.no_restarts: no such condition in the run" in j.reasons


def test_every_target_requires_each_intervention_condition_by_name() -> None:
    # Dropping one intervention condition (the engine answered no sessions, a check changed) cannot pass by
    # absence, on a CPU target too; and one labelled as the engine's word is not evidence.
    for target in ("cpu", "gpu"):
        results = [
            {
                **r,
                "conditions": {
                    k: v for k, v in r["conditions"].items() if k != "intervention_others_unchanged"
                },
            }
            for r in ALL_PASS
        ]
        j = judge(results, target)
        assert j.verdict == "rejected"
        assert "not observed: layout.intervention_others_unchanged: no such condition in the run" in j.reasons
        j = judge(with_condition("layout", "intervention_swap_exchanges_outputs", source="engine"), target)
        assert j.reasons == [
            "not observed: layout.intervention_swap_exchanges_outputs: source is engine, observed required"
        ]


def test_faults_seen_after_the_faults_check_reject_the_run() -> None:
    j = judge(ALL_PASS, "gpu", faults=["engine restarted 1 time(s)"])
    assert j.verdict == "rejected"
    assert j.reasons == ["fault: engine restarted 1 time(s)"]
    aborted = judge(ALL_PASS[:2], "gpu", interrupted="received SIGTERM", faults=["fatal Xid 79"])
    assert aborted.verdict == "aborted" and aborted.reasons == ["received SIGTERM", "fault: fatal Xid 79"]


def test_all_pass_qualifies() -> None:
    assert judge(ALL_PASS, "gpu").verdict == "qualified"


def test_capture_skip_qualifies_a_cpu_target_only() -> None:
    assert "capture" in ACCEPTABLE_SKIPS["cpu"]
    assert judge(with_status("capture", "skip"), "cpu").verdict == "qualified"
    gpu = judge(with_status("capture", "skip"), "gpu")
    assert gpu.verdict == "rejected" and "capture" in gpu.reasons[0]


def test_a_skip_that_is_not_listed_rejects_even_on_cpu() -> None:
    assert judge(with_status("reload", "skip"), "cpu").verdict == "rejected"


def test_fail_or_error_rejects() -> None:
    assert judge(with_status("layout", "fail"), "cpu").verdict == "rejected"
    assert judge(with_status("faults", "error"), "gpu").reasons == ["faults: error"]


def test_missing_checks_reject() -> None:
    j = judge(ALL_PASS[:3], "cpu")
    assert j.verdict == "rejected" and "checks not run" in j.reasons[-1]


def test_interrupted_run_is_aborted() -> None:
    j = judge(ALL_PASS[:2], "cpu", interrupted="received SIGTERM")
    assert j.verdict == "aborted" and j.reasons == ["received SIGTERM"]


def test_a_status_the_policy_does_not_know_rejects() -> None:
    j = judge(with_status("capture", "passed?"), "gpu")
    assert j.verdict == "rejected" and j.reasons == ["capture: passed?"]


def test_a_target_without_a_policy_allows_no_skip() -> None:
    assert judge(with_status("capture", "skip"), "tpu").verdict == "rejected"


def test_engine_reported_speculation_sits_beside_the_observed_generation_conditions() -> None:
    # The engine's draft counters and per-step counts are its word (spec_*): they may be `engine` on a GPU
    # target, while every generation comparison the harness made itself must be observed.
    spec = with_condition("generation", "spec_counters_moved", source="engine")
    gen = next(r for r in spec if r["name"] == "generation")
    gen["conditions"]["speculative_drafts_reproduce_plain"] = {"holds": True, "source": "observed"}
    assert judge(spec, "gpu").verdict == "qualified"
    for cond in ("deterministic", "replay_vs_eager", "before_vs_after_reload", "tokens_generated"):
        j = judge(with_condition("generation", cond, source="engine"), "gpu")
        assert j.reasons == [f"not observed: generation.{cond}: source is engine, observed required"]


def test_speculative_comparisons_must_be_observed_where_the_run_has_them() -> None:
    # Absent (a run without --spec) they are not demanded; present, they must hold and be observed.
    assert judge(ALL_PASS, "gpu").verdict == "qualified"
    j = judge(with_condition("generation", "speculative_vs_plain", source="derived"), "gpu")
    assert j.reasons == [
        "not observed: generation.speculative_vs_plain: source is derived, observed required"
    ]
    j = judge(with_condition("generation", "speculative_drafts_reproduce_plain", holds=False), "gpu")
    assert j.reasons == ["not observed: generation.speculative_drafts_reproduce_plain: does not hold"]


def test_a_gpu_target_requires_the_harness_timing_and_the_fresh_engine_comparisons() -> None:
    for check, cond in (
        ("capture", "graph_steps_faster_than_eager"),
        ("reload", "after_same_reload_equals_a_fresh_engine"),
        ("reload", "restored_equals_a_fresh_engine"),
    ):
        results = [
            {**r, "conditions": {k: v for k, v in r["conditions"].items() if k != cond}}
            if r["name"] == check
            else r
            for r in ALL_PASS
        ]
        assert judge(results, "gpu").reasons == [
            f"not observed: {check}.{cond}: no such condition in the run"
        ]
        assert judge(results, "cpu").verdict == "qualified"
    # Speculation's timing, where the run has it (--spec), must hold and be observed on a GPU too.
    slow = with_condition("generation", "speculative_all_accepted_takes_fewer_steps", holds=False)
    assert judge(slow, "gpu").reasons == [
        "not observed: generation.speculative_all_accepted_takes_fewer_steps: does not hold"
    ]
