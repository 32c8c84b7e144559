"""Policy files: TOML/YAML/JSON parse to the same policy, and anything malformed is refused with its place."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from qualify.policy import PolicyError, load_policy, parse_duration, parse_policy_text, policy_json_schema

TOML = """\
name = "fleet"
verdict = "qualified"
max_age = "7d"
min_hosts = 2
mode = "enforce"

[conditions]
layout = 'receipt.layout.spans == [2304, 2304, 2304, 9216]'
no-restarts = 'receipt.faults.restart_count == 0'
no-fatal-xid = 'receipt.faults.xid_events.all(x, !x.fatal)'
backend = 'receipt.backend.resolved in ["triton", "b12x"]'
"""

YAML = """\
name: fleet
verdict: qualified
max_age: 7d
min_hosts: 2
mode: enforce
conditions:
  layout: "receipt.layout.spans == [2304, 2304, 2304, 9216]"
  no-restarts: "receipt.faults.restart_count == 0"
  no-fatal-xid: "receipt.faults.xid_events.all(x, !x.fatal)"
  backend: 'receipt.backend.resolved in ["triton", "b12x"]'
"""


def test_toml_yaml_and_json_spellings_are_one_policy_with_one_digest(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(TOML)
    (tmp_path / "p.yaml").write_text(YAML)
    toml = load_policy(tmp_path / "p.toml")
    (tmp_path / "p.json").write_text(json.dumps(toml.policy.model_dump(mode="json")))
    yaml_ = load_policy(tmp_path / "p.yaml")
    json_ = load_policy(tmp_path / "p.json")
    assert toml.policy == yaml_.policy == json_.policy
    assert toml.digest == yaml_.digest == json_.digest
    assert toml.digest.startswith("sha256:") and len(toml.digest) == 71
    assert [c.name for c in toml.conditions] == ["layout", "no-restarts", "no-fatal-xid", "backend"]
    assert toml.policy.max_age_delta == timedelta(days=7)


def test_changing_any_setting_changes_the_digest() -> None:
    base = parse_policy_text(TOML, "toml").digest
    assert parse_policy_text(TOML.replace("min_hosts = 2", "min_hosts = 3"), "toml").digest != base
    assert parse_policy_text(TOML.replace("== 0", "<= 1"), "toml").digest != base


def test_toml_syntax_error_names_line_and_column() -> None:
    with pytest.raises(PolicyError, match=r"not valid TOML: .*line 3, column"):
        parse_policy_text('name = "x"\n\nmin_hosts = = 2\n', "toml", "bad.toml")


def test_yaml_syntax_error_names_line_and_column() -> None:
    with pytest.raises(PolicyError, match=r"not valid YAML at line 2, column 13: mapping values"):
        parse_policy_text("name: x\nmin_hosts: 2: 3\n", "yaml", "bad.yaml")


def test_cel_syntax_error_points_at_the_file_line_and_column() -> None:
    text = TOML.replace("restart_count == 0", "restart_count == ")
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "toml", "fleet.toml")
    message = str(err.value)
    assert "fleet.toml line 9, column" in message
    assert "condition 'no-restarts' does not compile" in message
    column = int(message.split("column ")[1].split(":")[0])
    assert text.splitlines()[8][column - 1 :].startswith("==")  # the column points at the offending token


def test_cel_expression_using_an_unknown_name_is_refused_at_load() -> None:
    text = TOML.replace("receipt.faults.restart_count", "reciept.faults.restart_count")
    with pytest.raises(
        PolicyError, match=r"line 9, column 16: condition 'no-restarts' .* unknown name 'reciept'"
    ):
        parse_policy_text(text, "toml", "fleet.toml")


def test_macro_variables_are_not_unknown_names() -> None:
    loaded = parse_policy_text(
        "[conditions]\nall = 'receipt.checks.all(c, c.status == \"pass\" && c.seconds < 60.0)'\n", "toml"
    )
    assert loaded.conditions[0].evaluate({"checks": [{"status": "pass", "seconds": 1.0}]}) is None
    assert loaded.conditions[0].evaluate({"checks": [{"status": "fail", "seconds": 1.0}]}) == "is false"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('max_age = "7 days"', r"max_age .*must look like 7d"),
        ("min_hosts = 0", r"min_hosts .*greater than 0"),
        ('mode = "audit"', r"mode .*'enforce' or 'warn'"),
        ('verdict = "passed"', r"verdict"),
        ("trusted_keyids = []", r"trusted_keyids .*empty"),
        ('trusted_keyids = ["abc"]', r"64 lower-case hex"),
        ("unknown = 1", r"unknown .*Extra inputs"),
        ("[conditions]\n'bad name' = 'true'", r"condition name"),
    ],
)
def test_invalid_settings_are_refused_with_the_field(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy_text(text, "toml", "p.toml")


def test_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.toml")


def test_condition_that_does_not_yield_a_boolean_does_not_hold() -> None:
    loaded = parse_policy_text("[conditions]\ncount = 'receipt.faults.restart_count'\n", "toml")
    assert "is not true or false" in loaded.conditions[0].evaluate({"faults": {"restart_count": 0}})


def test_condition_over_a_missing_part_reports_an_evaluation_error() -> None:
    loaded = parse_policy_text("[conditions]\nlayout = 'receipt.layout.spans == [1]'\n", "toml")
    assert loaded.conditions[0].evaluate({"layout": None}).startswith("could not be evaluated")


@pytest.mark.parametrize(
    ("text", "seconds"), [("7d", 7 * 86400), ("12h", 43200), ("1d12h", 129600), ("1w", 604800)]
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text).total_seconds() == seconds


def test_json_schema_describes_every_setting() -> None:
    schema = policy_json_schema()
    assert set(schema["properties"]) == {
        "name",
        "verdict",
        "conditions",
        "max_age",
        "min_hosts",
        "trusted_keyids",
        "mode",
        "require_observed",
        "require_monitored",
    }
    assert schema["additionalProperties"] is False


def test_example_fleet_policy_loads() -> None:
    loaded = load_policy(Path(__file__).parents[2] / "examples" / "fleet.toml")
    assert loaded.conditions and loaded.policy.mode == "enforce"
