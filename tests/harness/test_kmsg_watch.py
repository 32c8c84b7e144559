"""Kernel-log Xid lines are parsed in every form the driver and log tools write, and the watcher follows a
file source (the recorded sample) classifying every Xid in it. A file is a replay, never a live watch; a
live source that fails mid-run (a read error, dmesg exiting) is unavailable from then on, with its time."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from qualify.watch import kmsg
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
    assert ev["status"] == "replayed" and ev["source"] == f"file:{SAMPLE_KMSG}"
    assert not w.live()  # a recorded log is a replay: it never counts as a live watch
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


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_kmsg_read_error_ends_the_watch_and_says_since_when(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = tmp_path / "kmsg"
    device.write_text("")
    w = KmsgWatcher(source=None, poll_s=0.02, kmsg_path=str(device))
    monkeypatch.delenv("QUALIFY_KMSG_SOURCE", raising=False)
    calls = []

    def failing_read(fd: int) -> bytes:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(kmsg, "_read_record", failing_read)
    w.start()
    assert w.kind == "kmsg"
    assert _wait_for(lambda: w.status == "unavailable")
    assert not w.live()
    w.stop()
    assert w.status == "unavailable", "stop() must not turn a lost watch back into a finished one"
    assert "Input/output error" in (w.reason or "") and w.lost_at and w.lost_at.endswith("Z")
    assert w.evidence()["lost_at"] == w.lost_at


def test_a_kmsg_read_that_keeps_working_is_live_until_stopped(tmp_path: Path) -> None:
    device = tmp_path / "kmsg"
    device.write_text("")
    w = KmsgWatcher(source=None, poll_s=0.02, kmsg_path=str(device)).start()
    time.sleep(0.1)
    assert w.status == "watching" and w.live()
    w.stop()
    assert w.status == "stopped" and w.live() and w.lost_at is None


def _fake_dmesg(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    script = bin_dir / "dmesg"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_a_dmesg_follower_that_dies_mid_run_does_not_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dmesg(tmp_path / "bin", "echo 'kernel: hello'\nsleep 0.3\nexit 3\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("QUALIFY_KMSG_SOURCE", raising=False)
    w = KmsgWatcher(source=None, poll_s=0.02, kmsg_path=str(tmp_path / "no-kmsg")).start()
    assert w.kind == "dmesg" and w.live()
    assert _wait_for(lambda: w.status == "unavailable")
    w.stop()
    assert not w.live() and w.status == "unavailable"
    assert "exited 3" in (w.reason or "") and w.lost_at


def test_a_dmesg_follower_alive_until_stop_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dmesg(tmp_path / "bin", "echo 'kernel: hello'\nexec sleep 30\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("QUALIFY_KMSG_SOURCE", raising=False)
    w = KmsgWatcher(source=None, poll_s=0.02, kmsg_path=str(tmp_path / "no-kmsg")).start()
    assert _wait_for(lambda: w.lines_read == 1)
    w.stop()
    assert w.status == "stopped" and w.live() and w.lost_at is None
