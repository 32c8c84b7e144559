"""The Xid table classifies NVIDIA's codes as the catalog says, and fails closed on codes it does not know."""

from __future__ import annotations

import pytest

from qualify.watch.xid import XID_TABLE, XID_TABLE_SOURCE, XID_TABLE_VERSION, classify, table_evidence


@pytest.mark.parametrize("code", [48, 64, 74, 79, 95, 119, 120])
def test_fatal_codes_are_fatal(code: int) -> None:
    ev = classify(code, source="kmsg")
    assert ev.fatal and ev.known


@pytest.mark.parametrize("code", [13, 31, 43, 45, 63, 92, 94])
def test_application_level_codes_are_not_fatal(code: int) -> None:
    ev = classify(code, source="nvml")
    assert not ev.fatal and ev.known


def test_unknown_code_fails_closed_and_says_so() -> None:
    ev = classify(9999, source="kmsg")
    assert ev.fatal and not ev.known
    assert XID_TABLE_VERSION in ev.name


def test_table_is_versioned_and_cites_its_source() -> None:
    ev = table_evidence()
    assert ev["version"] == XID_TABLE_VERSION and ev["source"] == XID_TABLE_SOURCE
    assert ev["fatal_codes"] == sorted(c for c, i in XID_TABLE.items() if i.fatal)
    assert XID_TABLE[79].name == "GPU has fallen off the bus"
