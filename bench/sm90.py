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
import itertools
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


def compile_sm90(
    fn,
    signature: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int,
    num_stages: int = 3,
    aligned_ints: tuple[str, ...] = (),
    maxnreg: int | None = None,
):
    """`fn` compiled for sm_90 (Triton's own pipeline through ptxas; raises on any error): the compiled
    kernel, whose .asm["ptx"] is its PTX and .metadata.shared its shared memory per program.

    Specialized as a launch would be: every pointer 16-byte aligned (torch's allocations and the views the
    callers pass are), and each integer argument named in ALIGNED_INTS or aligned_ints divisible by 16,
    so the loads vectorize, and the loops pipeline, as they do on the device (a projection's weight loads
    are software-pipelined only when its strides are known multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = fn.arg_names
    ints = ALIGNED_INTS | set(aligned_ints)
    aligned = [n for n, t in signature.items() if t.startswith("*") or n in ints]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:  # ptxas's register cap, as a launch's maxnreg= sets it
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


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


_PTX_OP = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*?);")
_PTX_REG = re.compile(r"%[a-z]+\d+")


def pdl_report(ptx: str, params: list[str], pointers: set[str]) -> dict:
    """What a kernel compiled with programmatic dependent launch does before its griddepcontrol.wait, read
    from its PTX: the wait and release (launch_dependents) instructions it holds, and which of its pointer
    arguments (`pointers`, among `params`: the runtime arguments in order) its global loads and L2
    prefetches read through, and its stores and atomics write through, before the first wait. Registers are
    followed from each ld.param through the arithmetic that derives addresses from it; a loaded value
    carries no argument on. Before the wait a kernel may read only what no kernel of a step writes
    (weights) and write nothing: anything else could be the previous kernel's output, read before it is
    complete, or its input, overwritten while it still reads it."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = sum("griddepcontrol.wait" in ln for ln in lines)
    releases = sum("griddepcontrol.launch_dependents" in ln for ln in lines)
    taint: dict[str, set[str]] = {}
    read: set[str] = set()
    written: set[str] = set()
    for ln in lines:
        if "griddepcontrol.wait" in ln:
            break
        m = _PTX_OP.match(ln)
        if not m:
            continue
        op, args = m.group(1), m.group(2)
        regs = _PTX_REG.findall(args)
        if op.startswith("ld.param"):
            idx = re.search(r"_param_(\d+)", args)
            if idx and regs and int(idx.group(1)) < len(params):
                taint[regs[0]] = {params[int(idx.group(1))]}
            continue
        addr = re.search(r"\[\s*(%\w+)", args)
        if op.startswith(("st.", "red.", "atom.")) and addr:
            written |= taint.get(addr.group(1), set())
            if op.startswith("atom."):
                taint.pop(regs[0], None)  # the old value it returns: no argument's address
            continue
        if op.startswith(("ld.global", "prefetch")):
            if addr:
                read |= taint.get(addr.group(1), set())
            for r in regs:
                if addr is None or r != addr.group(1):
                    taint.pop(r, None)  # a loaded value: no argument's address
            continue
        if regs:
            taint[regs[0]] = set().union(*(taint.get(r, set()) for r in regs[1:]))
    return {
        "waits": waits,
        "releases": releases,
        "read_before_wait": sorted(read & pointers),
        "written_before_wait": sorted(written & pointers),
    }


# SASS opcodes counted in a projection's weight loop: the async copies that feed it (LDGSTS), the tensor
# core ops (HMMA), and what must not be there: synchronous global loads and stores (each one a round trip
# the loop waits for, or a store beside the weight stream), special-function ops (MUFU: exp, reciprocal),
# warp shuffles (reductions), shared-memory stores (layout conversions).
LOOP_OPS = ("LDGSTS", "HMMA", "LDSM", "BAR", "LDG", "STG", "STS", "MUFU", "SHFL")


