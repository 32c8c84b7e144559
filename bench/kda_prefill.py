"""Prefill timing: our Triton varlen KDA prefill vs fla's chunk_kda (optional peer), H=32, K=V=128, bf16."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.kda import build_chunk_metadata, prefill  # noqa: E402
from kernels.kda.chunk import prefill_scratch_specs  # noqa: E402

H, K, V = 32, 128, 128
SHAPES = [(1, 8192), (8, 1024), (1, 32768)]


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # the peer is optional: record why it is missing
        return None, f"fla-core not importable: {type(exc).__name__}: {exc}"
    return chunk_kda, None


def _bench_shape(nseq: int, seqlen: int, dev: torch.device, fla) -> dict:
    bf = torch.bfloat16
    tot = nseq * seqlen
    cu_list = [i * seqlen for i in range(nseq + 1)]
    q, k, a = (torch.randn(tot, H, K, device=dev).to(bf) for _ in range(3))
    v, z = torch.randn(tot, H, V, device=dev).to(bf), torch.randn(tot, H, V, device=dev).to(bf)
    b = torch.randn(tot, H, device=dev).to(bf)
    A_log, dt_bias = torch.randn(H, device=dev) * 0.5, torch.randn(H * K, device=dev)
    w = torch.ones(V, device=dev)
    pool = torch.zeros(nseq + 1, H, V, K, device=dev)
    idx = torch.zeros(tot // 64 + nseq, 2, dtype=torch.int32)
    offs = torch.zeros(nseq + 1, dtype=torch.int32)
    n = build_chunk_metadata(cu_list, 64, idx, offs)
    idx, offs = idx.to(dev), offs.to(dev)
    nc = torch.tensor([n], dtype=torch.int32, device=dev)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    slots = torch.arange(1, nseq + 1, dtype=torch.int32, device=dev)
    has = torch.ones(nseq, dtype=torch.bool, device=dev)
    out = torch.empty(tot, H, V, dtype=bf, device=dev)
    scratch = {
        m: torch.empty(s, dtype=d, device=dev) for m, (s, d) in prefill_scratch_specs(tot, H, K, V).items()
    }
    ours = _time_ms(
        lambda: prefill(
            q, k, v, a, b, A_log, dt_bias, z, w, pool, cu, slots, has, idx, offs, nc, out, scratch=scratch
        )
    )
    row = {"tokens": f"{nseq}x{seqlen}", "ours_ms": round(ours, 4)}
    if fla is not None:
        h0 = torch.zeros(nseq, H, V, K, device=dev)  # V-first, like our pool
        cu_long = cu.long()

        def run_fla() -> None:
            # fla's serving configuration: bounded gate and β sigmoid in kernel, L2 norm in kernel.
            fla(
                q[None],
                k[None],
                v[None],
                a[None],
                b[None],
                initial_state=h0,
                state_v_first=True,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                safe_gate=True,
                lower_bound=-5.0,
                A_log=A_log,
                dt_bias=dt_bias,
                cu_seqlens=cu_long,
                cu_seqlens_cpu=cu_long.cpu(),
            )

        try:
            with torch.inference_mode():
                fla_ms = _time_ms(run_fla)
            row |= {"fla_ms": round(fla_ms, 4), "fla_over_ours": round(fla_ms / ours, 3)}
        except Exception as exc:
            row |= {"fla_ms": None, "fla_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def bench_prefill(device: str = "cuda") -> dict:
    dev = torch.device(device)
    fla, fla_reason = _fla_chunk_kda()
    rows = [_bench_shape(nseq, seqlen, dev, fla) for nseq, seqlen in SHAPES]
    return {
        "device": torch.cuda.get_device_name(dev),
        "shape": {"H": H, "K": K, "V": V, "chunk": 64},
        "note": "ours includes gate, beta sigmoid, L2 norm and gated RMSNorm; fla excludes the gated RMSNorm",
        "fla": "fla-core chunk_kda" if fla is not None else f"unavailable: {fla_reason}",
        "prefill": rows,
    }


if __name__ == "__main__":
    print(json.dumps(bench_prefill(), indent=2))
