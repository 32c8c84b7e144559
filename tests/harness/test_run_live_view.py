"""The run's progress: on a terminal one table updated in place (the running check shows its elapsed time
and what it does); in a pipe one plain line per check, each check once; `--json` keeps stdout to the JSON."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from qualify.commands.run import LiveReporter
from qualify.run.verdict import REQUIRED_CHECKS

from .conftest import Home


def _feed(reporter: LiveReporter) -> None:
    for name in ("boot", "backend", "reload"):
        reporter.check_started(name)
        reporter.check_finished(name, "pass" if name != "backend" else "fail", 1.5, "differs")
    reporter.close()


def test_on_a_terminal_one_table_is_redrawn_in_place() -> None:
    out = io.StringIO()
    reporter = LiveReporter(Console(file=out, force_terminal=True, width=120, color_system=None))
    reporter.check_started("reload")
    running = Console(file=io.StringIO(), width=120)
    running.print(reporter._table())
    assert "running" in running.file.getvalue() and "census" in running.file.getvalue()
    reporter.check_finished("reload", "pass", 2.0, None)
    _feed(reporter)
    text = out.getvalue()
    assert "\x1b[" in text and ("\x1b[1A" in text or "\x1b[2K" in text)  # redrawn, not appended
    assert "running" not in text.split("\x1b[2K")[-1]  # the last frame has no running row


def test_in_a_pipe_each_check_is_one_plain_line() -> None:
    out = io.StringIO()
    _feed(LiveReporter(Console(file=out, force_terminal=False, width=120)))
    lines = out.getvalue().splitlines()
    assert [ln.split()[0] for ln in lines] == ["boot", "backend", "reload"]
    assert "\x1b[" not in out.getvalue() and "differs" in lines[1]


def test_in_a_pipe_a_long_check_says_it_still_runs_and_what_it_does() -> None:
    out = io.StringIO()
    reporter = LiveReporter(Console(file=out, force_terminal=False, width=120), plain_every_s=0.2)
    reporter.check_started("reload")
    time.sleep(1.0)
    reporter.check_finished("reload", "pass", 1.0, None)
    time.sleep(0.3)  # no progress line after the check finished
    lines = out.getvalue().splitlines()
    assert lines[-1].split()[:2] == ["reload", "pass"]
    progress = lines[:-1]
    assert len(progress) >= 1 and all("still running after" in ln and "census" in ln for ln in progress)


@pytest.mark.slow
def test_a_run_in_a_pipe_prints_each_check_once_then_the_verdict(home: Home) -> None:
    ran = home.qualify("run")
    assert ran.code == 0, ran.stderr[-2000:]
    lines = ran.stdout.splitlines()
    for name in REQUIRED_CHECKS:
        assert sum(ln.split()[:1] == [name] for ln in lines) == 1, (name, ran.stdout)
    assert lines[-1].startswith("verdict qualified")
    as_json = home.qualify("run", "--json")
    assert json.loads(as_json.stdout)["verdict"] == "qualified"
