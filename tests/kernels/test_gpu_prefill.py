"""Triton varlen KDA prefill on a GPU at real shapes (H=32, K=V=128, bf16) vs the fp32 chunk reference."""

from __future__ import annotations

import pytest
import torch

import kernels.kda.chunk as chunk
from bench._common import with_settings
from kernels.kda import bounded_gate, build_chunk_metadata, chunk_reference, gated_rmsnorm, prefill
from kernels.kda.chunk import prefill_scratch_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
H, K, V = 32, 128, 128


def _case(
    lens: list[int],
    has_init: list[bool],
    *,
    device_count: bool,
    seed: int,
    null: tuple[int, ...] = (),
    variant: dict[str, object] | None = None,
    a_shift: float = 0.0,
    nan_scratch: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prefill; sequences whose index is in `null` sit on slot 0 (output zero, no state touched).
    variant: kernels.kda.chunk constants to set for this run (the prefill's launch shapes); nan_scratch:
    scratch filled with NaN rather than left as allocated; check: compare with the fp32 reference.
    Returns the output and the state pool."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(seed)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tot = cu[-1]

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * s).to(bf)

    q, k, v, z = rnd(tot, H, K), rnd(tot, H, K), rnd(tot, H, V), rnd(tot, H, V)
    a, b = (rnd(tot, H, K, s=2.0).float() + a_shift).to(bf), rnd(tot, H)
    A_log = torch.randn(H, generator=gen, device=dev) * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device=dev)
    w = torch.rand(V, generator=gen, device=dev) + 0.5
    slots = [0 if i in null else i + 1 for i in range(len(lens))]
    pool = torch.randn(len(lens) + 2, H, V, K, generator=gen, device=dev) * 0.1
    pool0 = pool.clone()
    idx = torch.zeros(tot // 64 + len(lens) + 4, 2, dtype=torch.int32)
    offs = torch.zeros(len(lens) + 1, dtype=torch.int32)
    n = build_chunk_metadata(cu, 64, idx, offs)
    idx, offs = idx.to(dev), offs.to(dev)
    num_chunks = torch.tensor([n], dtype=torch.int32, device=dev) if device_count else n
    out = torch.empty(tot, H, V, dtype=bf, device=dev)
    specs = prefill_scratch_specs(tot, H, K, V)
    scratch = {m: torch.empty(s, dtype=d, device=dev) for m, (s, d) in specs.items()}
    if nan_scratch:
        for t in scratch.values():
            t.fill_(float("nan"))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    slots_t = torch.tensor(slots, dtype=torch.int32, device=dev)
    has_t = torch.tensor(has_init, device=dev)

    def run() -> None:
        prefill(q, k, v, a, b, A_log, dt_bias, z, w, pool, cu_t, slots_t, has_t, idx, offs, num_chunks, out,
                scratch=scratch)  # fmt: skip

    with_settings(chunk, variant or {}, run)()  # the variant's constants for this call, restored after
    torch.cuda.synchronize()
    if not check:
        return out, pool
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if slots[i] == 0:
            assert torch.count_nonzero(out[s:e]) == 0
            continue
        g = bounded_gate(a[s:e].float(), A_log, dt_bias)
        init = pool0[slots[i]][None] if has_init[i] else None
        o_ref, st_ref = chunk_reference(
            q[s:e][None].float(),
            k[s:e][None].float(),
            v[s:e][None].float(),
            g[None],
            torch.sigmoid(b[s:e].float())[None],
            initial_state=init,
        )
        y_ref = gated_rmsnorm(o_ref[0], z[s:e].float(), w)
        # bf16 operands with fp32 accumulation over long sequences: compare in bf16 terms.
        torch.testing.assert_close(out[s:e].float(), y_ref, atol=6e-2, rtol=5e-2)
        torch.testing.assert_close(pool[slots[i]], st_ref[0], atol=3e-2, rtol=3e-2)
    assert torch.equal(pool[0], pool0[0]) and torch.equal(pool[-1], pool0[-1])
    return out, pool


@pytest.mark.parametrize(
    ("lens", "has_init"),
    [([1000, 17, 64, 300], [True, False, True, False]), ([4096], [True]), ([1, 129, 63, 65], [False] * 4)],
)
def test_prefill_matches_chunk_reference_at_production_shapes(lens: list[int], has_init: list[bool]) -> None:
    _case(lens, has_init, device_count=True, seed=len(lens))


VARIANTS = {
    "default": {},
    "four-warps-intra": {"_DIAG_WARPS": 4, "_INTER_WARPS": 4},
    "inter-k-slices-of-64": {"_INTER_BK": 64},
    "inter-k-slices-of-128": {"_INTER_BK": 128},
    "state-v-blocks-of-64": {"_STATE_BV": 64},
    "state-v-blocks-of-32-launched-last": {"_STATE_BV": 32, "_STATE_VB_FIRST": False},
    "state-without-prefetch-g": {"_STATE_PREFETCH_G": False},
    "gate-channel-blocks-of-32": {"_GATE_BK": 32},
    "zeros-right-of-the-diagonal": {"_TRIL_LOADS": False},
    "the-off-diagonal-pass": {"_OFFDIAG_IN_DIAG": False, "_DIAG_STAGES": 3},
    "merge-in-tf32x3-at-1-warp": {"_MERGE_PRECISION": "tf32x3", "_MERGE_WARPS": 1},
    "norms-from-whole-rows": {"_OFFDIAG_NORMS_FROM_SLICES": False, "_DIAG_MAXNREG": None},
    "substitution-rows-from-registers": {"_DIAG_ROWS_IN_REGS": True},
    "diagonal-pass-chunks-first": {"_DIAG_SUB_FIRST": False},
    "gamma-in-natural-units": {"_GCUM_LOG2": False},
    "gamma-in-natural-units-keeping-denormals": {"_GCUM_LOG2": False, "_EXP_FTZ": False},
    "the-defaults-before-2026-12-06": {
        "_GCUM_LOG2": False,
        "_EXP_FTZ": False,
        "_OFFDIAG_NORMS_FROM_SLICES": False,
        "_DIAG_MAXNREG": None,
    },
    "gamma-in-natural-units-off-diagonal-pass": {
        "_GCUM_LOG2": False,
        "_OFFDIAG_IN_DIAG": False,
        "_DIAG_STAGES": 3,
    },
}
# The default (on NaN scratch, against itself on fresh scratch) and the variants that change no value any pass
# computes, only when or whether it is loaded or stored, each against the settings it differs from. (Not the
# gate's channel blocks: on the interpreter they keep the bits, but on the device a scan's order follows the
# tile's layout, which its width changes.) The substitution's rows of A_ii from the registers are a masked
# sum of one value and zeros: exact anywhere. The diagonal pass's programs in another order compute the same
# values. The exponentials that flush denormals (the default) give the same value as those that keep them
# wherever e^x is a normal number (the same multiply by log2(e), the same MUFU.EX2); where it is not (below
# 1.2e-38), every sum it enters also holds a term of order one (the row's own, at the factor e^0), far below
# whose last bit it falls. (Compared in natural units: in log2 units the gate's sigmoid is computed another
# way with ftz, by ex2 and rcp.)
SAME_BITS_AS = {
    "default": {},
    "zeros-right-of-the-diagonal": {},
    "state-without-prefetch-g": {},
    "substitution-rows-from-registers": {},
    "diagonal-pass-chunks-first": {},
    "gamma-in-natural-units-keeping-denormals": VARIANTS["gamma-in-natural-units"],
}


@pytest.mark.parametrize("variant", list(SAME_BITS_AS))
def test_variants_that_move_loads_give_the_defaults_bits_on_nan_scratch(variant: str) -> None:
    # The variant runs on scratch filled with NaN, its base on fresh scratch, so a pass reading an entry no
    # pass wrote (a mask of the default's reaching right of P's or X's diagonal) shows in the bits.
    lens, has_init = [1, 63, 64, 65, 1000, 4097], [True, False, True, True, False, True]
    kw = dict(device_count=True, seed=21, null=(2,), a_shift=3.0, check=False)
    base = _case(lens, has_init, variant=SAME_BITS_AS[variant], **kw)
    got = _case(lens, has_init, variant=VARIANTS[variant], nan_scratch=True, **kw)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_on_ragged_lengths_with_strong_decays_and_the_null_slot(variant: str) -> None:
    lens = [1, 63, 64, 65, 1000, 4097]
    has_init = [True, False, True, True, False, True]
    _case(lens, has_init, device_count=True, seed=13, null=(2,), variant=VARIANTS[variant], a_shift=6.0)


def test_prefill_sequence_on_the_null_slot_outputs_zero_and_touches_no_state() -> None:
    _case([300, 1000, 17], [True, True, False], device_count=True, seed=9, null=(1,))


def test_prefill_with_host_chunk_count() -> None:
    _case([333, 700], [True, True], device_count=False, seed=7)


def test_prefill_replays_under_cuda_graph_capture() -> None:
    dev, bf, tot = torch.device("cuda"), torch.bfloat16, 512
    x = {n: torch.randn(tot, H, K, device=dev).to(bf) for n in ("q", "k", "a")}
    v, z = torch.randn(tot, H, V, device=dev).to(bf), torch.randn(tot, H, V, device=dev).to(bf)
    b = torch.randn(tot, H, device=dev).to(bf)
    A_log, dt_bias, w = torch.zeros(H, device=dev), torch.zeros(H * K, device=dev), torch.ones(V, device=dev)
    pool = torch.randn(4, H, V, K, device=dev) * 0.1
    cu = torch.tensor([0, 200, 512], dtype=torch.int32, device=dev)
    idx, offs = torch.zeros(16, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    n = build_chunk_metadata([0, 200, 512], 64, idx, offs)
    idx, offs, nc = idx.to(dev), offs.to(dev), torch.tensor([n], dtype=torch.int32, device=dev)
    slots, has = torch.tensor([1, 2], dtype=torch.int32, device=dev), torch.tensor([True, True], device=dev)
    scratch = {
        m: torch.empty(s, dtype=d, device=dev) for m, (s, d) in prefill_scratch_specs(tot, H, K, V).items()
    }
    out = torch.empty(tot, H, V, dtype=bf, device=dev)
    args = (x["q"], x["k"], v, x["a"], b, A_log, dt_bias, z, w)

    def step(p: torch.Tensor) -> None:
        prefill(*args, p, cu, slots, has, idx, offs, nc, out, scratch=scratch)

    eager_pool = pool.clone()
    step(eager_pool)  # warm-up compiles outside the graph
    eager_out = out.clone()
    graph_pool = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_pool)
    graph_pool.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(graph_pool, eager_pool)
