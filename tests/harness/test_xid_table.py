"""The Xid table classifies NVIDIA's codes as the catalog says, and fails closed on codes it does not know."""

from __future__ import annotations

import pytest

from qualify.watch.xid import XID_TABLE, XID_TABLE_SOURCE, XID_TABLE_VERSION, classify, table_evidence


@pytest.mark.parametrize("code", [46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 140, 143, 155, 156, 158])
def test_codes_whose_immediate_action_is_reset_or_reboot_are_fatal(code: int) -> None:
    ev = classify(code, source="kmsg")
    assert ev.fatal and ev.known


@pytest.mark.parametrize("code", [8, 13, 31, 32, 39, 43, 45, 63, 68, 69, 92, 94, 121, 157])
def test_restart_app_or_ignore_codes_are_known_and_not_fatal(code: int) -> None:
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


def test_xid_154_is_fatal_unless_the_announced_recovery_action_is_none() -> None:
    reboot = "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    recovered = "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
    assert classify(154, source="kmsg", message=reboot).fatal
    assert not classify(154, source="kmsg", message=recovered).fatal
    assert classify(154, source="nvml").fatal  # NVML gives no message: fail closed


def test_table_version_moved_with_the_rows() -> None:
    # 109 became fatal in this version; a row change without a version bump would mislabel old receipts.
    assert XID_TABLE[109].fatal and XID_TABLE_VERSION == "2026.09-2"