def _sass(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [tool, "-c", path], capture_output=True, text=True, timeout=300, check=True
        ).stdout


def _sass_ops(cubin: bytes) -> tuple[dict[str, int], list[str]]:
    """The SASS of `cubin` as its instructions in order (predicates stripped) and each label's index."""
    labels: dict[str, int] = {}
    ops: list[str] = []
    for line in _sass(cubin).splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            ops.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()))
    return labels, ops


def _stem(op: str) -> str:
    return op.split()[0].split(".")[0] if op else ""


def weight_loop(cubin: bytes) -> dict[str, int]:
    """The innermost loop with tensor-core ops in the SASS of `cubin` (a projection's loop over K): its
    instruction count and the count of each of LOOP_OPS. Loops are found as backward branches."""
    labels, ops = _sass_ops(cubin)
    loops = []
    for i, op in enumerate(ops):
        m = re.match(r"BRA\b.*?(\.L_x_\d+)", op)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = [_stem(o) for o in ops[labels[m.group(1)] : i + 1]]
            if "HMMA" in body:
                loops.append(body)
    if not loops:
        return {"instructions": 0}
    body = min(loops, key=len)
    return {"instructions": len(body), **{op: body.count(op) for op in LOOP_OPS}}


# What a prefill pass's static SASS is made of: op families by their first word's stem (static counts: a loop
# body counts once however often it runs), a proxy for issue-bound passes' instruction mix before any GPU.
SASS_FAMILIES = {
    "tensor": ("HMMA", "HGMMA"),  # mma.sync, and wgmma (the sequential pass)
    "special": ("MUFU",),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL"),
    "int_and_address": ("IMAD", "IADD3", "LEA", "ISETP", "SHF", "LOP3", "SEL", "IABS", "IMNMX", "PRMT"),
    "convert": ("F2F", "F2FP", "I2F", "F2I"),
    "global_memory": ("LDG", "STG", "LDGSTS", "RED", "ATOM"),
    "shared_memory": ("LDS", "STS", "LDSM"),
    "shuffle_and_barrier": ("SHFL", "BAR"),
}


def sass_mix(cubin: bytes) -> dict[str, int]:
    """Static instruction counts of `cubin`'s SASS: the total and each of SASS_FAMILIES."""
    stems = [_stem(op) for op in _sass_ops(cubin)[1]]
    out = {"instructions": len(stems)}
    for family, names in SASS_FAMILIES.items():
        out[family] = sum(stems.count(n) for n in names)
    return out


