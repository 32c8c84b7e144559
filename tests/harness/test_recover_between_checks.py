"""A harness killed between two checks still leaves a receipt that says so: the kill is recorded on an
entry of its own, not lost because no check was running at that moment."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from qualify.run import rundir
from qualify.run.recover import KILLED, _predicate


def test_a_run_killed_between_checks_records_the_kill(tmp_path) -> None:
    saved = {
        "request": {"preset": "tiny", "kda_backend": "auto", "spec": "none", "launcher": "local"},
        "started_at": datetime.now(UTC).isoformat(),
        "harness": {"pid": 4242, "host": "node-a"},
    }
    done = [{"name": "boot", "status": "pass", "evidence": {}, "seconds": 1.0, "reason": None}]
    progress = {"checks": done, "current": None, "target": "cpu"}
    (tmp_path / rundir.REQUEST).write_text(json.dumps(saved))
    (tmp_path / rundir.PROGRESS).write_text(json.dumps(progress))
    predicate, _ = _predicate(tmp_path, saved, progress)
    checks = {c.name: c for c in predicate.checks}
    assert predicate.verdict == "aborted" and checks["boot"].status == "pass"
    assert checks["harness"].status == "error" and KILLED in (checks["harness"].reason or "")
    assert "pid 4242 on node-a" in checks["harness"].reason
