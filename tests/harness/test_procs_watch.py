"""The launched process tree as /proc shows it (qualify/watch/procs.py): restarts hidden under a launched
process that never exits are counted, processes expected from boot (DCP ranks, a sandbox's init) and
passing helpers are not, and pids seen from inside a pid namespace map onto host processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from qualify.watch.procs import (
    LONG_LIVED_S,
    Proc,
    ProcessWatch,
    TreeHistory,
    read_proc,
    resolve_ns_pid,
    snapshot,
)

CMD = "python -m engine serve"
PRINT_PID = "import os,time; print(os.getpid(), flush=True); time.sleep(30)"


def P(pid: int, ppid: int, start: int, cmd: str = CMD, nspid: tuple[int, ...] = (), state: str = "S") -> Proc:
    return Proc(pid, ppid, start, state, "python", cmd, nspid or (pid,), 0)


def _feed(h: TreeHistory, samples: list[list[Proc]], root: int = 10, step: float = 0.5, gpu=()) -> None:
    for i, procs in enumerate(samples):
        h.add(i * step, root, {p.pid: p for p in procs}, gpu)


def test_a_worker_reforked_under_the_launched_process_is_a_restart() -> None:
    sup, w1, w2 = P(10, 1, 100), P(11, 10, 101), P(12, 10, 900)
    h = TreeHistory()
    _feed(h, [[sup, w1]])
    h.mark_baseline()
    _feed(h, [[sup, w1], [sup, w1], [sup], [sup, w2], [sup, w2]])
    (r,) = h.restarts()
    assert r["ended"] == {"pid": 11, "start_ticks": 101} and r["replaced_by"]["pid"] == 12
    assert h.evidence()["restarts"] == [r]


def test_a_worker_started_again_with_other_arguments_is_a_restart_once_it_lives_on() -> None:
    sup, w1 = P(10, 1, 100), P(11, 10, 101, "python -m engine worker --incarnation 1")
    w2 = P(12, 10, 900, "python -m engine worker --incarnation 2")
    h = TreeHistory()
    _feed(h, [[sup, w1]])
    h.mark_baseline()
    _feed(h, [[sup, w1], [sup], [sup, w2]])
    assert h.restarts() == []  # seen once: it might be a passing helper
    h.add(10.0, 10, {p.pid: p for p in (sup, w2)})
    assert [r["why"] for r in h.restarts()] == ["same parent and program, long-lived"]


def test_a_worker_seen_as_a_zombie_before_it_was_reaped_is_still_the_worker_that_was_replaced() -> None:
    sup, w1, w2 = P(10, 1, 100), P(11, 10, 101), P(12, 10, 900)
    zombie = Proc(11, 10, 101, "Z", "python", "", (11,), 5)  # /proc shows no command line for a zombie
    h = TreeHistory()
    _feed(h, [[sup, w1]])
    h.mark_baseline()
    _feed(h, [[sup, w1], [sup, zombie], [sup, w2]])
    assert [r["replaced_by"]["pid"] for r in h.restarts()] == [12]


def test_a_reused_pid_with_a_later_start_time_is_another_process() -> None:
    sup, w1, w1_again = P(10, 1, 100), P(11, 10, 101), P(11, 10, 700)
    h = TreeHistory()
    _feed(h, [[sup, w1]])
    h.mark_baseline()
    _feed(h, [[sup, w1], [sup, w1_again]])
    assert [r["replaced_by"] for r in h.restarts()] == [{"pid": 11, "start_ticks": 700}]


def test_expected_children_and_passing_helpers_are_not_restarts() -> None:
    engine = P(10, 1, 100)
    ranks = [
        P(11, 10, 105, "python -m engine follow --dcp-rank 1"),
        P(12, 10, 106, "python -m engine follow"),
    ]
    gcc = [P(20 + i, 10, 300 + i, f"gcc /tmp/t{i}/main.c -o /tmp/t{i}/m.so") for i in range(3)]
    h = TreeHistory()
    _feed(h, [[engine, *ranks]])
    h.mark_baseline()
    # DCP follower ranks live from boot to the end; compilers come and go, each once, none replacing a worker.
    _feed(h, [[engine, *ranks, g] for g in gcc] + [[engine, *ranks]])
    assert h.restarts() == []
    # One helper with the same command line twice, but never long-lived: still not a worker replaced.
    again = P(30, 10, 400, "ldconfig -p"), P(31, 10, 401, "ldconfig -p")
    _feed(h, [[engine, *ranks, again[0]], [engine, *ranks], [engine, *ranks, again[1]]])
    assert h.restarts() == []


def test_a_long_lived_process_started_after_boot_that_is_replaced_counts() -> None:
    sup, w1, w2 = P(10, 1, 100), P(11, 10, 500), P(12, 10, 900)
    h = TreeHistory()
    _feed(h, [[sup]])
    h.mark_baseline()
    n = int(LONG_LIVED_S / 0.5) + 2
    _feed(h, [[sup, w1]] * n + [[sup], [sup, w2]])
    assert len(h.restarts()) == 1


def test_a_new_gpu_process_after_a_gpu_process_of_the_tree_ended_counts() -> None:
    sup, w1, w2 = P(10, 1, 100), P(11, 10, 101, "a"), P(12, 10, 900, "b")
    h = TreeHistory()
    _feed(h, [[sup, w1]], gpu={11})
    h.mark_baseline()
    _feed(h, [[sup], [sup, w2]], gpu={12})
    assert [r["why"] for r in h.restarts()] == ["a new GPU process of the tree"]


def test_a_restart_by_the_launcher_itself_is_the_launchers_to_count() -> None:
    e1, e2 = P(10, 1, 100), P(20, 1, 800)
    h = TreeHistory()
    _feed(h, [[e1]], root=10)
    h.mark_baseline()
    _feed(h, [[e2], [e2]], root=20)
    assert h.restarts() == []


def test_pids_inside_a_pid_namespace_resolve_through_nspid() -> None:
    outer, init, engine = (
        P(10, 1, 100, nspid=(10,)),
        P(11, 10, 101, nspid=(11, 1)),
        P(12, 11, 102, nspid=(12, 2)),
    )
    assert resolve_ns_pid(2, [outer, init, engine]) == [engine]
    assert resolve_ns_pid(10, [outer, init, engine]) == [outer]
    assert resolve_ns_pid(12, [outer, init, engine]) == []  # 12 is the host's name for it, not its own


def test_the_real_tree_of_a_child_and_its_grandchild() -> None:
    sleep = "import time; time.sleep(30)"
    code = f"import subprocess,sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(snapshot(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = snapshot(child.pid)
        assert len(tree) == 2 and child.pid in tree
        me = read_proc(os.getpid())
        assert me is not None and me.inner_pid == os.getpid() and me.start > 0
        watch = ProcessWatch(lambda: child.pid, interval_s=0.05).start()
        watch.mark_baseline()
        (grandchild,) = [p for p in tree if p != child.pid]
        os.kill(grandchild, 9)
        time.sleep(0.3)
        watch.stop()
        ev = watch.evidence()
        ended = [p for p in ev["processes"] if p["pid"] == grandchild]
        assert ended and ended[0]["ended_s"] is not None and ev["restarts"] == []  # ended, not replaced
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed here")
def test_a_sandboxed_engine_is_found_by_the_pid_it_sees() -> None:
    sandbox = subprocess.Popen(
        ["bwrap", "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
         "--dev", "/dev", sys.executable, "-c", PRINT_PID],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sandbox.stdout is not None
        inner = int(sandbox.stdout.readline())
        hits = resolve_ns_pid(inner, snapshot(sandbox.pid).values())
        assert len(hits) == 1 and hits[0].pid != inner and hits[0].nspid[-1] == inner
    finally:
        sandbox.kill()
        sandbox.wait()
