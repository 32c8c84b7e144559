"""The timing rules (qualify/checks/timing.py) on recorded and synthetic numbers: graph steps must beat the
bound derived from the measured eager step; all-accepted drafts must finish in measurably fewer steps than
plain decoding, near the ratio the measured step times predict."""

from __future__ import annotations

import pytest

from qualify.checks.timing import graph_rule, per_step, spec_rule, spec_steps


def test_per_step_time_is_taken_by_difference() -> None:
    assert per_step([0.010, 0.012], [0.026, 0.030], 16) == pytest.approx([0.001, 0.001125])


def test_graph_steps_must_beat_the_eager_bound() -> None:
    ok, facts = graph_rule(eager=[1.0e-3, 1.1e-3, 0.9e-3], graph=[0.2e-3, 0.25e-3, 0.21e-3])
    assert ok and facts["speedup"] > 4 and facts["bound_s"] == pytest.approx(0.7e-3)  # 3 MADs
    # Eager steps called "graph": the same speed within noise.
    bad, facts = graph_rule(eager=[1.0e-3, 1.1e-3, 0.9e-3], graph=[0.98e-3, 1.02e-3, 0.95e-3])
    assert not bad and facts["graph_step_s"] > facts["bound_s"]
    # A few per cent faster is not measurably faster.
    assert not graph_rule(eager=[1.0e-3] * 3, graph=[0.95e-3] * 3)[0]
    # Noisy eager samples widen the bound.
    assert not graph_rule(eager=[1.0e-3, 1.5e-3, 0.5e-3], graph=[0.7e-3] * 3)[0]
    assert not graph_rule(eager=[], graph=[1e-4])[0]


def test_step_counts_of_speculation() -> None:
    assert spec_steps(12, 0) == 11 and spec_steps(12, 3) == 3 and spec_steps(12, 1) == 6


def _spec(every: list[float], none: list[float]) -> tuple[bool, dict]:
    # Synthetic request times in the range measured on the 2-core CPU machine (tiny preset, mtp:3, 12 tokens).
    return spec_rule(first=[0.030, 0.031], plain=[0.140, 0.150], none=none, every=every, max_tokens=12,
                     num_spec=3)  # fmt: skip


def test_all_accepted_drafts_must_take_fewer_steps_by_wall_time() -> None:
    ok, facts = _spec(every=[0.066, 0.070], none=[0.170, 0.180])
    assert ok and facts["steps"] == {"plain": 11, "all_accepted": 3}
    assert facts["measured_ratio"] == pytest.approx(0.036 / 0.110)
    assert facts["expected_ratio"] == pytest.approx(3 * (0.140 / 11) / 0.110)


def test_speculation_simulated_on_plain_decoding_takes_as_long_as_plain_decoding() -> None:
    # Decoding plainly, whatever it reports: all-accepted, none-accepted and plain take the same time.
    bad, facts = _spec(every=[0.138, 0.142], none=[0.139, 0.141])
    assert not bad and facts["measured_ratio"] > 0.9
    # Faster than plain, but far slower than the step counts predict (a partial fake) is refused too.
    partial, facts = _spec(every=[0.100, 0.101], none=[0.140, 0.141])
    assert (
        not partial
        and facts["measured_ratio"] < 0.8
        and facts["measured_ratio"] > 1.5 * facts["expected_ratio"] + 0.1
    )
    assert not spec_rule(first=[], plain=[1.0], none=[1.0], every=[1.0], max_tokens=12, num_spec=3)[0]
