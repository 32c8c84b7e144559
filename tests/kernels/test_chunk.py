"""Chunked KDA: chunk reference vs the recurrence, chunk metadata, the Triton prefill (interpreter; the
root conftest sets TRITON_INTERPRET for a process without a GPU)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from kernels.kda import (
    bounded_gate,
    build_chunk_metadata,
    chunk_reference,
    gated_rmsnorm,
    get_backend,
    naive_recurrent,
    prefill,
)
from kernels.kda.chunk import prefill_scratch_specs

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests; the GPU path is covered by test_gpu_prefill.py",
)


def _qkvb(B: int, T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, beta, gen


@pytest.mark.parametrize("T", [1, 37, 64, 150])
def test_chunk_reference_matches_recurrence_with_random_bounded_gates(T: int) -> None:
    q, k, v, beta, gen = _qkvb(2, T, 2, 16, 32)
    g = bounded_gate(torch.randn(2, T, 2, 16, generator=gen) * 2, torch.randn(2) * 0.5, torch.randn(32))
    s0 = torch.randn(2, 2, 32, 16, generator=gen)
    o_ref, s_ref = naive_recurrent(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_reference(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_chunk_reference_stays_finite_and_exact_at_the_decay_lower_bound() -> None:
    # g = -5 on half the channels: Γ reaches -320 inside a 64-token chunk, where exp(-Γ) overflows fp32.
    q, k, v, beta, gen = _qkvb(1, 130, 2, 32, 16, seed=1)
    g = torch.full((1, 130, 2, 32), -5.0)
    g[..., 1::2] = -1e-3
    s0 = torch.randn(1, 2, 16, 32, generator=gen)
    o_ref, s_ref = naive_recurrent(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_reference(q, k, v, g, beta, initial_state=s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_chunk_reference_without_initial_state_and_with_small_chunks() -> None:
    q, k, v, beta, gen = _qkvb(1, 45, 1, 16, 16, seed=2)
    g = -5.0 * torch.rand(1, 45, 1, 16, generator=gen)
    o_ref, s_ref = naive_recurrent(q, k, v, g, beta)
    o, s = chunk_reference(q, k, v, g, beta, chunk_size=32, sub_chunk=8)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_chunk_metadata_lists_every_chunk_and_cumulative_offsets() -> None:
    idx = torch.full((10, 2), -7, dtype=torch.int32)
    offs = torch.full((6,), -7, dtype=torch.int32)
    n = build_chunk_metadata([0, 5, 5, 21, 54], 16, idx, offs)
    assert n == 5
    assert idx[:n].tolist() == [[0, 0], [2, 0], [3, 0], [3, 1], [3, 2]]
    assert offs[:5].tolist() == [0, 1, 1, 2, 5]
    assert (idx[n:] == -7).all() and offs[5] == -7  # nothing past the demand is touched


@pytest.mark.parametrize(
    ("idx_rows", "off_rows", "needle"),
    [
        (3, 6, "chunk_indices buffer holds 3 chunks, the batch needs 5"),
        (10, 4, "chunk_offsets buffer holds 4"),
    ],
)
def test_chunk_metadata_overflow_is_refused_without_writing(
    idx_rows: int, off_rows: int, needle: str
) -> None:
    idx = torch.full((idx_rows, 2), -7, dtype=torch.int32)
    offs = torch.full((off_rows,), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match=needle):
        build_chunk_metadata([0, 5, 5, 21, 54], 16, idx, offs)
    assert (idx == -7).all() and (offs == -7).all()


def _oracle(q, k, v, a, b, A_log, dt_bias, z, w, pool0, cu, slots, has_init):
    """Per sequence: bounded gate, sigmoid β, the recurrence, gated RMSNorm — all fp32."""
    outs, states = [], {}
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        g = bounded_gate(a[s:e].float(), A_log, dt_bias)
        init = pool0[slots[i]][None] if has_init[i] else None
        o, st = naive_recurrent(
            q[s:e][None].float(),
            k[s:e][None].float(),
            v[s:e][None].float(),
            g[None],
            torch.sigmoid(b[s:e].float())[None],
            initial_state=init,
        )
        outs.append(gated_rmsnorm(o[0], z[s:e].float(), w))
        states[int(slots[i])] = st[0]
    return torch.cat(outs), states


def _run_prefill(
    lens, slots, has_init, *, H=2, K=16, V=32, chunk=16, device_count=False, seed=0, backend=None,
    a_shift=0.0, nan_scratch=False,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tot, bf = cu[-1], torch.bfloat16
    q, k = torch.randn(tot, H, K, generator=gen).to(bf), torch.randn(tot, H, K, generator=gen).to(bf)
    v, z = torch.randn(tot, H, V, generator=gen).to(bf), torch.randn(tot, H, V, generator=gen).to(bf)
    a, b = (
        (torch.randn(tot, H, K, generator=gen) * 2 + a_shift).to(bf),
        torch.randn(tot, H, generator=gen).to(bf),
    )
    A_log, dt_bias, w = (
        torch.randn(H, generator=gen) * 0.5,
        torch.randn(H * K, generator=gen),
        torch.rand(V, generator=gen) + 0.5,
    )
    pool = torch.randn(6, H, V, K, generator=gen)
    pool0 = pool.clone()
    idx = torch.zeros(tot // chunk + len(lens) + 4, 2, dtype=torch.int32)
    offs = torch.zeros(len(lens) + 1, dtype=torch.int32)
    n = build_chunk_metadata(cu, chunk, idx, offs)
    num_chunks = torch.tensor([n], dtype=torch.int32) if device_count else n
    out = torch.zeros(tot, H, V, dtype=bf)
    slots_t, init_t = torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = dict(
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, z=z, norm_weight=w, state=pool,
        cu_seqlens=cu_t, slots=slots_t, has_initial_state=init_t, chunk_indices=idx, chunk_offsets=offs,
        num_chunks=num_chunks, out=out,
    )  # fmt: skip
    if nan_scratch:  # every scratch entry a pass might read without its writer having written it: NaN
        specs = prefill_scratch_specs(tot, H, K, V, chunk).items()
        args["scratch"] = {m: torch.full(s, float("nan"), dtype=d) for m, (s, d) in specs}
    if backend is None:
        prefill(**args, chunk_size=chunk)
    else:
        get_backend(backend).prefill(**args)
    o_ref, states = _oracle(q, k, v, a, b, A_log, dt_bias, z, w, pool0, cu, slots, has_init)
    return out, o_ref, pool, pool0, states


# bf16 path: inputs, W/U/Q̃/K̄/P and the state operand of each dot are bf16, accumulation fp32; the
# gated-norm output is compared in bf16 (values up to ~4, so 1-2 ulp is ~3e-2).
OUT_TOL = {"atol": 4e-2, "rtol": 3e-2}
STATE_TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("chunk", [16, 32])
def test_prefill_matches_recurrence_across_chunk_boundaries_with_mixed_initial_states(chunk: int) -> None:
    # One sub-chunk per chunk (16) and two (32); 64 is below, with four.
    lens, slots, has_init = [5, 19, 33, 1, 70], [4, 1, 3, 2, 5], [True, False, True, False, True]
    out, o_ref, pool, pool0, states = _run_prefill(lens, slots, has_init, chunk=chunk)
    torch.testing.assert_close(out.float(), o_ref.float(), **OUT_TOL)
    for slot, st in states.items():
        torch.testing.assert_close(pool[slot], st, **STATE_TOL)
    # Only the sequences' slots are written: the rest of the pool is byte-identical.
    for untouched in (0,):
        assert torch.equal(pool[untouched], pool0[untouched])


def test_prefill_with_64_token_chunks_and_a_device_chunk_count() -> None:
    # A device-scalar count launches at the chunk_indices capacity; surplus programs must do nothing.
    lens, slots, has_init = [70, 3, 129], [2, 5, 1], [True, True, False]
    out, o_ref, pool, pool0, states = _run_prefill(
        lens, slots, has_init, K=32, V=16, chunk=64, device_count=True, seed=3
    )
    torch.testing.assert_close(out.float(), o_ref.float(), **OUT_TOL)
    for slot, st in states.items():
        torch.testing.assert_close(pool[slot], st, **STATE_TOL)
    for untouched in (0, 3, 4):
        assert torch.equal(pool[untouched], pool0[untouched])


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"_INTER_BK": 16},
        {"_INTER_WARPS": 4, "_DIAG_WARPS": 4},
        {"_STATE_PREFETCH_G": False},
        {"_STATE_BV": 16},
        {"_TRIL_LOADS": False, "_STATE_BV": 16},
        {"_OFFDIAG_IN_DIAG": False},
        {"_MERGE_PRECISION": "tf32x3", "_MERGE_WARPS": 1},
        {"_OFFDIAG_NORMS_FROM_SLICES": False, "_DIAG_MAXNREG": None},
        {"_DIAG_ROWS_IN_REGS": True},
        {"_DIAG_ROWS_IN_REGS": True, "_TRIL_LOADS": False},
        {"_GCUM_LOG2": False},
        {"_GCUM_LOG2": False, "_OFFDIAG_IN_DIAG": False},
        {"_GCUM_LOG2": False, "_OFFDIAG_NORMS_FROM_SLICES": False, "_DIAG_MAXNREG": None},
    ],
    ids=[
        "default",
        "inter-k-slices-of-16",
        "four-warps",
        "state-without-prefetch-g",
        "state-v-blocks-of-16",
        "zeros-right-of-the-diagonal-v-blocks-of-16",
        "the-off-diagonal-pass",
        "merge-in-tf32x3",
        "norms-from-whole-rows",
        "substitution-rows-from-registers",
        "substitution-rows-from-registers-zeros-right",
        "gamma-in-natural-units",
        "gamma-in-natural-units-off-diagonal-pass",
        "the-defaults-before-2026-12-06",
    ],
)
def test_prefill_on_ragged_lengths_with_strong_decays_and_the_null_slot(variant, monkeypatch) -> None:
    # Lengths around the chunk size (and one past two chunks), decays near the bound e^-5 per step on
    # most channels, one sequence on the null slot; every variant of the Triton prefill, on scratch
    # filled with NaN (what a pass reads that no pass wrote would reach the output).
    import kernels.kda.chunk as chunk

    for name, value in variant.items():
        monkeypatch.setattr(chunk, name, value)
    lens, slots, has_init = [1, 63, 64, 65, 130], [1, 2, 0, 3, 4], [True, False, True, True, False]
    out, o_ref, pool, pool0, states = _run_prefill(
        lens, slots, has_init, chunk=64, device_count=True, seed=6, a_shift=6.0, nan_scratch=True
    )
    assert torch.equal(out[64:128].float(), torch.zeros(64, *out.shape[1:]))
    live = torch.cat([torch.arange(0, 64), torch.arange(128, 323)])
    torch.testing.assert_close(out[live].float(), o_ref[live].float(), **OUT_TOL)
    for slot in (1, 2, 3, 4):
        torch.testing.assert_close(pool[slot], states[slot], **STATE_TOL)
    assert torch.equal(pool[[0, 5]], pool0[[0, 5]])


MILD = {
    "lens": [1, 63, 64, 65, 130],
    "slots": [1, 2, 0, 3, 4],
    "has_init": [True, False, True, True, False],
    "seed": 6,
}
WIDE_K = dict(lens=[3, 70], slots=[1, 2], has_init=[True, False], seed=8, K=128, V=16)
CASES = {"MILD": MILD, "WIDE_K": WIDE_K}


@functools.cache
def _default_bits(case_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The default prefill's output and state pool on a named case (computed once per process; callers
    ask before setting any variant)."""
    case = dict(CASES[case_name])
    lens, slots, has_init = case.pop("lens"), case.pop("slots"), case.pop("has_init")
    out, _, pool, _, _ = _run_prefill(lens, slots, has_init, chunk=64, device_count=True, **case)
    return out, pool


