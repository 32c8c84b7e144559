"""examples/fleet.toml and `require_observed`: a policy can demand that named conditions were observed by
the harness; the example fleet policy denies a CPU receipt even with min_hosts = 1 and approves qualified
GPU receipts that carry their key conditions observed (signed receipts in a real store)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from qualify.approve import decide
from qualify.policy import PolicyError, load_policy_data, parse_policy_text

from .conftest import SUBJECT, Log

FLEET = Path(__file__).parents[2] / "examples" / "fleet.toml"


def fleet(**overrides: object):
    text = FLEET.read_text()
    return load_policy_data({**tomllib.loads(text), **overrides}, "fleet.toml", text)


def test_fleet_denies_a_cpu_receipt_even_with_one_host(log: Log) -> None:
    rid = log.add(target="cpu")
    decision = decide(log.store, fleet(min_hosts=1), SUBJECT)
    assert decision.decision == "denied"
    (evaluation,) = decision.evaluations
    assert evaluation.receipt_id == rid and not evaluation.counted
    failures = evaluation.failures
    assert any(f.startswith("condition 'gpu-target' is false") for f in failures), failures
    assert "require_observed 'capture.replay_equals_eager': no such condition in the receipt" in failures
    assert "require_observed 'faults.xid_watched': no such condition in the receipt" in failures


def test_fleet_approves_qualified_gpu_receipts_with_observed_conditions(log: Log) -> None:
    one = log.add(host="gpu-1")
    assert decide(log.store, fleet(min_hosts=1), SUBJECT).decision == "approved"
    two = log.add(host="gpu-2")
    decision = decide(log.store, fleet(), SUBJECT)  # min_hosts = 2 as written
    assert decision.decision == "approved", decision.reasons
    assert sorted(decision.receipt_ids) == sorted([one, two]) and decision.hosts == ["gpu-1", "gpu-2"]


@pytest.mark.parametrize("sandbox", [False, None])
def test_fleet_denies_a_receipt_of_an_unsandboxed_engine(log: Log, sandbox: bool | None) -> None:
    log.add(sandbox=sandbox)  # `qualify run --no-sandbox`, or a receipt from before the sandbox
    decision = decide(log.store, fleet(min_hosts=1), SUBJECT)
    assert decision.decision == "denied"
    assert any(f.startswith("condition 'sandboxed' is false") for f in decision.evaluations[0].failures)


def test_a_required_condition_on_the_engines_word_does_not_count(log: Log) -> None:
    log.add(sources={"layout.spans_equal_request": "engine", "layout.peer_ok": "derived"})
    decision = decide(log.store, fleet(min_hosts=1), SUBJECT)
    assert decision.decision == "denied"
    assert decision.evaluations[0].failures == [  # in the policy's pattern order
        "require_observed layout.spans_equal_request: source is engine, the policy requires observed",
        "require_observed layout.peer_ok: source is derived, the policy requires observed",
    ]


def test_a_pattern_that_matches_nothing_denies_rather_than_passing_by_absence(log: Log) -> None:
    log.add()
    loaded = parse_policy_text('require_observed = ["layout.*", "peer.echoed_pattern"]\n', "toml")
    (evaluation,) = decide(log.store, loaded, SUBJECT).evaluations
    assert evaluation.failures == ["require_observed 'peer.echoed_pattern': no such condition in the receipt"]


@pytest.mark.parametrize("pattern", ["layout", "layout.", "a.b.c d", "layout.{x}", ""])
def test_a_malformed_pattern_is_refused_naming_it(pattern: str) -> None:
    with pytest.raises(PolicyError, match="require_observed"):
        parse_policy_text(f"require_observed = [{pattern!r}]\n".replace("'", '"'), "toml")


def test_a_policy_without_require_observed_keeps_its_digest() -> None:
    from receipts.canonical import sha256_hex

    loaded = parse_policy_text('name = "x"\nmin_hosts = 2\n', "toml")
    optional = ("require_observed", "require_monitored")
    before = {k: v for k, v in loaded.policy.model_dump(mode="json").items() if k not in optional}
    assert loaded.digest == "sha256:" + sha256_hex(before)
    assert parse_policy_text('name = "x"\nmin_hosts = 2\nrequire_observed = ["a.b"]\n', "toml").digest != (
        loaded.digest
    )


def test_the_fleet_requires_the_monitored_conditions_from_the_monitor(log: Log) -> None:
    log.add(sources={"monitor.capture_every_size_replayed_its_graph": "engine"})
    (evaluation,) = decide(log.store, fleet(min_hosts=1), SUBJECT).evaluations
    assert evaluation.failures == [
        "require_monitored monitor.capture_every_size_replayed_its_graph: source is engine, the policy "
        "requires monitored or observed"
    ]


def test_a_cpu_receipt_has_no_monitored_conditions_and_the_fleet_says_so(log: Log) -> None:
    log.add(target="cpu")
    (evaluation,) = decide(log.store, fleet(min_hosts=1), SUBJECT).evaluations
    assert "require_monitored 'monitor.capture_*': no such condition in the receipt" in evaluation.failures


def test_require_monitored_accepts_observed_and_refuses_a_malformed_pattern(log: Log) -> None:
    log.add(sources={"monitor.reload_same_graphs_replayed": "observed"})
    loaded = parse_policy_text('require_monitored = ["monitor.reload_*"]\n', "toml")
    (evaluation,) = decide(log.store, loaded, SUBJECT).evaluations
    assert evaluation.failures == []
    with pytest.raises(PolicyError, match="require_monitored"):
        parse_policy_text('require_monitored = ["monitor"]\n', "toml")
