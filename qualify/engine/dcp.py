"""Distributed decode-context parallelism: one engine process per DCP shard, stepping in lockstep.

Token t of a sequence's attention KV lives on rank (t // interleave) mod dcp. Each rank stores only its
shard, computes its partial attention (out, lse) and the ranks all-gather the partials and merge them by
log-sum-exp in shard order, exactly as the folded path merges its local shards; the pooled selector sums
its per-rank key sums and counts with an all-reduce so every rank selects the same rows. KDA layers, MLPs
and the LM head are replicated (the same seeded weights on every rank): they are small next to the
attention KV at long context, which is what DCP spreads, and replication keeps their kernels and CUDA
graphs identical to the single-process engine.

Rank 0 serves the HTTP API. Every engine verb it runs is first broadcast (verb, arguments) on a gloo
control group and the other ranks run the same verb, so the collectives inside the model line up. The
followers are rank 0's children: they die with it (parent-death signal), and rank 0 exits, naming the
rank, as soon as a follower dies, so no rank outlives the run and a lost rank is never silent.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qualify.protocol import DCP_RANK_LOST

# How long a collective may wait for a peer rank. Followers wait for rank 0's next verb on the control
# group without this bound (an idle server is legitimate); a dead rank 0 ends them by the parent-death
# signal instead.
COLLECTIVE_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
RANK_EXIT_CODE = 4  # rank 0 exits with this when a follower died: the launcher sees a crashed engine
CLEANUP_S = 2.0  # how long a rank that lost a peer waits for its own allocations to be released
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when its parent exits (SIGKILL included)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


# torch >= 2.13 names the flat all-gather all_gather_single (all_gather_into_tensor is deprecated there);
# older builds (the GPU machine's 2.11) have only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DcpGroup:
    """This process's place among the DCP ranks and the two collectives the attention layers need."""

    def __init__(self, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"dcp rank {rank} outside 0..{world - 1}")
        self.rank, self.world = rank, world
        self.control: Any = None
        self.connected = False

    def connect(self, init_method: str, device: torch.device) -> None:
        """Join the process group (NCCL for CUDA tensors, gloo on CPU) plus a gloo group for verbs."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
        self.connected = True

    def close(self) -> None:
        if self.connected:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.connected = False

    # ------------------------------------------------------------ collectives inside the model
    def gather_partials(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's partials o [..., 1, D], lse [..., 1] -> every rank's, o [..., W, D], lse [..., W]."""
        W = self.world
        o_all = torch.empty(W * o.numel(), dtype=o.dtype, device=o.device)
        l_all = torch.empty(W * lse.numel(), dtype=lse.dtype, device=lse.device)
        _all_gather(o_all, o.contiguous().view(-1))
        _all_gather(l_all, lse.contiguous().view(-1))
        o_all = o_all.view(W, *o.shape).squeeze(-2)  # [W, ..., D]
        l_all = l_all.view(W, *lse.shape).squeeze(-1)  # [W, ...]
        return o_all.movedim(0, -2), l_all.movedim(0, -1)

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t)
        return t

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    # ------------------------------------------------------------ lockstep verbs
    def broadcast_verb(self, verb: str, args: tuple) -> tuple[str, tuple]:
        box: list[Any] = [(verb, args)] if self.rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


class Lockstep:
    """Rank 0's engine as the HTTP API sees it: each verb is broadcast, then run here as on every rank."""

    def __init__(
        self,
        engine: Any,
        group: DcpGroup,
        verbs: dict[str, Callable[..., Any]],
        check_ranks: Callable[[], None] | None = None,
    ) -> None:
        self.engine, self.group, self.verbs = engine, group, verbs
        self.check_ranks = check_ranks

    def call(self, verb: str, *args: Any) -> Any:
        try:
            self.group.broadcast_verb(verb, args)
            return self.verbs[verb](self.engine, *args)
        except Exception:
            # A collective that failed may mean a lost rank: look now rather than at the watcher's next
            # poll, so the engine ends naming the rank before it answers anything else.
            if self.check_ranks is not None:
                self.check_ranks()
            raise

    def stop_followers(self) -> None:
        with contextlib.suppress(Exception):
            self.group.broadcast_verb("stop", ())


def follow(engine: Any, group: DcpGroup, verbs: dict[str, Callable[..., Any]]) -> None:
    """A follower rank: run every verb rank 0 broadcasts until it says stop. A verb that raises here raised
    on rank 0 too (the ranks run the same deterministic step), which answers the client; carry on."""
    while True:
        verb, args = group.broadcast_verb("", ())
        if verb == "stop":
            return
        try:
            verbs[verb](engine, *args)
        except Exception as exc:  # the same error rank 0 reports over HTTP
            print(
                f"dcp rank {group.rank}: {verb} raised {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )


class Followers:
    """Rank 0's children, ranks 1..world-1: spawned with the same serve arguments, watched until they exit."""

    def __init__(self, world: int, init_method: str, argv: list[str]) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "qualify.engine", "follow", "--dcp-rank", str(rank),
                   "--dcp-init", init_method, *argv]  # fmt: skip
            # A session of their own: a signal to rank 0's process group (the launcher's stop) reaches rank
            # 0 alone, which then stops its followers itself; were they hit at once, their exits would read
            # as lost ranks. They still die with rank 0 (the parent-death signal).
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self._stopping = False

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def check(self, on_lost: Callable[[int, int], None]) -> bool:
        """Call on_lost(rank, exit code) for the first follower that has exited; False when all live."""
        for rank, p in self.procs.items():
            code = p.poll()
            if code is None:
                continue
            if not self._stopping:
                on_lost(rank, code)
            return True
        return False

    def watch(self, on_lost: Callable[[int, int], None], poll_s: float = 0.2) -> threading.Thread:
        """Call on_lost(rank, exit code) the first time a follower exits while the engine is serving."""

        def loop() -> None:
            while not self._stopping and not self.check(on_lost):
                time.sleep(poll_s)

        t = threading.Thread(target=loop, name="dcp-followers", daemon=True)
        t.start()
        return t

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        end = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def rank_lost(rank: int, code: int, cleanup: Callable[[], None] | None = None) -> None:
    """Rank 0's answer to a lost follower: say which rank and how, release this rank's allocations, and end
    the engine at once (never serve with a missing shard: its collectives would hang or answer wrong). The
    main thread may be blocked inside a collective, so this cannot wait for it."""
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    print(f"{DCP_RANK_LOST} rank={rank} {how}", flush=True)
    if cleanup is not None:  # bounded: a cleanup stuck behind a dead collective must not keep us alive
        t = threading.Thread(target=cleanup, name="dcp-cleanup", daemon=True)
        t.start()
        t.join(CLEANUP_S)
    os._exit(RANK_EXIT_CODE)


def free_init_method() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
