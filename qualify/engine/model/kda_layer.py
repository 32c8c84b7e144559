"""A KDA layer around the kernel core (KDA.md §1): in-projection to q, k, v, b, f_a, g_a; depthwise causal
conv (width 4) + SiLU on q, k, v with its state cached per slot; the core, bounded gate, β and gated RMSNorm
through the resolved backend (kernels.kda); out-projection. No KDA math here beyond the short conv.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from kernels.fused import conv_gates_decode, conv_gates_decode_reference, conv_prefill
from kernels.kda import Caps, build_chunk_metadata  # noqa: F401  (metadata builder re-exported for runner)
from kernels.kda.chunk import FIXED_STATE_BV

from .norm import ROWS, Linear, Prenormed, param


@dataclass
class KdaWorkspace:
    """Fixed-address decode inputs/outputs of the backend, shared by every KDA layer (layers run in turn).

    Binding the backend to these once per (layer, batch rows, tokens per request) keeps every pointer a
    captured graph sees stable."""

    mixed_qkv: Tensor  # [rows, 3*H*K]: q, k, v side by side (the conv output)
    a: Tensor  # [rows, H, K]
    b: Tensor  # [rows, H]
    z: Tensor  # [rows, H, V]
    out: Tensor  # [rows, H, V]


@dataclass
class KdaRuntime:
    """The engine's one KDA backend (resolved once), its workspace, plans, scratch and bindings."""

    backend: object
    num_slots: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    ws: KdaWorkspace
    arena: object
    prefill_scratch: dict | None = None
    _scratch: dict = field(default_factory=dict)
    _bindings: dict = field(default_factory=dict)

    @classmethod
    def build(cls, backend, cfg, arena, device: torch.device) -> KdaRuntime:
        s = cfg.shape
        H, K = s.kda_heads, s.kda_head_dim
        rows = cfg.plan_rows * cfg.tokens_per_request
        dtype = getattr(torch, cfg.dtype)

        def e(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        ws = KdaWorkspace(e(rows, 3 * H * K), e(rows, H, K), e(rows, H), e(rows, H, K), e(rows, H, K))
        rt = cls(backend, cfg.num_state_slots, H, K, dtype, device, ws, arena)
        if backend.name != "torch":
            from kernels.kda.chunk import prefill_scratch_specs

            specs = prefill_scratch_specs(cfg.max_num_batched_tokens, H, K, K)
            rt.prefill_scratch = {
                n: torch.empty(sh, dtype=dt, device=device) for n, (sh, dt) in specs.items()
            }
        return rt

    def binding(self, layer: KdaLayer, n: int, T: int):
        key = (id(layer), n, T)
        b = self._bindings.get(key)
        if b is None:
            caps = Caps(
                self.heads, self.head_dim, self.head_dim, n, T, self.num_slots, self.dtype, self.device
            )
            plan = self.backend.plan(caps)
            if (n, T) not in self._scratch:  # allocated once per shape, reused by every layer
                self._scratch[(n, T)] = {
                    name: torch.empty(sp.shape, dtype=sp.dtype, device=self.device)
                    for name, sp in self.backend.scratch_specs(plan).items()
                }
            rows, H, K = n * T, self.heads, self.head_dim
            ws = self.ws
            b = self.backend.bind(
                plan,
                scratch=self._scratch[(n, T)],
                q=ws.mixed_qkv[:rows, : H * K].view(rows, H, K),
                k=ws.mixed_qkv[:rows, H * K : 2 * H * K].view(rows, H, K),
                v=ws.mixed_qkv[:rows, 2 * H * K :].view(rows, H, K),
                a=ws.a[:rows],
                b=ws.b[:rows],
                A_log=layer.A_log,
                dt_bias=layer.dt_bias,
                z=ws.z[:rows],
                norm_weight=layer.o_norm_weight,
                state=layer.state,
                state_indices=self.arena.view("state_slots", n, T),
                num_accepted=self.arena.view("num_accepted", n),
                num_live=self.arena.view("num_live", 1),
                out=ws.out[:rows],
            )
            self._bindings[key] = b
        return b


class KdaLayer(nn.Module):
    def __init__(self, shape, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        H, K, W = shape.kda_heads, shape.kda_head_dim, shape.conv_width
        self.H, self.K, self.W = H, K, W
        self.conv_dim = 3 * H * K
        # One in-projection: q, k, v (H*K each), b (H), f_a (K), g_a (K); f and g have inner rank = head dim.
        self.in_proj = Linear(shape.hidden, self.conv_dim + H + 2 * K, dtype=dtype, device=device)
        self.conv_weight = param(self.conv_dim, W, dtype=dtype, device=device)
        self.f_b = Linear(K, H * K, dtype=dtype, device=device)
        self.g_b = Linear(K, H * K, dtype=dtype, device=device)
        self.A_log = param(H, dtype=torch.float32, device=device)
        self.dt_bias = param(H * K, dtype=torch.float32, device=device)
        self.o_norm_weight = param(K, dtype=torch.float32, device=device)
        self.out_proj = Linear(H * K, shape.hidden, dtype=dtype, device=device)
        self.rt: KdaRuntime | None = None
        # decode conv: kernels.fused.conv_decode, or its torch reference (set by HybridModel.set_fused)
        self.fused = False
        self.state: Tensor | None = None  # fp32 [slots, H, V, K], a view of the group allocation
        self.conv_state: Tensor | None = None  # [slots, conv_dim, W-1]

    def attach(self, rt: KdaRuntime, state: Tensor, conv_state: Tensor) -> None:
        self.rt, self.state, self.conv_state = rt, state, conv_state

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        H, K = self.H, self.K
        qkv, b, f_a, g_a = self.in_proj(x).split([self.conv_dim, H, K, K], dim=-1)
        return qkv, b, f_a, g_a

    def _conv_prefill(self, x: Tensor, bounds: list[tuple[int, int]], slots: list[int]) -> Tensor:
        W, C = self.W, self.conv_dim
        out = torch.empty(x.shape[0], C, dtype=torch.float32, device=x.device)
        for (lo, hi), slot in zip(bounds, slots, strict=True):
            seq = torch.cat([x.new_zeros(W - 1, C), x[lo:hi]], dim=0).float().t()  # [C, W-1+L]
            out[lo:hi] = (seq.unfold(1, W, 1) * self.conv_weight.float()[:, None, :]).sum(-1).t()
            self.conv_state[slot] = seq[:, -(W - 1) :].to(self.conv_state.dtype)
        return F.silu(out)

    def forward_decode(self, x: Tensor | Prenormed, ctx, then: Callable | None = None):
        """One decode step of the block's KDA mixer; `then(out_proj, o)`, where given, runs the output
        projection instead of out_proj(o) (Linear.add_norm: the residual add and the next norm in its
        launch)."""
        rt, H, K = self.rt, self.H, self.K
        rows = ctx.n * ctx.T
        ws = rt.ws
        # [rows, C + H + 2K]: conv channels, b, f_a, g_a (x may be a Prenormed input: the block's norm is
        # then computed in the projection's launch)
        proj = self.in_proj(x)
        # conv + SiLU into the workspace, per-position conv states, the β logits copied beside, and the
        # two gate projections (f_a @ f_b.T into a, g_a @ g_b.T into z): one launch with the fused glue
        (conv_gates_decode if self.fused else conv_gates_decode_reference)(
            proj,
            self.conv_state,
            self.conv_weight,
            ctx.state_slots,
            ctx.num_accepted,
            ws.mixed_qkv[:rows],
            ws.b[:rows],
            ctx.T,
            self.f_b.weight,
            self.g_b.weight,
            ws.a[:rows].view(rows, H * K),
            ws.z[:rows].view(rows, H * K),
        )
        binding = rt.binding(self, ctx.n, ctx.T)
        with record_function(f"kda::{rt.backend.name}"):
            rt.backend.run(binding)
        o = ws.out[:rows].reshape(rows, H * K)
        return self.out_proj(o) if then is None else then(self.out_proj, o)

    def forward_prefill(self, x: Tensor, ctx) -> Tensor:
        rt, H, K = self.rt, self.H, self.K
        total = x.shape[0]
        qkv, b, f_a, g_a = self._split(x)
        if self.fused:  # one launch for the batch (the torch loop is about 14 launches per prompt)
            conv = conv_prefill(
                qkv, ctx.positions, ctx.cu_seqlens, ctx.slots, self.conv_weight, self.conv_state, x.dtype
            )
        else:
            conv = self._conv_prefill(qkv, ctx.bounds, ctx.slots_host).to(x.dtype)
        q, k, v = (t.reshape(total, H, K).contiguous() for t in conv.split(H * K, dim=-1))
        out = torch.empty(total, H, K, dtype=x.dtype, device=x.device)
        kwargs = dict(
            q=q,
            k=k,
            v=v,
            a=self.f_b(f_a).view(total, H, K).contiguous(),
            b=b.contiguous(),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            z=self.g_b(g_a).view(total, H, K).contiguous(),
            norm_weight=self.o_norm_weight,
            state=self.state,
            cu_seqlens=ctx.cu_seqlens,
            slots=ctx.slots,
            has_initial_state=ctx.has_initial_state,
            chunk_indices=ctx.chunk_indices,
            chunk_offsets=ctx.chunk_offsets,
            num_chunks=ctx.num_chunks,
            out=out,
        )
        if rt.prefill_scratch is not None:
            kwargs["scratch"] = rt.prefill_scratch
        if ROWS.on:  # a batched prefill: no tile chosen by how many prompts share it
            kwargs["state_bv"] = FIXED_STATE_BV
        with record_function(f"kda::{rt.backend.name}::prefill"):
            rt.backend.prefill(**kwargs)
        return self.out_proj(out.reshape(total, H * K))
