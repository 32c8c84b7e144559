"""The verdict policy: only listed skips are acceptable for a target; failures reject; interruption aborts."""

from __future__ import annotations

from qualify.run.verdict import ACCEPTABLE_SKIPS, REQUIRED_CHECKS, judge

ALL_PASS = [(name, "pass") for name in REQUIRED_CHECKS]


def with_status(name: str, status: str) -> list[tuple[str, str]]:
    return [(n, status if n == name else s) for n, s in ALL_PASS]


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
