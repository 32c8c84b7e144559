"""Kernel-log Xid lines are parsed in every form the driver and log tools write, and the watcher follows a
file source (the recorded sample) classifying every Xid in it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from qualify.watch.kmsg import KmsgWatcher, parse_line

from .conftest import SAMPLE_KMSG


@pytest.mark.parametrize(
    ("line", "code", "device"),
    [
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
            79,
            "0000:3b:00",
        ),
        ("6,1330,640001234,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE", 48, "0000:3b:00"),
        ("[ 5107.644336] NVRM: Xid (0000:01:00): 13, Graphics Exception", 13, "0000:01:00"),
        (
            "May 18 19:02:39 host kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
            79,
            None,
        ),
    ],
)
def test_xid_lines_are_parsed_and_classified(line: str, code: int, device: str | None) -> None:
    ev = parse_line(line)
    assert ev is not None and ev.code == code
    assert ev.fatal == (code in (79, 48))
    if device:
        assert ev.device == device
    assert ev.line == line


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.127.05",
        "usbhid 2-3:1.0: suspend error -5",
        "",
    ],
)
def test_other_kernel_lines_are_not_xid(line: str) -> None:
    assert parse_line(line) is None


def test_recorded_sample_is_classified_with_its_fatal_codes() -> None:
    w = KmsgWatcher(SAMPLE_KMSG, poll_s=0.02).start()
    time.sleep(0.2)
    w.stop()
    codes = [e.code for e in w.events]
    assert codes == [13, 43, 31, 63, 94, 79, 48]
    assert [e.code for e in w.events if e.fatal] == [79, 48]
    ev = w.evidence()
    assert ev["status"] == "stopped" and ev["source"] == f"file:{SAMPLE_KMSG}"
    assert ev["lines_read"] == len(SAMPLE_KMSG.read_text().splitlines())


def test_lines_appended_while_watching_are_seen(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,1,1,-;an unrelated line\n")
    w = KmsgWatcher(log, poll_s=0.02).start()
    time.sleep(0.1)
    with log.open("a") as fh:
        fh.write("4,2,2,-;NVRM: Xid (PCI:0000:3b:00): 95, pid=7, name=python3, Uncontained: FBHUB.\n")
    deadline = time.monotonic() + 3
    while not w.snapshot() and time.monotonic() < deadline:
        time.sleep(0.02)
    w.stop()
    assert [(e.code, e.fatal) for e in w.events] == [(95, True)]


def test_missing_source_is_reported_not_ignored(tmp_path: Path) -> None:
    w = KmsgWatcher(tmp_path / "absent").start()
    w.stop()
    assert w.status == "unavailable" and "absent" in (w.reason or "")


def test_env_source_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_KMSG_SOURCE", str(SAMPLE_KMSG))
    w = KmsgWatcher(poll_s=0.02).start()
    time.sleep(0.2)
    w.stop()
    assert len(w.events) == 7
