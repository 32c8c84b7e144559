"""Prefill timing: our Triton varlen KDA prefill vs fla's chunk_kda (optional peer), H=32, K=V=128, bf16."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved_medians  # noqa: E402
from kernels.kda import build_chunk_metadata, prefill  # noqa: E402
from kernels.kda.chunk import prefill_scratch_specs  # noqa: E402

H, K, V = 32, 128, 128
SHAPES = [(1, 8192), (8, 1024), (1, 32768)]


def _time_ms(fn, iters: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _time_interleaved(fns: dict[str, object], rounds: int = 6) -> dict[str, float]:
    """Median ms per call for each contender, timed in alternating rounds so neither gets the warm GPU."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    medians = interleaved_medians({k: lambda fn=fn: {"ms": [_time_ms(fn)]} for k, fn in fns.items()}, rounds)
    return {k: ms["ms"] for k, ms in medians.items()}


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # the peer is optional: record why it is missing
        return None, f"fla-core not importable: {type(exc).__name__}: {exc}"
    return chunk_kda, None


SWEEP = [(bv, w, st) for bv in (16, 32) for w in (4, 8) for st in (1, 2, 3, 4)] + [(64, 4, 2), (64, 8, 2)]


def _bench_shape(nseq: int, seqlen: int, dev: torch.device, fla, sweep: bool = False) -> dict:
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

    def run_ours() -> None:
        args = (q, k, v, a, b, A_log, dt_bias, z, w, pool, cu, slots, has, idx, offs, nc, out)
        prefill(*args, scratch=scratch)

    contenders = {"ours": run_ours}
    row: dict = {"tokens": f"{nseq}x{seqlen}"}
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

        def run_fla_inference() -> None:
            with torch.inference_mode():
                run_fla()

        try:
            run_fla_inference()
            contenders["fla"] = run_fla_inference
        except Exception as exc:
            row |= {"fla_ms": None, "fla_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    ms = _time_interleaved(contenders)
    row["ours_ms"] = round(ms["ours"], 4)
    if "fla" in ms:
        row |= {"fla_ms": round(ms["fla"], 4), "fla_over_ours": round(ms["fla"] / ms["ours"], 3)}
    if sweep:
        row["state_launch_sweep"] = _sweep_state_launch(run_ours)
    return row


def _sweep_state_launch(run_ours) -> list[dict]:
    """Our prefill with the chunk-recurrence kernel at other (BV, warps, stages); defaults restored after."""
    from kernels.kda import chunk

    saved = chunk._STATE_BV, chunk._STATE_WARPS, chunk._STATE_STAGES
    rows = []
    try:
        for bv, warps, stages in SWEEP:
            chunk._STATE_BV, chunk._STATE_WARPS, chunk._STATE_STAGES = bv, warps, stages
            try:
                ms = _time_interleaved({"x": run_ours}, rounds=3)["x"]
                rows.append({"BV": bv, "num_warps": warps, "num_stages": stages, "ms": round(ms, 4)})
            except Exception as exc:
                rows.append({"BV": bv, "num_warps": warps, "num_stages": stages, "error": str(exc)[:200]})
    finally:
        chunk._STATE_BV, chunk._STATE_WARPS, chunk._STATE_STAGES = saved
    return sorted(rows, key=lambda r: r.get("ms", 1e9))


def bench_prefill(device: str = "cuda", sweep: bool = False) -> dict:
    """Each shape: ours and fla timed in alternating rounds; with sweep, the longest shape also times our
    chunk-recurrence kernel at other launch shapes (the one sequential loop, so the one that scales)."""
    dev = torch.device(device)
    fla, fla_reason = _fla_chunk_kda()
    rows = [
        _bench_shape(nseq, seqlen, dev, fla, sweep=sweep and seqlen == max(s for _, s in SHAPES))
        for nseq, seqlen in SHAPES
    ]
    import triton

    return {
        "device": torch.cuda.get_device_name(dev),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"H": H, "K": K, "V": V, "chunk": 64},
        "note": "ours includes gate, beta sigmoid, L2 norm and gated RMSNorm; fla excludes the gated RMSNorm",
        "timing": "eager calls, 6 alternating rounds of 10, median ms per call",
        "fla": "fla-core chunk_kda" if fla is not None else f"unavailable: {fla_reason}",
        "prefill": rows,
    }


if __name__ == "__main__":
    print(json.dumps(bench_prefill(sweep="--sweep" in sys.argv), indent=2))
