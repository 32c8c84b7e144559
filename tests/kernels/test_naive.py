"""The torch references: the recurrence against an independent Gated DeltaNet, the gates, the gated norm."""

from __future__ import annotations

import math

import torch

from kernels.kda.naive import bounded_gate, gated_rmsnorm, l2norm, naive_recurrent, unbounded_gate


def _inputs(B=2, T=7, H=3, K=8, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, beta, g


def _gated_deltanet(q, k, v, decay, beta, S0):
    """Scalar-decay delta rule, written independently: per (b, h), K-first state, explicit matrices."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_out = torch.zeros(B, H, V, K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].double().T.clone()  # [K, V]
            for t in range(T):
                qt = (
                    q[b, t, h].double()
                    / math.sqrt(float((q[b, t, h].double() ** 2).sum()) + 1e-6)
                    / math.sqrt(K)
                )
                kt = k[b, t, h].double() / math.sqrt(float((k[b, t, h].double() ** 2).sum()) + 1e-6)
                bt = float(beta[b, t, h])
                A = torch.eye(K, dtype=torch.float64) - bt * torch.outer(kt, kt)
                S = A @ (math.exp(float(decay[b, t, h])) * S) + bt * torch.outer(kt, v[b, t, h].double())
                o[b, t, h] = S.T @ qt
            S_out[b, h] = S.T
    return o, S_out


def test_equal_gate_channels_reduce_to_gated_deltanet():
    q, k, v, beta, g = _inputs()
    decay = -torch.rand(2, 7, 3, generator=g) * 2
    S0 = torch.randn(2, 3, 5, 8, generator=g) * 0.3
    o, S = naive_recurrent(q, k, v, decay[..., None].expand(-1, -1, -1, 8), beta, initial_state=S0)
    o_ref, S_ref = _gated_deltanet(q, k, v, decay, beta, S0)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, atol=1e-5, rtol=1e-5)


def test_per_channel_decay_differs_from_its_mean():
    # Guards against a kernel that collapses g to one rate per head.
    q, k, v, beta, g = _inputs()
    gk = -torch.rand(2, 7, 3, 8, generator=g) * 3
    o, _ = naive_recurrent(q, k, v, gk, beta)
    o_mean, _ = naive_recurrent(q, k, v, gk.mean(-1, keepdim=True).expand_as(gk), beta)
    assert (o - o_mean).abs().max() > 1e-3


def test_final_state_resumes_exactly_where_the_sequence_left_off():
    q, k, v, beta, g = _inputs(T=9)
    gk = -torch.rand(2, 9, 3, 8, generator=g)
    o, S = naive_recurrent(q, k, v, gk, beta)
    o1, S1 = naive_recurrent(q[:, :4], k[:, :4], v[:, :4], gk[:, :4], beta[:, :4])
    o2, S2 = naive_recurrent(q[:, 4:], k[:, 4:], v[:, 4:], gk[:, 4:], beta[:, 4:], initial_state=S1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(S2, S, atol=1e-6, rtol=1e-6)
    assert S.shape == (2, 3, 5, 8) and S.dtype == torch.float32  # V-first


def test_output_is_rounded_to_the_input_dtype_and_state_stays_fp32():
    q, k, v, beta, g = _inputs()
    gk = -torch.rand(2, 7, 3, 8, generator=g)
    o, S = naive_recurrent(q.bfloat16(), k.bfloat16(), v.bfloat16(), gk, beta.bfloat16())
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


def test_without_l2norm_the_raw_keys_are_used():
    q, k, v, beta, g = _inputs()
    gk = -torch.rand(2, 7, 3, 8, generator=g)
    kn, qn = l2norm(k), l2norm(q)
    o_in, _ = naive_recurrent(q, k, v, gk, beta)
    o_pre, _ = naive_recurrent(qn, kn, v, gk, beta, qk_l2norm=False)
    torch.testing.assert_close(o_in, o_pre, atol=1e-6, rtol=1e-6)


def test_l2norm_uses_eps_inside_the_sqrt():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    torch.testing.assert_close(l2norm(x)[0], torch.tensor([3.0, 4.0]) / math.sqrt(25 + 1e-6))
    assert torch.equal(l2norm(x)[1], torch.zeros(2))


def test_bounded_gate_uses_per_channel_bias_and_stays_in_bounds():
    H, K = 3, 4
    raw = torch.randn(5, H, K) * 10
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    g = bounded_gate(raw, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32 and (g <= 0).all() and (g >= -5.0).all()
    h, j = 2, 3
    want = -5.0 * torch.sigmoid(A_log[h].exp() * (raw[:, h, j] + dt_bias[h * K + j]))
    torch.testing.assert_close(g[:, h, j], want)


def test_unbounded_gate_is_flas_softplus_form():
    H, K = 2, 3
    raw, A_log, dt_bias = torch.randn(4, H, K), torch.randn(H), torch.randn(H * K)
    want = -A_log.exp()[:, None] * torch.nn.functional.softplus(raw + dt_bias.view(H, K))
    torch.testing.assert_close(unbounded_gate(raw, A_log, dt_bias), want)


def test_gated_rmsnorm_normalizes_over_v_then_gates():
    o, z, w = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.rand(8) + 0.5
    want = o / torch.sqrt((o**2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(z)
    torch.testing.assert_close(gated_rmsnorm(o, z, w), want)
    out = gated_rmsnorm(o.bfloat16(), z.bfloat16(), w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(gated_rmsnorm(torch.zeros(2, 8), z[0], w), torch.zeros(2, 8))
