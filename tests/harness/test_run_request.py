"""Option parsing refuses every malformed value with one line, and bounds --layout by the preset's groups."""

from __future__ import annotations

import pytest

from qualify.errors import UsageError
from qualify.run.request import max_groups, parse_gpus, parse_layout, parse_spec, parse_timeout


def test_layout_of_positive_spans_is_accepted() -> None:
    assert parse_layout("2304,2304,2304,9216", "tiny") == [2304, 2304, 2304, 9216]
    assert parse_layout(" 2304 , 9216 ", "proxy") == [2304, 9216]
    assert parse_layout(None, "tiny") is None


def test_group_bound_comes_from_the_pattern() -> None:
    # KKKAKKKA in groups of 2: three KDA groups and one attention group.
    assert max_groups("tiny") == max_groups("proxy") == 4


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("2304,,9216", "span 2 is empty"),
        ("-1", "positive"),
        ("0", "positive"),
        ("abc", "not an integer"),
        ("", "empty"),
        ("   ", "empty"),
        ("2304,2304,2304,9216,2304", "at most 4"),
        ("1.5", "not an integer"),
    ],
)
def test_bad_layout_is_refused_with_one_line(text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_layout(text, "tiny")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_spec_values() -> None:
    assert parse_spec("none") == 0
    assert parse_spec("mtp:3") == 3
    for bad in ("mtp:0", "mtp:99", "mtp", "eagle:2", ""):
        with pytest.raises(UsageError):
            parse_spec(bad)


def test_gpus_values() -> None:
    assert parse_gpus("all") == "all"
    assert parse_gpus("0, 1") == "0,1"
    for bad in ("", "x", "0,0", "-1", "1,,2"):
        with pytest.raises(UsageError):
            parse_gpus(bad)


def test_timeout_values() -> None:
    assert parse_timeout(12.5) == 12.5
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError):
            parse_timeout(bad)
