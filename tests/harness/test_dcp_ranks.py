"""The dcp check's view of the ranks from the kernel's process table: a reported pid counts only when it is
the launched process or one of its descendants (mapped through NSpid), two ranks never share a process, and
CPU time comes from /proc/PID/stat."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from qualify.checks.dcp import cpu_ticks, descendants, ns_pid, rank_hosts, rank_processes

UP = "import os, time\nos.write(1, b'up\\n')\n"  # one write: the two children share the pipe
BUSY = UP + "t = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)\n"
IDLE = UP + "time.sleep(60)\n"


def _tree() -> tuple[subprocess.Popen, list[int]]:
    """A parent (standing in for the launched engine) with two children: one busy for 0.3 s, one idle."""
    code = (
        "import subprocess, sys, time\n"
        f"a = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
        f"b = subprocess.Popen([sys.executable, '-c', {IDLE!r}])\n"
        "print(a.pid, b.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    # The children share the parent's stdout, so their "up" lines and the parent's pid line come in any order
    # (CI saw a child's "up" first, 2026-12-04).
    lines = sorted((parent.stdout.readline().strip() for _ in range(3)), key=lambda line: line == "up")
    kids = [int(x) for x in lines[0].split()]
    assert lines[1:] == ["up", "up"] and len(kids) == 2  # both started
    return parent, kids


def test_ranks_map_to_the_launched_family_and_only_the_busy_one_spends_cpu() -> None:
    parent, (busy, idle) = _tree()
    try:
        assert set(descendants(parent.pid)) >= {busy, idle}
        assert ns_pid(os.getpid()) == os.getpid()  # the test runs in the host's pid namespace
        # On a loaded machine the idle child was seen charged 2 ticks in the first second after both printed
        # "up" (two pytest workers, 2026-12-04): up to three 1 s windows, of which one must show none.
        spent = {}
        for _ in range(3):
            t0 = {p: cpu_ticks(p) for p in (busy, idle)}
            time.sleep(1.0)
            spent = {p: cpu_ticks(p) - t0[p] for p in (busy, idle)}
            if spent[idle] == 0:
                break
        assert spent[idle] == 0
        ranks = {0: {"pid": parent.pid}, 1: {"pid": busy}, 2: {"pid": idle}}
        assert rank_hosts(ranks, parent.pid) == {0: parent.pid, 1: busy, 2: idle}
        assert rank_processes(ranks, parent.pid) == {0: "ok", 1: "ok", 2: "ok"}
        # A pid outside the family (this test process), a rank that is rank 0's own process, and two ranks
        # on one process are each refused.
        bad = {
            0: {"pid": parent.pid},
            1: {"pid": os.getpid()},
            2: {"pid": parent.pid},
            3: {"pid": busy},
            4: {"pid": busy},
        }
        out = rank_processes(bad, parent.pid)
        assert "not the launched engine" in out[1] and "launched process itself" in out[2]
        assert out[3] == "ok" and "rank 3's process too" in out[4]
    finally:
        for p in (busy, idle):
            os.kill(p, 9)
        parent.kill()
        parent.wait()


def test_on_a_gpu_each_rank_must_hold_memory_on_a_gpu_of_its_own() -> None:
    from qualify.checks.dcp import _own_gpus

    hosts = {0: 100, 1: 101}
    assert _own_gpus({100: {0: 1 << 30}, 101: {1: 1 << 30}}, hosts, 2).holds
    assert _own_gpus({100: {0: None}, 101: {1: None}}, hosts, 2).holds  # memory not reported: presence
    shared = _own_gpus({100: {0: 1 << 30}, 101: {0: 1 << 30}}, hosts, 2)
    assert not shared.holds and "share a GPU" in shared.detail and shared.source == "observed"
    idle = _own_gpus({100: {0: 1 << 30}}, hosts, 2)  # rank 1's process is on no GPU
    assert not idle.holds and "rank 1 on GPUs []" in idle.detail
    empty = _own_gpus({100: {0: 1 << 30}, 101: {1: 0}}, hosts, 2)
    assert not empty.holds and "rank 1 holds no memory on GPU 1" in empty.detail
    assert not _own_gpus(None, hosts, 2).holds
