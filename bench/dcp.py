"""Decode attention at long context: DCP 1 vs 2 vs 4 ranks, one process per GPU, timed in one run.

Every rank holds 1/N of the context's KV (token t on rank t mod N), computes its partial attention (out,
lse) with the engine's own `folded_attention`, and the N ranks all-gather the partials and merge them by
log-sum-exp (qualify/engine/dcp.py's collective). Each configuration is captured in a CUDA graph on every
rank and replayed in interleaved rounds (the order rotating), timed by CUDA events on rank 0; ranks outside
a configuration wait at a barrier. Work per configuration is the same attention over the same context; it
differs only in how it is split (N shards plus an all-gather of [batch, heads, N, head_dim]). The pooled
selector and the rest of the engine step are left out and said so in the result.

On a host without enough GPUs a configuration is recorded as skipped with the reason. On CPU (gloo, no
graphs, wall-clock timing) it runs small shapes as a smoke test: those figures are not GPU figures.

    python bench/dcp.py --context 131072 --ranks 1,2,4 --out bench/results/dcp-<device>-<date>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_result  # noqa: E402
from bench._gpu import capture, events_us  # noqa: E402
from qualify.engine.model.attention import folded_attention  # noqa: E402

WHAT = (
    "decode attention of one query token per sequence over the whole context, GQA {hq}/{kvh} heads x "
    "{d}, {dtype} KV, split over N DCP ranks (all-gather of partial out/lse, LSE merge); selector and the "
    "rest of the engine step excluded"
)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=131072, help="tokens of context per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ranks", default="1,2,4", help="DCP sizes to compare")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--replays", type=int, default=20, help="graph replays per timed sample")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--out", default=None)
    return p.parse_args()


def _gather_fn(group, n: int):
    def gather(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o_all = torch.empty(n * o.numel(), dtype=o.dtype, device=o.device)
        l_all = torch.empty(n * lse.numel(), dtype=lse.dtype, device=lse.device)
        dist.all_gather_into_tensor(o_all, o.contiguous().view(-1), group=group)
        dist.all_gather_into_tensor(l_all, lse.contiguous().view(-1), group=group)
        return (
            o_all.view(n, *o.shape).squeeze(-2).movedim(0, -2),
            l_all.view(n, *lse.shape).squeeze(-1).movedim(0, -1),
        )

    return gather


def _worker(rank: int, world: int, init: str, a: argparse.Namespace, sizes: list[int], out_q) -> None:
    cuda = a.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    groups = {n: dist.new_group(list(range(n))) for n in sizes}
    dtype = torch.bfloat16 if cuda else torch.float32
    B, Hq, kvh, D, T = a.batch, a.q_heads, a.kv_heads, a.head_dim, a.context
    gen = torch.Generator(device="cpu").manual_seed(1234)
    q = torch.randn(B, 1, Hq, D, generator=gen).to(dev, dtype)
    qpos = torch.full((B, 1), T - 1, dtype=torch.long, device=dev)
    seq = torch.full((B,), T, dtype=torch.long, device=dev)
    steps = {}
    for n in sizes:
        if rank >= n:
            continue
        L = -(-T // n)
        kc = torch.randn(B, 1, L, kvh, D, generator=gen).to(dev, dtype)
        vc = torch.randn(B, 1, L, kvh, D, generator=gen).to(dev, dtype)
        kpos = (torch.arange(L, device=dev) * n + rank)[None]  # token t on rank t mod n
        gather = _gather_fn(groups[n], n) if n > 1 else None

        def step(kc=kc, vc=vc, kpos=kpos, gather=gather):
            return folded_attention(q, qpos, kc, vc, kpos, seq, None, gather)

        steps[n] = capture(step).replay if cuda else step
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(a.rounds):
        shift = r % len(sizes)
        for n in sizes[shift:] + sizes[:shift]:
            dist.barrier()
            if rank < n:
                if cuda:
                    us = events_us(steps[n], a.replays)
                else:
                    t0 = time.perf_counter()
                    for _ in range(a.replays):
                        steps[n]()
                    us = (time.perf_counter() - t0) * 1e6 / a.replays
                samples[n].append(us)
            dist.barrier()
    if rank == 0:
        out_q.put({n: samples[n] for n in sizes})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    a = _args()
    want = sorted({int(x) for x in a.ranks.split(",")})
    have = torch.cuda.device_count() if a.device == "cuda" else max(want)
    sizes = [n for n in want if n <= have]
    skipped = {n: f"needs {n} GPUs, this host has {have}" for n in want if n > have}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = max(sizes)
    procs = [ctx.Process(target=_worker, args=(r, world, init, a, sizes, q)) for r in range(world)]
    for p in procs:
        p.start()
    samples = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
    med = {n: statistics.median(xs) for n, xs in samples.items()}
    result = {
        "bench": "dcp",
        "gpus_on_host": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "timing": "CUDA graph replays, CUDA events on rank 0, interleaved rounds"
        if a.device == "cuda"
        else "wall clock, eager (CPU smoke test; not a GPU figure)",
        "what": WHAT.format(
            hq=a.q_heads, kvh=a.kv_heads, d=a.head_dim, dtype="bf16" if a.device == "cuda" else "fp32"
        ),
        "context": a.context,
        "batch": a.batch,
        "rounds": a.rounds,
        "replays_per_sample": a.replays,
        "median_us": {str(n): round(v, 3) for n, v in med.items()},
        "speedup_vs_dcp1": {str(n): round(med[1] / v, 3) for n, v in med.items()} if 1 in med else {},
        "skipped": {str(n): why for n, why in skipped.items()},
    }
    write_result(result, a.out)


if __name__ == "__main__":
    main()