@pytest.mark.parametrize(
    ("variant", "case"),
    [
        ({"_STATE_PREFETCH_G": False}, "MILD"),
        ({"_GATE_BK": 32}, "WIDE_K"),
        ({"_GATE_BK": 128}, "WIDE_K"),
        ({"_TRIL_LOADS": False}, "MILD"),
        ({"_DIAG_ROWS_IN_REGS": True}, "MILD"),
        ({"_DIAG_ROWS_IN_REGS": True, "_OFFDIAG_IN_DIAG": False}, "WIDE_K"),
        ({"_DIAG_SUB_FIRST": False}, "MILD"),
    ],
    ids=[
        "state-without-prefetch-g",
        "gate-channel-blocks-of-32",
        "gate-whole-head-rows",
        "zeros-right-of-the-diagonal",
        "substitution-rows-from-registers",
        "substitution-rows-from-registers-off-diagonal-pass",
        "diagonal-pass-chunks-first",
    ],
)
def test_variants_that_move_only_loads_give_the_defaults_bits(variant, case, monkeypatch) -> None:
    # Γ_C loaded when its chunk comes rather than a chunk early (the default), the gate's channels split
    # among programs differently (at K = 128, where the widths differ; 64 is the default), or P and X
    # written with zeros right of their diagonals and read whole (the default reads their lower triangles
    # only), or the forward substitution's rows of A_ii taken from the registers rather than loaded back
    # (against the default's own path for the off-diagonal blocks there), or the diagonal pass's programs
    # launched in another order (each sub-chunk index over every chunk, where the default launches a
    # chunk's sub-chunks side by side): the same fp32 values enter the same arithmetic, so outputs and
    # states must equal the default's bit for bit, not just be close. Mild decays keep A_ii and its
    # inverse far from I.
    import kernels.kda.chunk as chunk

    out0, pool0 = _default_bits(case)
    case = dict(CASES[case])
    lens, slots, has_init = case.pop("lens"), case.pop("slots"), case.pop("has_init")
    for name, value in variant.items():
        monkeypatch.setattr(chunk, name, value)
    out1, o_ref, pool1, _, _ = _run_prefill(lens, slots, has_init, chunk=64, device_count=True, **case)
    assert torch.equal(out1, out0)
    assert torch.equal(pool1, pool0)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    live = [t for i, t0 in enumerate(starts) if slots[i] != 0 for t in range(t0, t0 + lens[i])]  # not slot 0
    torch.testing.assert_close(out1[live].float(), o_ref[live].float(), **OUT_TOL)