def _decode_cases() -> Iterator[tuple[str, object, dict, dict, int]]:
    import importlib

    dm = importlib.import_module("kernels.kda.decode")  # the package's `decode` is the function

    names = [
        "q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_weight", "state", "state_indices",
        "num_accepted", "num_live", "out", "partials",
    ]  # fmt: skip
    types = [BF16] * 5 + [F32, F32, BF16, F32, F32, I32, I32, I32, BF16, "*i64"]
    sig = dict(zip(names, types, strict=True))
    for s in ("qt", "qh", "kt", "kh", "vt", "vh", "at", "ah", "bt", "bh", "zt", "zh", "ot", "oh"):
        sig[f"stride_{s}"] = "i32"
    sig.update(stride_slot="i32", stride_idx_r="i32", stride_idx_c="i32")
    sig.update(scale="fp32", lower_bound="fp32", norm_eps="fp32")
    bv, warps = dm.default_launch(1, H, V)
    switches = dm.switch_constexprs()
    for T in (1, 4):
        # the norm as a batch-1 decode (one launch) and a verify (a second launch) take it
        mode = dm.ONE_LAUNCH if T == 1 else dm.TWO_LAUNCHES
        c = dict(H=H, K=K, V=V, T=T, BV=bv, FUSE_NORM=bv == V, NORM=mode, PDL=True, **switches)
        yield f"decode T={T} split", dm._kda_decode_kernel, sig, c, warps
        c = dict(H=H, K=K, V=V, T=T, BV=V, FUSE_NORM=True, NORM=dm.NO_NORM, PDL=True, **switches)
        yield f"decode T={T} fused row", dm._kda_decode_kernel, sig, c, 4
    norm = {"out": BF16, "z": BF16, "norm_weight": F32, "partials": "*i64", "stride_ot": "i32"}
    norm.update(stride_oh="i32", stride_zt="i32", stride_zh="i32", norm_eps="fp32", n_rh="i32")
    c = dict(H=H, V=V, NV=V // bv, RH=dm._NORM_PAIRS, PDL=True)
    yield "decode gated norm", dm._gated_rmsnorm_kernel, norm, c, dm._NORM_WARPS


def _prefill_cases() -> Iterator[tuple[str, object, dict, dict, int]]:
    import triton.language as tl

    from kernels.kda import chunk as ch
    from kernels.kda import chunk_intra as ci

    chunks = {"cu_seqlens": I32, "chunk_indices": I32, "n_chunks_ptr": I32, "n_chunks": "i32"}
    gate = {"a": BF16, "A_log": F32, "dt_bias": F32, "gcum": F32, **chunks, "lower_bound": "fp32"}
    # the module's channel blocks, and bench/kda_prefill.py's ours_before_2026_12_05 (32-channel blocks)
    default = (min(K, ch._GATE_BK), ch._GATE_WARPS)
    for bk, warps in (default, (32, 4)):
        c = dict(H=H, K=K, BK=bk, BT=BT, DEVICE_COUNT=True)
        name = "prefill gate" + ("" if (bk, warps) == default else f" BK={bk} at {warps} warps")
        yield name, ch._gate_kernel, gate, c, warps
    # _GCUM_LOG2 with _EXP_FTZ (the defaults): Γ in log2 units, the sigmoid by ex2 and rcp (ftz)
    c = dict(H=H, K=K, BK=default[0], BT=BT, DEVICE_COUNT=True, EXP="2_ftz")
    yield "prefill gate, Gamma in log2 units, fast sigmoid", ch._gate_kernel, gate, c, default[1]
    diag = {"q": BF16, "k": BF16, "b": BF16, "gcum": F32, "q_tilde": BF16, "k_bar": BF16, "p": BF16}
    diag.update({"x_inv": F32, "rn": F32, **chunks, "scale": "fp32"})
    for zero_right in (True, False):  # zeros written right of the diagonal (not _TRIL_LOADS), or none
        c = dict(H=H, K=K, BT=BT, BC=BC, DEVICE_COUNT=True, DT=tl.bfloat16, ZERO_RIGHT=zero_right)
        name = "prefill diagonal pass" + ("" if zero_right else ", nothing right of the diagonal")
        yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS
    # _OFFDIAG_IN_DIAG: the diagonal pass also computes its row block's off-diagonal blocks, then the merge
    # (warps, stages) as bench/kda_prefill.py's variants launch it
    for warps, stages in ((2, 2), (4, 1)):
        c = dict(H=H, K=K, BT=BT, BC=BC, DEVICE_COUNT=True, DT=tl.bfloat16, ZERO_RIGHT=False, OFFDIAG=True)
        c["BK"] = min(K, ch._INTER_BK)
        name = f"prefill diagonal pass with the off-diagonal blocks, {warps} warps, {stages} stage(s)"
        yield name, ci.diag_kernel, diag, c, warps, (stages, ())
    # _OFFDIAG_NORMS_FROM_SLICES alone (in natural units, uncapped), at the default launch
    c = dict(H=H, K=K, BT=BT, BC=BC, DEVICE_COUNT=True, DT=tl.bfloat16, ZERO_RIGHT=False, OFFDIAG=True)
    c.update(BK=min(K, ch._INTER_BK), NK_SLICES=True)
    name = "prefill diagonal pass with the off-diagonal blocks, their key norms from the K slices"
    yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS, (ch._DIAG_STAGES, ())
    # _DIAG_ROWS_IN_REGS: the substitution's rows of A_ii from the registers
    c = dict(c, NK_SLICES=False, ROWS_IN_REGS=True)
    name = "prefill diagonal pass with the off-diagonal blocks, the substitution's rows from the registers"
    yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS, (ch._DIAG_STAGES, ())
    # _EXP_FTZ: the exponentials as ex2.approx.ftz, in the diagonal pass and in W/U; with _GCUM_LOG2 too,
    # of Γ stored in log2 units (ours_exp_ftz and ours_exp2_ftz of bench/results/kda-prefill-h100-2026-12-06-
    # variants.json)
    for mode, what in (("e_ftz", "exponentials flushing denormals"), ("2_ftz", "Gamma in log2 units, ftz")):
        c = dict(c, ROWS_IN_REGS=False, EXP=mode)
        name = f"prefill diagonal pass with the off-diagonal blocks, {what}"
        yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS, (ch._DIAG_STAGES, ())
    # the module's settings since 2026-12-06: Γ in log2 units, ftz, the key norms from the K slices, capped
    # at 168 registers (six programs of 2 warps per SM); here its grid chunk-first (bench/kda_prefill.py's
    # ours_diag_chunk_first)
    c = dict(c, NK_SLICES=True)
    name = "prefill diagonal pass with the off-diagonal blocks, Gamma in log2 units, ftz, norms from slices"
    yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS, (ch._DIAG_STAGES, (), 168)
    # and its grid as (sub-chunk, chunk, head) (_DIAG_SUB_FIRST: the module's default)
    swapped = dict(c, SUB_FIRST=True)
    launch = (ch._DIAG_STAGES, (), 168)
    yield name + ", sub-chunks side by side", ci.diag_kernel, diag, swapped, ch._DIAG_WARPS, launch
    # and in natural units (bench/kda_prefill.py's ours_gamma_natural). At 160 registers the pass spills 16
    # bytes, and the substitution's rows from the registers beside these settings 4 (neither timed so).
    c = dict(c, EXP="e_ftz")
    name = "prefill diagonal pass with the off-diagonal blocks, ftz, norms from slices, "
    name += "Gamma in natural units"
    yield name, ci.diag_kernel, diag, c, ch._DIAG_WARPS, (ch._DIAG_STAGES, (), 168)
    merge = {"x_inv": F32, **chunks}
    c = dict(H=H, BT=BT, BC=BC, DEVICE_COUNT=True, PREC=ch._MERGE_PRECISION)
    yield "prefill merge of the off-diagonal blocks", ci.merge_kernel, merge, c, ch._MERGE_WARPS
    c = dict(H=H, BT=BT, BC=BC, DEVICE_COUNT=True, PREC="tf32x3")  # bench/kda_prefill.py's ours_merge_tf32x3
    yield "prefill merge of the off-diagonal blocks, tf32x3 at 1 warp", ci.merge_kernel, merge, c, 1
    inter = {"q": BF16, "k": BF16, "b": BF16, "gcum": F32, "p": BF16, "x_inv": F32, "rn": F32, **chunks}
    c = dict(H=H, K=K, BT=BT, BC=BC, BK=min(K, ch._INTER_BK), DEVICE_COUNT=True, DT=tl.bfloat16)
    yield "prefill off-diagonal pass", ci.inter_solve_kernel, inter, c, ch._INTER_WARPS
    wu = {"k": BF16, "v": BF16, "b": BF16, "gcum": F32, "x_inv": F32, "rn": F32, "w": BF16, "u": BF16}
    wu.update(chunks)
    for tril in (False, True):  # _TRIL_LOADS
        c = dict(H=H, K=K, V=V, BT=BT, DEVICE_COUNT=True, DT=ch._WU_DT, TRIL=tril)
        yield "prefill W/U" + (", X's lower triangle" if tril else ""), ci.wu_kernel, wu, c, ch._WU_WARPS
    c = dict(H=H, K=K, V=V, BT=BT, DEVICE_COUNT=True, DT=ch._WU_DT, TRIL=True, EXP="e_ftz")  # _EXP_FTZ
    yield (
        "prefill W/U, X's lower triangle, exponentials flushing denormals",
        ci.wu_kernel,
        wu,
        c,
        ch._WU_WARPS,
    )
    state = {n: BF16 for n in ("q_tilde", "k_bar", "w", "u", "p", "out")}
    state = {"gcum": F32, **state, "state": F32, "cu_seqlens": I32, "chunk_offsets": I32, "slots": I32}
    state["has_initial"] = "*u8"
    # pre: _STATE_PREFETCH_G, tril: _TRIL_LOADS (the defaults), and the state pass as it was before either
    for bv, (pre, tril) in itertools.product((32, 64), ((True, True), (False, False))):
        c = dict(H=H, K=K, V=V, BT=BT, BV=bv, WHILE_LOOP=False, DT=tl.bfloat16, VB_FIRST=ch._STATE_VB_FIRST)
        c.update(PREFETCH_G=pre, TRIL=tril, EXP="2_ftz" if pre else "e")  # the defaults, or as before them
        name = f"prefill state pass BV={bv}" + (", Gamma_C a chunk ahead" if pre else "")
        name += ", P's lower triangle" if tril else ""
        name += ", Gamma in log2 units, ftz" if pre else ""
        yield name, ch._state_kernel, state, c, ch._STATE_WARPS
    norm = {"out": BF16, "z": BF16, "weight": F32, "cu_seqlens": I32, "n_seqs": "i32", "eps": "fp32"}
    norm["rows_cap"] = "i32"
    yield "prefill gated norm", ch._gated_norm_kernel, norm, dict(H=H, V=V, ROWS=16), 4


def _sig(fn, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    """fn's runtime arguments: the named pointers, fp32 for `floats`, i32 for every other one."""
    return {n: pointers.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names if n not in constexprs}


def _fused_cases() -> Iterator[tuple]:
    """kernels/fused.py at the proxy preset's shapes (hidden 4096, MLP 8192, KDA 32 x 128, GQA 32/4 x 128,
    a 2304-token block over 4 DCP shards, 64-token selector groups, top 16), each projection with the
    launch shape the module's table gives it, at a 1-request (16-row tile) and a 32-row step, PDL on."""
    from kernels import fused as fu

    hid, mlp, hk, vocab = 4096, 8192, H * K, 260
    lin_ptrs = {n: BF16 for n in ("x", "w", "y", "res", "g", "s_out", "u_out")}
    lin_ptrs |= {"sq": F32, "part": F32, "counters": I32}
    strides = ("N", "T", "stride_x", "stride_w", "stride_y", "stride_r", "stride_s")
    in_proj = 3 * hk + H + 2 * K
    # (label, N, K, kind, config[, ADD]): kinds as kernels.fused._KERNELS names them; ADD 2 is the epilogue of
    # kernels.fused.ADD_SQ_IN_REGS (else 1 for an add-and-norm launch, 0 for the others)
    # the plain projection at an add-and-norm launch's own shape where kernels.fused.KIND_SHAPES gives it
    # one, so that the two weight loops are compared at one launch shape (tests/kernels/test_sm90_compile.py)
    at_kind_shapes = [
        (f"{label} at its add and norm's shape", hid, k, "plain", fu.KIND_SHAPES[("add_norm", hid, k)])
        for label, k in (("down", mlp), ("out_proj / o_proj", hk))
        if ("add_norm", hid, k) in fu.KIND_SHAPES
    ]
    projections = [
        ("in_proj, deferred norm", in_proj, hid, "norm", None),
        ("in_proj", in_proj, hid, "plain", None),  # the first block's, after the norm's kernel
        ("gate_up, deferred norm and SwiGLU", 2 * mlp, hid, "swiglu", None),
        ("gate_up", 2 * mlp, hid, "plain", None),
        ("down, add and norm", hid, mlp, "add_norm", None),
        ("down, add and norm, sums in registers", hid, mlp, "add_norm", None, 2),
        ("down", hid, mlp, "plain", None),  # the last block's: the head's launch adds it
        ("out_proj / o_proj, add and norm", hid, hk, "add_norm", None),
        ("out_proj / o_proj, add and norm, sums in registers", hid, hk, "add_norm", None, 2),
        ("out_proj / o_proj", hid, hk, "plain", None),
        ("out_proj / o_proj, split 4", hid, hk, "plain", (32, 256, 4, 3, 4)),
        *at_kind_shapes,
        ("LM head, add and norm", vocab, hid, "head", fu.HEAD_SHAPE),
    ]
    for label, N, Kd, kind, config, *add_mode in projections:
        fn = fu._KERNELS[kind]
        BN, BK, warps, stages, split = fu.launch_shape(N, Kd, config, kind)
        swiglu = kind == "swiglu"
        even = ((N // 2) % (BN // 2) == 0 if swiglu else N % BN == 0) and Kd % (split * BK) == 0
        T = (
            hid // 32
            if kind == "norm" or swiglu
            else fu.column_tiles(N, Kd, config, kind)
            if kind == "add_norm"
            else 0
        )
        for BM in (16, 32):
            c = dict(
                K=Kd, BM=BM, BN=BN, BK=BK, EVEN=even, TP=fu._next_pow2(max(T, 1)), PRO_HEAD=kind == "head"
            )
            add = add_mode[0] if add_mode else int(kind == "add_norm")
            c.update(RSTD=kind == "norm" or swiglu, SWIGLU=swiglu, ADD=add)
            c.update(SPLIT=split, PDL=True, PF=fu.prefetch_lines(BK))
            sig = _sig(fn, c, lin_ptrs, ("eps",))
            if kind == "head":
                sig["y"] = F32  # fp32 logits; a 260-column row is no multiple of 16
            aligned = tuple(n for n in strides if kind != "head" or n not in ("N", "stride_y"))
            # what bench/sm90.py reports of a projection's weight loop is compared across kinds at one
            # launch shape (tests/kernels/test_sm90_compile.py)
            proj = {"kind": kind, "K": Kd, "BM": BM, "launch_shape": [BN, BK, warps, stages, split]}
            yield f"linear {label} BM={BM}", fn, sig, c, warps, (stages, aligned), proj
    c = dict(HAS_RES=True, BD=hid, PDL=True)
    sig = _sig(fu._rmsnorm_kernel, c, dict.fromkeys(("x", "res", "w", "y", "s"), BF16), ("eps",))
    yield (
        "rmsnorm + add",
        fu._rmsnorm_kernel,
        sig,
        c,
        8,
        (1, ("stride_x", "stride_r", "stride_y", "stride_s", "D")),
    )
    c = dict(BLOCK=1024, PDL=True)
    sig = _sig(fu._silu_mul_kernel, c, {"gu": BF16, "out": BF16})
    yield "silu_mul", fu._silu_mul_kernel, sig, c, 4, (1, ("stride_g", "stride_o", "inner"))
    conv_ptrs = dict.fromkeys(
        ("x", "conv_state", "weight", "out", "b_out", "f_b", "g_b", "a_out", "z_out"), BF16
    )
    conv_ptrs |= {"slots": I32, "num_accepted": I32}
    for T in (1, 4):
        c = dict(T=T, W=4, BC=128, BWIN=fu._next_pow2(3 + T), BH=H, GATES=True, GK=K, BG=64, BMG=16)
        c.update(FP32=False, PDL=True)
        aligned = ("stride_x", "stride_s0", "stride_o", "stride_b", "stride_a", "stride_z", "C", "HK")
        sig = _sig(fu._conv_gates_decode_kernel, c, conv_ptrs)
        yield f"conv + gates T={T}", fu._conv_gates_decode_kernel, sig, c, 4, (1, aligned)
    c = dict(W=4, BC=128, PDL=True)
    ptrs = {"x": BF16, "positions": I32, "cu_seqlens": I32, "slots": I32, "weight": BF16, "out": BF16}
    ptrs["conv_state"] = BF16
    sig = _sig(fu._conv_prefill_kernel, c, ptrs)
    yield "conv prefill", fu._conv_prefill_kernel, sig, c, 1, (1, ("stride_x", "stride_o", "stride_s0", "C"))
    paged = ("span", "block_size")
    c = dict(D=128, PDL=True)
    ptrs = {"qkv": BF16, "positions": I32, "cos": F32, "sin": F32, "block_tables": I32, "k_cache": BF16}
    ptrs |= {"v_cache": BF16, "q_out": BF16}
    sig = _sig(fu._rope_kv_kernel, c, ptrs)
    yield "rope + paged K/V write", fu._rope_kv_kernel, sig, c, 1, (1, ("stride_t", "HQ", *paged))
    c = dict(D=128, BP=64, PDL=True)
    ptrs = {"k_cache": BF16, "block_tables": I32, "seq_lens": I32, "pooled": F32}
    sig = _sig(fu._pool_kernel, c, ptrs)
    yield "selector key pooling", fu._pool_kernel, sig, c, 4, (1, ("G", "max_len", "pool", *paged))
    c = dict(KVH=4, TOPK=16, K=16, GQ=8, D=128, BGR=64, BT=16, RANK=True, PDL=True)
    sig = _sig(fu._select_kernel, c, {"q": BF16, "positions": I32, "pooled": F32, "rows": I32}, ("scale",))
    yield "selector top-k by rank", fu._select_kernel, sig, c, 4, (1, ("stride_rows", "HQ", "G", "pool"))
    c = dict(GQ=8, BG=16, D=128, BL=64, BT=16, FP32=False, PDL=True)
    ptrs = {"q": BF16, "positions": I32, "k_cache": BF16, "v_cache": BF16, "block_tables": I32}
    ptrs |= {"seq_lens": I32, "rows": I32, "out": BF16}
    sig = _sig(fu._attn_decode_kernel, c, ptrs, ("scale",))
    yield (
        "selected-rows attention",
        fu._attn_decode_kernel,
        sig,
        c,
        4,
        (1, ("HQ", "G", "max_len", "pool", *paged)),
    )


CASES = {"decode": _decode_cases, "prefill": _prefill_cases, "fused": _fused_cases}


def report(which: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    rows = []
    for group in which:
        for label, fn, sig, consts, warps, *launch in CASES[group]():
            stages, aligned, *cap = launch[0] if launch else (3, ())  # the fused cases name both
            k = compile_sm90(fn, sig, consts, warps, stages, aligned, *cap)
            row = {"kernel": label, "group": group, "num_warps": warps, "num_stages": stages}
            if cap:
                row["maxnreg"] = cap[0]
            row |= {**ptxas_report(k.asm["ptx"]), "shared_bytes": int(k.metadata.shared)}
            if consts.get("PDL"):
                pointers = {n for n, t in sig.items() if t.startswith("*")}
                row["pdl"] = pdl_report(k.asm["ptx"], list(sig), pointers)
            if len(launch) > 1:  # a projection: its kind, shape and weight loop
                row |= {"projection": launch[1], "weight_loop": weight_loop(k.asm["cubin"])}
            if group == "prefill":
                row["sass"] = sass_mix(k.asm["cubin"])
            rows.append(row)
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
