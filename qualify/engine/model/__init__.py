"""The hybrid decoder: embedding -> KDA / attention decoder layers with SwiGLU MLPs -> norm -> LM head,
plus one MTP draft layer (next-token embedding + hidden -> one block -> the shared head)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.fused import norm_head, serves_head

from .attention import AttentionLayer
from .context import DecodeContext, PrefillContext
from .kda_layer import KdaLayer
from .mlp import SwiGLU
from .norm import Embedding, Linear, Prenormed, RMSNorm

__all__ = ["DecodeContext", "DecoderLayer", "HybridModel", "MtpHead", "PrefillContext"]


class DecoderLayer(nn.Module):
    def __init__(self, kind: str, shape, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kind = kind
        self.input_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.mixer = (KdaLayer if kind == "K" else AttentionLayer)(shape, dtype=dtype, device=device)
        self.post_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.mlp = SwiGLU(shape.hidden, shape.mlp_dim, dtype=dtype, device=device)

    def forward(self, x: Tensor, ctx, decode: bool) -> Tensor:
        h = self.input_norm(x)
        h = self.mixer.forward_decode(h, ctx) if decode else self.mixer.forward_prefill(h, ctx)
        x = x + h
        return x + self.mlp(self.post_norm(x))

    def forward_fused(self, inp: Prenormed, ctx, decode: bool, next_norm: RMSNorm | None):
        """The same block with each residual add and norm handed on unevaluated (Prenormed): takes this
        block's input norm, returns the next block's (`next_norm`'s), or with next_norm None the pair
        (residual stream, MLP output still to be added) for the caller. In a decode step the projection that
        produces a residual branch (the mixer's output projection, MLP down) computes the add and the next
        norm but its 1/rms in its own launch where kernels.fused.linear_small serves it, and the projection
        that reads the norm (the mixer's first one, MLP gate_up) applies the 1/rms to its accumulator."""

        def post_of(proj: Linear, h: Tensor) -> Prenormed:
            return proj.add_norm(h, inp.total, self.post_norm)  # inp.total: set once the mixer read inp

        if decode:
            post = self.mixer.forward_decode(inp, ctx, post_of)
        else:
            h = self.mixer.forward_prefill(inp.materialize(), ctx)
            post = Prenormed(inp.total, h, self.post_norm)
        if next_norm is None:
            out = self.mlp(post)
            return post.total, out
        return self.mlp(post, lambda proj, act: proj.add_norm(act, post.total, next_norm))


class MtpHead(nn.Module):
    """DeepSeek-style MTP draft: norm(embed(next token)) ++ norm(hidden) -> proj -> one MLP block -> norm.

    Its block has no sequence mixer (the target's hidden state already carries the context), so drafting
    needs no cache of its own and the registered KV layout is the target's alone."""

    def __init__(self, shape, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embed_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.proj = Linear(2 * shape.hidden, shape.hidden, dtype=dtype, device=device)
        self.mlp_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.mlp = SwiGLU(shape.hidden, shape.mlp_dim, dtype=dtype, device=device)
        self.final_norm = RMSNorm(shape.hidden, dtype=dtype, device=device)

    def forward(self, hidden: Tensor, next_embed: Tensor) -> Tensor:
        x = self.proj(torch.cat([self.embed_norm(next_embed), self.hidden_norm(hidden)], dim=-1))
        x = x + self.mlp(self.mlp_norm(x))
        return self.final_norm(x)


class HybridModel(nn.Module):
    def __init__(self, cfg, device: torch.device):
        super().__init__()
        shape, dtype = cfg.shape, getattr(torch, cfg.dtype)
        self.shape = shape
        self.embed = Embedding(shape.vocab, shape.hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(kind, shape, dtype=dtype, device=device) for kind in cfg.layer_pattern
        )
        self.norm = RMSNorm(shape.hidden, dtype=dtype, device=device)
        self.lm_head = Linear(shape.hidden, shape.vocab, dtype=dtype, device=device)
        self.mtp = MtpHead(shape, dtype=dtype, device=device)

    def forward_hidden(self, input_ids: Tensor, ctx, decode: bool) -> Tensor:
        """Last hidden state (before the final norm) of every token."""
        x = self.embed(input_ids)
        if self.norm.fused and self.layers:
            x, pending = self._fused_layers(x, ctx, decode)
            return x + pending
        for layer in self.layers:
            x = layer(x, ctx, decode)
        return x

    def _fused_layers(self, x: Tensor, ctx, decode: bool) -> tuple[Tensor, Tensor]:
        """The blocks with the fused glue: (residual stream, last MLP output still to be added)."""
        layers = list(self.layers)
        inp = Prenormed(x, None, layers[0].input_norm)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            out = layer.forward_fused(inp, ctx, decode, nxt)
            if nxt is not None:
                inp = out
        return out

    def decode_into(self, input_ids: Tensor, ctx, hidden_out: Tensor, logits_out: Tensor) -> None:
        """A decode or verify step: every token's last hidden state and its logits, written into the
        caller's (static) buffers. With the fused glue the last residual add, the final norm and the fp32
        head are one launch (kernels.fused.norm_head) where the rows are decode-sized."""
        rows = input_ids.numel()
        if self.norm.fused and self.layers and serves_head(self.lm_head.weight, rows):
            x, pending = self._fused_layers(self.embed(input_ids), ctx, True)
            n = self.norm
            norm_head(x, pending, n.weight, n.eps, self.lm_head.weight, hidden_out, logits_out)
            return
        hidden = self.forward_hidden(input_ids, ctx, decode=True)
        hidden_out.copy_(hidden)
        logits_out.copy_(self.logits(hidden))

    def logits(self, hidden: Tensor, head: Tensor | None = None) -> Tensor:
        # fp32 head: bf16 logits are quantized to 1/16-1/8 at their magnitude, coarser than the coherence
        # rule's epsilon, so the top-2 gap of a near tie would read as a real disagreement. `head`: the
        # lm_head weight already in fp32 (logits_apart converts it once for all its rows).
        w = self.lm_head.weight.float() if head is None else head
        return torch.nn.functional.linear(self.norm(hidden).float(), w)

    def logits_apart(self, hidden: Tensor) -> Tensor:
        """`logits` of each row on its own (a one-row product each, the fp32 head converted once): the rows'
        logits as each alone would get them, whatever the other rows."""
        head = self.lm_head.weight.float()
        return torch.cat([self.logits(h[None], head) for h in hidden])

    def draft_logits(self, hidden: Tensor, next_ids: Tensor) -> Tensor:
        """MTP: logits for the token after `next_ids`, from the target's hidden state at that position."""
        return self.lm_head(self.mtp(hidden, self.embed(next_ids))).float()

    def set_fused(self, fused: bool) -> None:
        """Decode-step glue through kernels.fused (CUDA engines) or eager torch ops (the reference)."""
        for m in self.modules():
            if hasattr(m, "fused"):
                m.fused = fused

    @property
    def glue(self) -> str:
        """What runs the decode step's glue, as describe() reports it."""
        if not self.norm.fused:
            return "torch"
        distributed = any(
            layer.kind == "A" and layer.mixer.rt is not None and layer.mixer.rt.geometry.rank is not None
            for layer in self.layers
        )
        # kernels.fused's attention path serves the folded DCP geometry; one rank per shard stays in torch
        return "triton fused (attention decode in torch: distributed DCP)" if distributed else "triton fused"

    def refresh_derived(self) -> None:
        """Hook for tensors derived from weights after an in-place reload. This model keeps none: RoPE
        tables come from the config, and the backend reads A_log, dt_bias and norm weights in place."""
