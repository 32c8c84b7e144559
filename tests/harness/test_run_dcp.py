"""`qualify run --dcp N` on CPU: the engine runs N gloo ranks; the dcp check compares it with a DCP 1 engine
the harness boots itself; a rank killed mid-run rejects the run naming the rank and leaves no process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.conftest import ROOT, Home, check


def test_dcp_2_qualifies_with_per_rank_layouts_and_matches_dcp_1(home: Home) -> None:
    ran = home.qualify("run", "--dcp", "2", "--layout", "2304,2304,2304,4608", "--json", timeout=400)
    assert ran.code == 0, ran.stderr[-3000:]
    s = ran.summary()
    assert [c["name"] for c in s["checks"]][-2:] == ["dcp", "faults"]
    (p,) = home.predicates()
    assert p["request"]["dcp"] == 2
    dcp = check(p, "dcp")
    conds = dcp["conditions"]
    assert conds["dcp_vs_dcp1"] == {"holds": True, "source": "observed", "detail": "identical"}
    assert (
        conds["dcp_vs_dcp1_after_reload"]["holds"]
        and conds["every_rank_is_a_live_process_of_the_engine"]["holds"]
    )
    ranks = dcp["evidence"]["ranks"]
    assert sorted(ranks) == ["0", "1"] and all(r["spans"] == [2304, 2304, 2304, 4608] for r in ranks.values())
    assert dcp["evidence"]["rank_processes"] == {"0": "ok", "1": "ok"}


def test_dcp_out_of_range_is_bad_input(home: Home) -> None:
    ran = home.qualify("run", "--dcp", "1")
    assert ran.code == 2 and "--dcp 1" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1
    assert not home.db.exists()


def _followers_of(harness: int) -> list[int]:
    """DCP follower ranks descended from this test's harness process (other runs on the machine are not
    ours; inside its sandbox the engine's environment no longer names the test's QUALIFY_HOME)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
    out = []
    for pid in parent:
        up, seen = pid, 0
        while up in parent and up != harness and seen < 64:
            up, seen = parent[up], seen + 1
        if up != harness or pid == harness:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"follow" in cmd and b"qualify.engine" in cmd:
            out.append(pid)
    return out


def test_a_rank_killed_mid_run_rejects_the_run_naming_the_rank_and_leaves_no_process(home: Home) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qualify.cli", "run", "--dcp", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=home.env(),
        cwd=ROOT,
    )
    killed = None
    seen: set[int] = set()
    try:
        end = time.monotonic() + 180
        while killed is None and time.monotonic() < end and proc.poll() is None:
            ranks = _followers_of(proc.pid)
            seen.update(ranks)
            if ranks:
                time.sleep(1.0)  # let the ranks join and the checks start
                os.kill(ranks[0], signal.SIGKILL)
                killed = ranks[0]
            time.sleep(0.2)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "no follower rank appeared"
    assert proc.returncode == 1, err[-3000:]
    (p,) = home.predicates()
    assert p["verdict"] == "rejected"
    # Whichever check was running when the rank died, the receipt names it.
    assert "lost DCP rank=1 killed by signal 9" in p["faults"]["engine_exits"], p["faults"]
    faults = next((c for c in p["checks"] if c["name"] == "faults"), None)
    if faults is not None and faults["status"] != "error":
        assert any("rank=1 killed by signal 9" in line for line in faults["evidence"]["dcp_ranks_lost"])
    # Every rank seen is gone (its sandbox's pid namespace went with the engine; a zombie no longer runs).
    for pid in seen:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state == "Z", f"DCP rank {pid} outlived its run"
