"""Compile our Triton kernels for an H200 (sm_90) on a machine without a GPU, and report what ptxas says
about each: registers per thread, spill stores and loads, stack, and shared memory per program. Prints
JSON; --out writes it too.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python, not its compilation: a kernel that the
interpreter runs can still fail to compile (a variable redefined with another shape inside an `if`), and a
kernel that compiles can spill. Both are visible here, before any device time is spent. The kernels are
compiled at the production shapes (H = 32, K = V = 128, 64-token chunks) with the launch constants the
modules use; ptxas is the one Triton ships.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402

H, K, V, BT, BC = 32, 128, 128, 64, 16
BF16, F32, I32 = "*bf16", "*fp32", "*i32"
# Integer arguments that are multiples of 16 at the production shapes (row strides of [rows, H, K] and of
# the engine's packed q/k/v rows, a state slot's stride).
ALIGNED_INTS = {"stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_at"}
ALIGNED_INTS |= {"stride_ah", "stride_zt", "stride_zh", "stride_ot", "stride_oh", "stride_slot"}


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], num_warps: int):
    """`fn` compiled for sm_90 (Triton's own pipeline through ptxas; raises on any error): the compiled
    kernel, whose .asm["ptx"] is its PTX and .metadata.shared its shared memory per program.

    Specialized as a launch would be: every pointer 16-byte aligned (torch's allocations and the views the
    callers pass are), and each integer argument named in ALIGNED_INTS divisible by 16, so the loads
    vectorize as they do on the device."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = fn.arg_names
    aligned = [n for n, t in signature.items() if t.startswith("*") or n in ALIGNED_INTS]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def ptxas_report(ptx: str) -> dict[str, int]:
    """registers, spill stores/loads and stack bytes per thread, from `ptxas -v` on the PTX."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        err = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", path, "-o", os.devnull],
            capture_output=True, text=True, timeout=300, check=True,
        ).stderr  # fmt: skip
    num = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    return {k: int(m.group(1)) if (m := re.search(p, err)) else 0 for k, p in num.items()}


def _decode_cases() -> Iterator[tuple[str, object, dict, dict, int]]:
    import importlib

    dm = importlib.import_module("kernels.kda.decode")  # the package's `decode` is the function

    names = [
        "q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_weight", "state", "state_indices",
        "num_accepted", "num_live", "out",
    ]  # fmt: skip
    types = [BF16] * 5 + [F32, F32, BF16, F32, F32, I32, I32, I32, BF16]
    sig = dict(zip(names, types, strict=True))
    for s in ("qt", "qh", "kt", "kh", "vt", "vh", "at", "ah", "bt", "bh", "zt", "zh", "ot", "oh"):
        sig[f"stride_{s}"] = "i32"
    sig.update(stride_slot="i32", stride_idx_r="i32", stride_idx_c="i32")
    sig.update(scale="fp32", lower_bound="fp32", norm_eps="fp32")
    bv, warps = dm.default_launch(1, H, V)
    for T in (1, 4):
        c = dict(H=H, K=K, V=V, T=T, BV=bv, FUSE_NORM=bv == V)
        yield f"decode T={T} split", dm._kda_decode_kernel, sig, c, warps
        c = dict(H=H, K=K, V=V, T=T, BV=V, FUSE_NORM=True)
        yield f"decode T={T} fused row", dm._kda_decode_kernel, sig, c, 4
    norm = {"out": BF16, "z": BF16, "norm_weight": F32, "stride_ot": "i32", "stride_oh": "i32"}
    norm.update(stride_zt="i32", stride_zh="i32", norm_eps="fp32")
    yield "decode gated norm", dm._gated_rmsnorm_kernel, norm, dict(H=H, V=V), 1


def _prefill_cases() -> Iterator[tuple[str, object, dict, dict, int]]:
    import triton.language as tl

    from kernels.kda import chunk as ch
    from kernels.kda import chunk_intra as ci

    chunks = {"cu_seqlens": I32, "chunk_indices": I32, "n_chunks_ptr": I32, "n_chunks": "i32"}
    gate = {"a": BF16, "A_log": F32, "dt_bias": F32, "gcum": F32, **chunks, "lower_bound": "fp32"}
    c = dict(H=H, K=K, BK=min(K, ch._GATE_BK), BT=BT, DEVICE_COUNT=True)
    yield "prefill gate", ch._gate_kernel, gate, c, ch._GATE_WARPS
    diag = {"q": BF16, "k": BF16, "b": BF16, "gcum": F32, "q_tilde": BF16, "k_bar": BF16, "p": BF16}
    diag.update({"x_inv": F32, "rn": F32, **chunks, "scale": "fp32"})
    c = dict(H=H, K=K, BT=BT, BC=BC, DEVICE_COUNT=True, DT=tl.bfloat16)
    yield "prefill diagonal pass", ci.diag_kernel, diag, c, ch._DIAG_WARPS
    inter = {"q": BF16, "k": BF16, "b": BF16, "gcum": F32, "p": BF16, "x_inv": F32, "rn": F32, **chunks}
    c = dict(H=H, K=K, BT=BT, BC=BC, BK=min(K, ch._INTER_BK), DEVICE_COUNT=True, DT=tl.bfloat16)
    yield "prefill off-diagonal pass", ci.inter_solve_kernel, inter, c, ch._INTER_WARPS
    wu = {"k": BF16, "v": BF16, "b": BF16, "gcum": F32, "x_inv": F32, "rn": F32, "w": BF16, "u": BF16}
    wu.update(chunks)
    c = dict(H=H, K=K, V=V, BT=BT, DEVICE_COUNT=True, DT=ch._WU_DT)
    yield "prefill W/U", ci.wu_kernel, wu, c, ch._WU_WARPS
    state = {n: BF16 for n in ("q_tilde", "k_bar", "w", "u", "p", "out")}
    state = {"gcum": F32, **state, "state": F32, "cu_seqlens": I32, "chunk_offsets": I32, "slots": I32}
    state["has_initial"] = "*u8"
    for bv in (32, 64):
        c = dict(H=H, K=K, V=V, BT=BT, BV=bv, WHILE_LOOP=False, DT=tl.bfloat16, VB_FIRST=ch._STATE_VB_FIRST)
        yield f"prefill state pass BV={bv}", ch._state_kernel, state, c, ch._STATE_WARPS
    norm = {"out": BF16, "z": BF16, "weight": F32, "cu_seqlens": I32, "n_seqs": "i32", "eps": "fp32"}
    norm["rows_cap"] = "i32"
    yield "prefill gated norm", ch._gated_norm_kernel, norm, dict(H=H, V=V, ROWS=16), 4


CASES = {"decode": _decode_cases, "prefill": _prefill_cases}


def report(which: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    rows = []
    for group in which:
        for label, fn, sig, consts, warps in CASES[group]():
            k = compile_sm90(fn, sig, consts, warps)
            row = {"kernel": label, "num_warps": warps, **ptxas_report(k.asm["ptx"])}
            rows.append({**row, "shared_bytes": int(k.metadata.shared)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="*", help=f"which kernels: {', '.join(CASES)} (default: all)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    unknown = sorted(set(args.groups) - set(CASES))
    if unknown:
        ap.error(f"unknown group(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("bench/sm90.py compiles kernels: run it without TRITON_INTERPRET")
    rows = report(tuple(args.groups or CASES))
    target = {"arch": "sm_90a (H200)", "compiled_on": "the machine in provenance.device; no GPU needed"}
    shapes = {"H": H, "K": K, "V": V, "chunk": BT, "sub_chunk": BC}
    write_result({"bench": "sm90", "target": target, "shapes": shapes, "kernels": rows}, args.out, indent=1)


if __name__ == "__main__":
    main()
