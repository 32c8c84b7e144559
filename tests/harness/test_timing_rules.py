"""The timing rules (qualify/checks/timing.py) on recorded and synthetic numbers: graph steps must beat the
bound derived from the measured eager step; all-accepted drafts must finish in measurably fewer steps than
plain decoding, near the ratio the measured step times predict."""

from __future__ import annotations

import itertools
import random

import pytest

from qualify.checks.timing import graph_decision, graph_rule, per_step, rank_p_value, spec_rule, spec_steps


def test_per_step_time_is_taken_by_difference() -> None:
    assert per_step([0.010, 0.012], [0.026, 0.030], 16) == pytest.approx([0.001, 0.001125])


def test_graph_steps_must_beat_the_eager_bound() -> None:
    ok, facts = graph_rule(
        eager=[1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3, 1.05e-3], graph=[0.2e-3, 0.25e-3, 0.21e-3, 0.2e-3, 0.22e-3]
    )
    assert ok and facts["speedup"] > 4 and facts["bound_s"] == pytest.approx(0.9e-3)
    assert facts["rank_p"] == pytest.approx(1 / 252)  # every graph sample below every eager one
    # Eager steps called "graph": the same speed within noise.
    bad, facts = graph_rule(eager=[1.0e-3, 1.1e-3, 0.9e-3] * 2, graph=[0.98e-3, 1.02e-3, 0.95e-3] * 2)
    assert not bad and facts["graph_step_s"] > facts["bound_s"]
    # A few per cent faster is not measurably faster, however steady.
    assert not graph_rule(eager=[1.0e-3] * 5, graph=[0.95e-3] * 5)[0]
    # Faster by the medians but not by ranks: the samples overlap.
    bad, facts = graph_rule(
        eager=[1.0e-3, 1.5e-3, 0.5e-3, 1.2e-3, 0.6e-3], graph=[0.7e-3, 0.4e-3, 0.8e-3] * 2
    )
    assert not bad and facts["graph_step_s"] < facts["bound_s"] and facts["rank_p"] > 0.01
    # Three samples each can never be enough: all separated is p = 1/20.
    assert not graph_rule(eager=[1.0e-3] * 3, graph=[0.1e-3] * 3)[0]
    assert not graph_rule(eager=[], graph=[1e-4])[0]


def test_the_rank_p_value_is_the_exact_permutation_probability() -> None:
    rng = random.Random(12)
    for _ in range(30):
        faster = [rng.random() for _ in range(rng.randint(1, 5))]
        slower = [rng.random() for _ in range(rng.randint(1, 5))]
        u = sum(f < x for f in faster for x in slower)
        pooled, m = faster + slower, len(faster)
        hits = total = 0
        for idx in itertools.combinations(range(len(pooled)), m):
            a = [pooled[i] for i in idx]
            b = [pooled[i] for i in range(len(pooled)) if i not in idx]
            total += 1
            hits += sum(f < x for f in a for x in b) >= u
        assert rank_p_value(faster, slower) == pytest.approx(hits / total)
    assert rank_p_value([1.0] * 33, [2.0] * 33) == 1.0  # beyond the cost bound: no evidence


def _sampler(eager: list[float], graph: list[float]):
    """sample(rounds) handing out the next recorded samples, as step_times would measure them."""
    asked: list[int] = []

    def sample(rounds: int) -> dict[str, list[float]]:
        at = sum(asked)
        asked.append(rounds)
        return {"eager": eager[at : at + rounds], "graph": graph[at : at + rounds]}

    return sample, asked


def test_jittered_first_rounds_are_decided_with_more_rounds() -> None:
    # An honest engine on a loaded host: eager samples spread from 6 to 12 ms, and one taken by difference
    # of two requests came out below the graph steps (the short request slowed): the ranks of the first
    # five overlap (p 0.075); four more rounds decide it on all nine.
    eager = [6.2e-3, 9.0e-3, 0.58e-3, 11.9e-3, 9.4e-3, 9.5e-3, 10.1e-3, 9.8e-3, 10.4e-3]
    graph = [0.62e-3, 0.60e-3, 0.65e-3, 0.6e-3, 0.61e-3] + [0.6e-3] * 4
    sample, asked = _sampler(eager, graph)
    ok, facts = graph_decision(sample)
    assert ok and asked == [5, 4] and facts["rounds"] == 9 and len(facts["eager_samples_s"]) == 9
    assert facts["first_rounds"]["rank_p"] > 0.01 >= facts["rank_p"]
    # Decided in the first rounds: no more are taken.
    sample, asked = _sampler([1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3, 1.0e-3], [0.2e-3] * 5)
    assert graph_decision(sample)[0] and asked == [5]


def test_an_engine_at_eager_speed_rarely_passes_on_any_host() -> None:
    # Graph steps drawn like eager ones, on quiet to very jittered hosts: the two looks at the rank test
    # bound how often it passes (the rule before it, three rounds and a 3-MAD bound, passed 19% of these).
    rng = random.Random(26)
    for spread in (0.02, 0.1, 0.4, 1.0):
        passed = 0
        for _ in range(1000):
            eager = [1e-3 * (1 + rng.uniform(-spread, spread)) for _ in range(9)]
            graph = [1e-3 * (1 + rng.uniform(-spread, spread)) for _ in range(9)]
            sample, asked = _sampler(eager, graph)
            ok, facts = graph_decision(sample)
            passed += ok
            assert ok or (asked == [5, 4] and facts["rounds"] == 9)
        assert passed <= 30, (spread, passed)


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


def test_a_sample_is_the_fastest_of_two_pairs_each_on_fresh_prompts() -> None:
    """capture.step_times: a host pause in one request moves no sample (the fastest short and long of two
    pairs), each pair sends prompts of its own (no request repeats another's: a cache cannot answer it),
    and both requests of a pair send the same prompts (prefill cancels)."""
    from types import SimpleNamespace

    from qualify.checks import capture

    now = [0.0]
    sent: list[tuple[str, tuple, int]] = []
    drawn = iter(range(10_000))

    def fresh(n: int) -> list[str]:
        return [f"prompt {next(drawn)}" for _ in range(n)]

    def generate(prompts, *, mode, max_tokens):  # type: ignore[no-untyped-def]
        sent.append((mode, tuple(prompts), max_tokens))
        step = 6e-3 if mode == "eager" else 1.5e-3
        now[0] += 0.05 + max_tokens * step + (0.06 if len(sent) == 4 else 0.0)  # one long request paused

    ctx = SimpleNamespace(fresh=fresh, generate=generate, clock=lambda: now[0])
    got = capture.step_times(ctx, 8, 3)  # type: ignore[arg-type]
    assert got["eager"] == pytest.approx([6e-3] * 3) and got["graph"] == pytest.approx([1.5e-3] * 3)
    assert len(sent) == 3 * 2 * capture.PAIRS_PER_SAMPLE * 2
    pairs = [sent[i : i + 2] for i in range(0, len(sent), 2)]
    assert all(a[1] == b[1] and (a[2], b[2]) == (capture.SHORT_TOKENS, capture.LONG_TOKENS) for a, b in pairs)
    assert len({a[1] for a, _ in pairs}) == len(pairs)  # every pair on prompts of its own