@pytest.mark.parametrize(("chunk_size", "K"), [(64, 16), (32, 16), (64, 128)])
def test_off_diagonal_blocks_from_the_diagonal_pass_give_the_off_diagonal_pass_bits(
    chunk_size, K, monkeypatch
) -> None:
    # _OFFDIAG_IN_DIAG (the default) moved the blocks of A and P left of the diagonal from the per-chunk
    # off-diagonal pass into the per-sub-chunk diagonal pass and X's blocks into merge_kernel: the same
    # products over the same K slices, so on the interpreter (fp32 operands) the bits must be the
    # off-diagonal pass's, on scratch filled with NaN (the merge reading a block no program wrote would
    # show). Four and two sub-chunks a chunk; K = 128 gives two 64-wide slices; lengths end inside every
    # sub-chunk of a chunk.
    import kernels.kda.chunk as chunk

    lens, slots = [1, 17, 33, 49, 64, 70, 130], [1, 2, 3, 0, 4, 5, 0]  # two on the null slot
    has_init = [True, False, True, True, False, True, False]
    case = dict(seed=5, K=K)
    monkeypatch.setattr(chunk, "_OFFDIAG_IN_DIAG", False)
    out0, _, pool0, _, _ = _run_prefill(
        lens, slots, has_init, chunk=chunk_size, device_count=True, nan_scratch=True, **case
    )
    monkeypatch.setattr(chunk, "_OFFDIAG_IN_DIAG", True)
    out1, _, pool1, _, _ = _run_prefill(
        lens, slots, has_init, chunk=chunk_size, device_count=True, nan_scratch=True, **case
    )
    assert not torch.isnan(out1.float()).any()
    assert torch.equal(out1, out0)
    assert torch.equal(pool1, pool0)


