"""Bad or hostile policy and import files: empty policies, repeated keys, /dev/zero, deep nesting, huge
integers, absurd ages and CEL that would run for minutes are all one line, exit 2, nothing written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qualify.approve import decide
from qualify.cel import Budget
from qualify.policy import PolicyError, parse_policy_text
from receipts import dsse
from receipts.canonical import canonical_json

from .approve_predicates import predicate
from .conftest import SUBJECT, Log, statement
from .test_cli import run

NESTED_3 = "receipt.checks.all(a, receipt.checks.all(b, receipt.checks.all(c, a.seconds > 0.0)))"


def approve(capsys, log: Log, policy: Path) -> tuple[int, str, str]:
    return run(capsys, "approve", "--policy", str(policy), "--subject", SUBJECT, "--db", log.url)


def assert_refused(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def _refused_and_nothing_written(cli_log: Log, capsys, path: Path, text: str, message: str) -> None:
    cli_log.add()
    before = cli_log.store.counts()
    path.write_text(text)
    assert_refused(*approve(capsys, cli_log, path), message)
    assert cli_log.store.counts() == before


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("empty.toml", "", "is empty"),
        ("comments.toml", "# nothing but a comment\n", "states no requirement"),
        ("empty.yaml", "\n", "is empty"),
        ("comments.yaml", "# only a comment\n", "is empty"),
        ("empty.json", "{}", "states no requirement"),
        ("label.toml", 'name = "fleet"\nmode = "warn"\n', "states no requirement"),
        ("nothing.toml", "[conditions]\n", "states no requirement"),
    ],
)
def test_a_policy_with_no_requirement_is_bad_input(
    cli_log: Log, capsys, tmp_path: Path, name: str, text: str, message: str
) -> None:
    _refused_and_nothing_written(cli_log, capsys, tmp_path / name, text, message)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("deep.json", '{"conditions": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 64 deep"),
        ("deep.yaml", "conditions: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 deep"),
        ("deep.toml", "conditions = " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 deep"),
        ("mid.json", '{"name": ' + "[" * 200 + "]" * 200 + "}", "nested more than 64 deep"),
        ("int.toml", "min_hosts = " + "9" * 5000 + "\n", "digits"),
        ("int.yaml", "min_hosts: " + "9" * 5000 + "\n", "digits"),
        ("int.json", '{"min_hosts": ' + "9" * 5000 + "}", "digits"),
        ("nan.json", '{"min_hosts": NaN}', "NaN is not JSON"),
        ("age.toml", 'max_age = "1000000000d"\n', "longer than 3650d"),
        ("age-digits.toml", f'max_age = "{"9" * 5000}s"\n', "longer than 3650d"),
        ("hosts.toml", "min_hosts = 1000000000\n", "min_hosts"),
        ("cost.toml", f"[conditions]\nslow = '{NESTED_3}'\n", "nests comprehension macros (.all/.exists"),
        ("alias.yaml", "conditions: &c {a: 'true'}\nother: *c\n", "aliases"),
    ],
)
def test_hostile_policy_files_are_one_line_exit_2(
    cli_log: Log, capsys, tmp_path: Path, name: str, text: str, message: str
) -> None:
    _refused_and_nothing_written(cli_log, capsys, tmp_path / name, text, message)


def test_dev_zero_as_a_policy_is_refused_at_once(cli_log: Log, capsys) -> None:
    start = time.monotonic()
    code, out, err = approve(capsys, cli_log, Path("/dev/zero"))
    assert_refused(code, out, err, "larger than 1 MiB")
    assert time.monotonic() - start < 5


def test_dev_zero_as_an_import_file_is_refused_at_once(cli_log: Log, capsys) -> None:
    before = cli_log.store.counts()
    start = time.monotonic()
    code, out, err = run(capsys, "receipts", "import", "/dev/zero", "--db", cli_log.url)
    assert_refused(code, out, err, "larger than 64 MiB")
    assert time.monotonic() - start < 5 and cli_log.store.counts() == before


def _envelope(payload: bytes, log: Log) -> dict:
    return dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, payload, log.key)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested more than 64 deep"),
        ('{"payloadType": "x", "payload": "", "signatures": [], "n": ' + "7" * 5000 + "}", "digits"),
        ('{"payloadType": "x", "payload": "", "signatures": [], "n": NaN}', "NaN"),
    ],
    ids=["deep-file", "long-integer", "nan"],
)
def test_hostile_import_files_are_one_line_exit_2(
    cli_log: Log, capsys, tmp_path: Path, document: str, message: str
) -> None:
    before = cli_log.store.counts()
    (tmp_path / "in.json").write_text(document)
    code, out, err = run(capsys, "receipts", "import", str(tmp_path / "in.json"), "--db", cli_log.url)
    assert_refused(code, out, err, message)
    assert cli_log.store.counts() == before


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than 64 deep"),
        (b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}", "nested more than 64 deep"),
        (b'{"a": ' + b"1" * 5000 + b"}", "digits"),
    ],
    ids=["very-deep", "deep", "long-integer"],
)
def test_a_signed_envelope_with_a_hostile_payload_is_refused_in_one_line(
    cli_log: Log, capsys, tmp_path: Path, payload: bytes, message: str
) -> None:
    before = cli_log.store.counts()
    (tmp_path / "in.json").write_text(json.dumps(_envelope(payload, cli_log)))
    code, out, err = run(capsys, "receipts", "import", str(tmp_path / "in.json"), "--db", cli_log.url)
    assert_refused(code, out, err, message)
    assert cli_log.store.counts() == before


# ---------------------------------------------------------------- duplicate keys


def test_a_repeated_yaml_key_is_refused_naming_the_key_and_its_lines() -> None:
    text = "verdict: qualified\nmin_hosts: 2\nmode: enforce\nmin_hosts: 1\n"
    with pytest.raises(PolicyError, match=r"line 4, column 1: duplicate key 'min_hosts' \(first at line 2\)"):
        parse_policy_text(text, "yaml", "p.yaml")


def test_a_repeated_yaml_condition_is_refused_too() -> None:
    text = "conditions:\n  a: 'true'\n  a: 'false'\n"
    with pytest.raises(PolicyError, match=r"line 3.*duplicate key 'a'"):
        parse_policy_text(text, "yaml", "p.yaml")


def test_a_repeated_json_key_is_refused_naming_the_key_and_its_line() -> None:
    text = '{\n  "min_hosts": 2,\n  "verdict": "qualified",\n  "min_hosts": 1\n}'
    with pytest.raises(PolicyError, match=r"duplicate key 'min_hosts' at line 4"):
        parse_policy_text(text, "json", "p.json")


def test_a_repeated_toml_key_is_refused() -> None:
    with pytest.raises(PolicyError, match="not valid TOML"):
        parse_policy_text("min_hosts = 2\nmin_hosts = 1\n", "toml", "p.toml")


# ---------------------------------------------------------------- CEL cost


def test_two_nested_macros_compile_and_three_do_not() -> None:
    two = "receipt.checks.all(a, receipt.checks.exists(b, b.name == a.name))"
    assert parse_policy_text(f"[conditions]\nok = '{two}'\n", "toml").conditions[0].name == "ok"
    with pytest.raises(PolicyError, match="'slow' does not compile: it nests comprehension macros .* 3 deep"):
        parse_policy_text(f"[conditions]\nslow = '{NESTED_3}'\n", "toml")


def test_chained_macros_are_not_nesting() -> None:
    chained = 'receipt.checks.map(c, c.name).filter(n, n != "boot").all(n, n.size() > 0)'
    assert parse_policy_text(f"[conditions]\nok = '{chained}'\n", "toml").conditions


def test_a_decision_that_spends_its_evaluation_budget_is_refused_not_denied(log: Log) -> None:
    for _ in range(3):
        log.add()
    loaded = parse_policy_text(
        "[conditions]\npairs = 'receipt.checks.all(a, receipt.checks.all(b, b.seconds >= 0.0))'\n", "toml"
    )
    assert decide(log.store, loaded, SUBJECT).decision == "approved"  # the default budget is ample
    from qualify.approve import evaluate, gather

    candidates, size = gather(log.store, SUBJECT)
    start = time.monotonic()
    with pytest.raises(PolicyError, match=r"condition 'pairs' spent the evaluation budget \(500 evaluation"):
        evaluate(loaded, SUBJECT, candidates, tree_size=size, budget=Budget(steps=500))
    assert time.monotonic() - start < 2


def test_the_budget_also_bounds_wall_clock_time() -> None:
    loaded = parse_policy_text(
        "[conditions]\npairs = 'receipt.checks.all(a, receipt.checks.all(b, b.seconds >= 0.0))'\n", "toml"
    )
    checks = [{"name": str(i), "seconds": 1.0} for i in range(400)]
    start = time.monotonic()
    from qualify.cel import CostLimitError

    with pytest.raises(CostLimitError):
        loaded.conditions[0].evaluate({"checks": checks}, Budget(steps=10**9, seconds=0.2))
    assert time.monotonic() - start < 2


# ---------------------------------------------------------------- reasons people can act on


def test_a_missing_field_is_named_with_the_receipt_and_condition(log: Log) -> None:
    rid = log.add()
    loaded = parse_policy_text(
        "[conditions]\nreset = 'receipt.faults.gpu_reset == false && receipt.faults.restart_count == 0'\n",
        "toml",
    )
    decision = decide(log.store, loaded, SUBJECT)
    assert decision.decision == "denied"
    [reason] = [r for r in decision.reasons if rid[:12] in r]
    assert "condition 'reset' could not be evaluated: the receipt has no field receipt.faults.gpu_reset" in (
        reason
    )
    assert "overload" not in reason and "<class" not in reason


def test_a_field_read_through_a_non_object_is_named() -> None:
    loaded = parse_policy_text("[conditions]\nspans = 'receipt.layout.spans == [1]'\n", "toml")
    why = loaded.conditions[0].evaluate({"layout": None})
    assert why == (
        "could not be evaluated: the receipt's field receipt.layout is null, "
        "so receipt.layout.spans cannot be read"
    )


def test_an_approval_keeps_receipts_that_did_not_count_apart_from_its_reasons(log: Log) -> None:
    good = log.add(host="node-a")
    bad = log.add(host="node-b", backend="torch")
    loaded = parse_policy_text("[conditions]\ntriton = 'receipt.backend.resolved == \"triton\"'\n", "toml")
    decision = decide(log.store, loaded, SUBJECT)
    assert decision.decision == "approved" and decision.receipt_ids == [good]
    assert decision.reasons == []
    assert [bad[:12] in note and "'triton' is false" in note for note in decision.ignored] == [True]


def test_a_denial_gives_its_reasons_and_lists_unverifiable_receipts_as_ignored(log: Log) -> None:
    log.add(host="node-a", restarts=1)
    tampered = log.add(host="node-b")
    entry = log.store.entry(2)
    log.raw(
        "UPDATE log_entries SET envelope = ? WHERE idx = ?",
        entry.envelope.replace(b'"payload":"', b'"payload":"X', 1),
        2,
    )
    loaded = parse_policy_text("[conditions]\nno-restarts = 'receipt.faults.restart_count == 0'\n", "toml")
    decision = decide(log.store, loaded, SUBJECT)
    assert decision.decision == "denied"
    assert decision.reasons[0].startswith("0 qualifying receipt(s)")
    assert any("'no-restarts' is false" in r for r in decision.reasons)
    assert all(tampered[:12] not in r for r in decision.reasons)
    assert [tampered[:12] in n and "does not verify" in n for n in decision.ignored] == [True]


def test_statement_payloads_still_parse(log: Log) -> None:
    # The bounded parser accepts every real receipt (integers, floats, nesting of a real predicate).
    payload = canonical_json(statement(SUBJECT, predicate()))
    assert log.store.append_receipt(_envelope(payload, log)).id


def test_a_policy_over_its_budget_stops_the_verification_early(log: Log, monkeypatch) -> None:
    """The policy is applied to each step of verified receipts as it comes: one that spends its budget is
    refused after the first step, without verifying the rest of the fleet's receipts first."""
    import qualify.approve as approve_module

    for n in range(6):
        log.add(host=f"node-{n}", restarts=n)  # distinct predicates: nothing is reused
    monkeypatch.setattr(approve_module, "GATHER_CHUNK", 2)
    steps: list[int] = []
    real = log.store.verify_receipts
    monkeypatch.setattr(
        log.store,
        "verify_receipts",
        lambda records, *a, **k: steps.append(len(records)) or real(records, *a, **k),
    )
    loaded = parse_policy_text(
        "[conditions]\npairs = 'receipt.checks.all(a, receipt.checks.all(b, b.seconds >= 0.0))'\n", "toml"
    )
    with pytest.raises(PolicyError, match="spent the evaluation budget"):
        decide(log.store, loaded, SUBJECT, budget=Budget(steps=200))
    assert steps == [2]
    assert decide(log.store, loaded, SUBJECT).decision == "approved"
    assert steps[1:] == [2, 2, 2]


def test_reused_condition_outcomes_follow_the_fields_each_receipt_has(log: Log) -> None:
    """Outcomes are reused only for the same values of the fields a condition reads."""
    from qualify.cel import _top_fields

    assert _top_fields('receipt.target == "gpu"') == {"target"}
    assert _top_fields('receipt.checks.exists(c, c.name == "receipt")') == {"checks"}
    assert _top_fields('receipt["target"] == "gpu"') is None
    assert _top_fields("receipt.size() > 3") is None
    for n, target in enumerate(["gpu", "cpu", "gpu", "cpu"]):
        log.add(host=f"node-{n}", target=target)
    loaded = parse_policy_text(
        "min_hosts = 2\n[conditions]\ngpu = 'receipt.target == \"gpu\"'\nwhole = 'size(receipt) > 3'\n",
        "toml",
    )
    decision = decide(log.store, loaded, SUBJECT)
    assert [e.counted for e in decision.evaluations] == [True, False, True, False]
    assert decision.decision == "approved" and decision.hosts == ["node-0", "node-2"]