@pytest.mark.parametrize(("K", "bk"), [(128, 64), (32, 16)])
def test_key_norms_from_the_k_slices_give_the_whole_rows_output_to_a_rounding(K, bk, monkeypatch) -> None:
    # _OFFDIAG_NORMS_FROM_SLICES (the default since 2026-12-06): the diagonal pass takes the earlier
    # sub-chunks' key norms from the squares of the K slices its loop loads (two slices here), not from their
    # whole rows loaded again: the same sums in another order, so the output is the whole rows' up to bf16
    # rounding. A norm from one slice alone (a sum not carried across the slices) would be off by about 1.4x.
    import kernels.kda.chunk as chunk

    lens, slots, has_init = [1, 17, 49, 64, 130], [1, 2, 0, 3, 4], [True, False, True, False, True]
    case = dict(seed=8, K=K, chunk=64, device_count=True, nan_scratch=True)
    monkeypatch.setattr(chunk, "_INTER_BK", bk)
    monkeypatch.setattr(chunk, "_OFFDIAG_NORMS_FROM_SLICES", False)  # whole rows
    out0, o_ref, pool0, _, _ = _run_prefill(lens, slots, has_init, **case)
    monkeypatch.setattr(chunk, "_OFFDIAG_NORMS_FROM_SLICES", True)
    out1, _, pool1, _, _ = _run_prefill(lens, slots, has_init, **case)
    assert not torch.isnan(out1.float()).any()
    torch.testing.assert_close(out1.float(), out0.float(), rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(pool1, pool0, rtol=1e-4, atol=1e-5)
    live = torch.cat([torch.arange(0, 18), torch.arange(67, 261)])  # the third sequence is on the null slot
    torch.testing.assert_close(out1[live].float(), o_ref[live].float(), **OUT_TOL)


@pytest.mark.parametrize("tril", [False, True], ids=["zeros-written", "tril-loads"])
def test_no_pass_reads_scratch_that_no_pass_wrote(tril, monkeypatch) -> None:
    # Scratch starts as NaN. The diagonal pass writes P and X only on and left of the diagonal under
    # _TRIL_LOADS (the default), so a reader whose mask reached past the diagonal would carry NaN into the
    # output or the state; the outputs must be the default's bits (on the scratch it allocates) either way.
    import kernels.kda.chunk as chunk

    out0, pool0 = _default_bits("MILD")
    case = dict(MILD)
    lens, slots, has_init = case.pop("lens"), case.pop("slots"), case.pop("has_init")
    monkeypatch.setattr(chunk, "_TRIL_LOADS", tril)
    out1, _, pool1, _, _ = _run_prefill(
        lens, slots, has_init, chunk=64, device_count=True, nan_scratch=True, **case
    )
    assert torch.equal(out1, out0)
    assert torch.equal(pool1, pool0)


def test_empty_padding_sequence_reads_and_writes_nothing() -> None:
    lens, slots, has_init = [17, 0, 9], [1, 0, 2], [False, True, True]
    out, o_ref, pool, pool0, states = _run_prefill(lens, slots, has_init, seed=4)
    torch.testing.assert_close(out.float(), o_ref.float(), **OUT_TOL)
    assert torch.equal(pool[0], pool0[0])
    assert set(states) == {1, 2}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_sequence_on_the_null_slot_outputs_zero_and_touches_no_state(backend) -> None:
    # One contract, one meaning of slot 0 (KDA.md §2) in prefill as in decode, whatever the backend.
    lens, slots, has_init = [9, 70, 7], [1, 0, 2], [True, True, False]
    out, o_ref, pool, pool0, states = _run_prefill(lens, slots, has_init, chunk=64, seed=5, backend=backend)
    assert torch.equal(out[9:79].float(), torch.zeros(70, *out.shape[1:]))
    assert torch.equal(pool[[0, 3, 4, 5]], pool0[[0, 3, 4, 5]])
    live = torch.cat([torch.arange(0, 9), torch.arange(79, 86)])
    torch.testing.assert_close(out[live].float(), o_ref[live].float(), **OUT_TOL)
    for slot in (1, 2):
        torch.testing.assert_close(pool[slot], states[slot], **STATE_TOL)


def test_prefill_scratch_specs_cover_every_intermediate() -> None:
    specs = prefill_scratch_specs(100, 2, 16, 32, 64)
    assert specs["u"] == ((100, 2, 32), torch.bfloat16)
    assert specs["gcum"] == ((100, 2, 16), torch.float32)
    assert specs["p"] == ((100, 2, 64), torch.bfloat16)
    assert specs["rn"] == ((100, 2, 2), torch.float32)


def test_prefill_refuses_a_scratch_buffer_of_the_wrong_dtype() -> None:
    H, K, V, tot = 2, 16, 16, 8
    bf = torch.bfloat16
    scratch = {n: torch.empty(s, dtype=dt) for n, (s, dt) in prefill_scratch_specs(tot, H, K, V, 16).items()}
    scratch["w"] = scratch["w"].float()
    qk = torch.zeros(tot, H, K, dtype=bf)
    vz = torch.zeros(tot, H, V, dtype=bf)
    with pytest.raises(ValueError, match=r"scratch\['w'\]"):
        prefill(
            qk,
            qk,
            vz,
            qk,
            torch.zeros(tot, H, dtype=bf),
            torch.zeros(H),
            torch.zeros(H * K),
            vz,
            torch.ones(V),
            torch.zeros(2, H, V, K),
            torch.tensor([0, tot], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([False]),
            torch.zeros(4, 2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            1,
            vz.clone(),
            chunk_size=16,
            scratch=scratch,
        )


def _intermediates_reference(q, k, v, g, beta, chunk: int):
    """W, U and P of one chunk-aligned sequence, from the reference's own formulas (fp32)."""
    from kernels.kda.chunk_ref import _decay_products
    from kernels.kda.naive import l2norm

    T, H, K = q.shape
    n = T // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [H, n, C, d]
        return x.reshape(n, chunk, H, -1).permute(2, 0, 1, 3)

    kc, vc, qc = chunks(l2norm(k.float())), chunks(v.float()), chunks(l2norm(q.float()) * K**-0.5)
    gam = chunks(g).cumsum(-2)
    bc = beta.reshape(n, chunk, H).permute(2, 0, 1)
    A = _decay_products(kc, kc, gam, 16).tril(-1) * bc.unsqueeze(-1)
    Tm = torch.linalg.solve_triangular(
        torch.eye(chunk) + A, torch.diag_embed(bc), upper=False, unitriangular=True
    )

    def back(x: torch.Tensor) -> torch.Tensor:  # [H, n, C, d] -> [T, H, d]
        return x.permute(1, 2, 0, 3).reshape(T, H, -1)

    return back(Tm @ (kc * torch.exp(gam))), back(Tm @ vc), back(_decay_products(qc, kc, gam, 16))


def test_blockwise_solve_gives_the_reference_w_u_and_p_with_near_collinear_keys() -> None:
    # Keys share a dominant direction, β is near 1 and the decay is slow, so (I + A) is far from the
    # identity in every 16x16 block, including the cross-sub-chunk ones the blockwise inverse assembles.
    T, H, K, V, C = 128, 2, 32, 16, 64
    gen = torch.Generator().manual_seed(11)
    common = torch.randn(1, H, K, generator=gen)
    k = (common + 0.3 * torch.randn(T, H, K, generator=gen)).to(torch.bfloat16)
    q = torch.randn(T, H, K, generator=gen).to(torch.bfloat16)
    v = torch.randn(T, H, V, generator=gen).to(torch.bfloat16)
    a = (torch.randn(T, H, K, generator=gen) * 0.5).to(torch.bfloat16)
    b = (torch.rand(T, H, generator=gen) * 2 + 3).to(torch.bfloat16)  # β = sigmoid(b) ∈ (0.95, 0.99)
    A_log, dt_bias = torch.zeros(H), torch.randn(H * K, generator=gen) - 7.0  # g ≈ −5·sigmoid(−7)
    idx, offs = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    n = build_chunk_metadata([0, T], C, idx, offs)
    scratch = {m: torch.zeros(s, dtype=d) for m, (s, d) in prefill_scratch_specs(T, H, K, V, C).items()}
    prefill(
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        torch.zeros(T, H, V, dtype=torch.bfloat16),
        torch.ones(V),
        torch.zeros(2, H, V, K),
        torch.tensor([0, T], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([False]),
        idx,
        offs,
        n,
        torch.zeros(T, H, V, dtype=torch.bfloat16),
        chunk_size=C,
        scratch=scratch,
    )
    g = bounded_gate(a.float(), A_log, dt_bias)
    w_ref, u_ref, p_ref = _intermediates_reference(q, k, v, g, torch.sigmoid(b.float()), C)
    # The solve is far from trivial: U differs from Diag(β)·V by as much as V itself.
    assert (u_ref - torch.sigmoid(b.float())[..., None] * v.float()).abs().max() > v.float().abs().max() / 2
    tol = {"atol": 2e-2, "rtol": 2e-2}  # W, U, P are stored in bf16
    torch.testing.assert_close(scratch["w"].float(), w_ref, **tol)
    torch.testing.assert_close(scratch["u"].float(), u_ref, **tol)
    torch.testing.assert_close(scratch["p"].float(), p_ref, **tol)
