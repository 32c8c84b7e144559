"""`EngineConfig`: what an engine is asked to be, validated at construction and failing closed.

Model shapes come from a preset (`tiny` for CPU, `proxy` for GPU); everything else is a field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qualify.protocol import WEIGHTS_WAIT_MAX_S

KDA_BACKENDS = ("auto", "b12x", "triton", "torch")
NUM_SPECIALS = 4  # BOS, EOS, PAD, one reserved: see tokenizer.py


@dataclass(frozen=True)
class ModelShape:
    """Per-layer shapes of the hybrid decoder (the preset fixes them)."""

    hidden: int
    kda_heads: int
    kda_head_dim: int  # K = V
    attn_q_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    mlp_dim: int
    vocab: int
    conv_width: int = 4


PRESETS: dict[str, ModelShape] = {
    # CPU demo: boots in well under a second, byte-level vocab.
    "tiny": ModelShape(
        hidden=64,
        kda_heads=2,
        kda_head_dim=16,
        attn_q_heads=2,
        attn_kv_heads=1,
        attn_head_dim=16,
        mlp_dim=128,
        vocab=256 + NUM_SPECIALS,
    ),
    # GPU: production-like per-layer shapes (KDA 32 heads x 128, GQA 32/4 x 128), few layers.
    "proxy": ModelShape(
        hidden=4096,
        kda_heads=32,
        kda_head_dim=128,
        attn_q_heads=32,
        attn_kv_heads=4,
        attn_head_dim=128,
        mlp_dim=8192,
        vocab=256 + NUM_SPECIALS,
    ),
}


class EngineConfig(BaseModel):
    """The engine's configuration. `None` fields are resolved at construction (device, dtype, graphs)."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["tiny", "proxy"] = "tiny"
    layer_pattern: str = "KKKAKKKA"  # K = KDA layer, A = attention layer
    group_size: int = Field(2, ge=1)  # layers of one kind per KV group
    block_size: int = Field(2304, ge=1)
    dcp_size: int = Field(4, ge=1)
    # Processes the DCP shards run in: 1 folds every shard into this process; dcp_size runs one rank per
    # shard over torch.distributed (NCCL on GPUs, gloo on CPU), see qualify/engine/dcp.py.
    dcp_ranks: int = Field(1, ge=1)
    interleave: int = Field(1, ge=1)  # tokens dealt to DCP shards round-robin, `interleave` at a time
    max_model_len: int = Field(4096, ge=2)
    max_num_seqs: int = Field(8, ge=1)  # live-request capacity
    max_num_batched_tokens: int = Field(4096, ge=1)
    num_spec: int = Field(0, ge=0, le=8)
    capture_sizes: list[int] | None = None  # in tokens, multiples of 1 + num_spec
    cudagraph_mode: Literal["full", "none"] | None = None
    kda_decode_backend: str = "auto"
    device: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    seed: int = Field(0, ge=0)
    weights: str | None = None  # safetensors path; default under the data dir
    weights_create: bool = False  # a named weights file that does not exist yet: write seeded weights there
    # a named weights file the harness puts in place after the engine starts: wait up to this long for it
    weights_wait_s: float = Field(0.0, ge=0.0, le=WEIGHTS_WAIT_MAX_S)
    scratch_dir: str | None = None  # where seeded reloads write their weights (the launch document's)
    selector_pool: int = Field(64, ge=1)  # tokens pooled into one selector row
    selector_topk: int = Field(16, ge=1)  # pooled rows a query attends to (own row included)

    @field_validator("kda_decode_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v not in KDA_BACKENDS:
            raise ValueError(f"unknown kda_decode_backend {v!r}; choose one of {', '.join(KDA_BACKENDS)}")
        return v

    @field_validator("layer_pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        v = v.strip().upper()
        if not v or set(v) - {"K", "A"}:
            raise ValueError(f"layer_pattern {v!r} must be a non-empty string of K (KDA) and A (attention)")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "auto" and v != "cpu" and not (v == "cuda" or v.startswith("cuda:")):
            raise ValueError(f"device {v!r} must be auto, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> EngineConfig:
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"device {self.device!r} requested but no CUDA device is visible; use --device cpu"
            )
        on_cuda = self.device.startswith("cuda")
        if self.dtype is None:
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.cudagraph_mode is None:
            self.cudagraph_mode = "full" if on_cuda else "none"
        elif self.cudagraph_mode == "full" and not on_cuda:
            raise ValueError("cudagraph_mode 'full' needs a CUDA device; use cudagraph_mode 'none' on CPU")
        for kind in ("K", "A"):
            n = self.layer_pattern.count(kind)
            if n % self.group_size:
                raise ValueError(
                    f"{n} {'KDA' if kind == 'K' else 'attention'} layers do not split into groups of "
                    f"{self.group_size}; choose a group_size that divides every kind's layer count"
                )
        if self.dcp_ranks not in (1, self.dcp_size):
            raise ValueError(
                f"dcp_ranks {self.dcp_ranks} must be 1 (folded) or dcp_size {self.dcp_size} "
                "(one rank per shard)"
            )
        if self.block_size % self.interleave:
            raise ValueError(
                f"block_size {self.block_size} must be a multiple of interleave {self.interleave}"
            )
        tpr = 1 + self.num_spec
        if self.capture_sizes is None:
            sizes, b = [], 1
            while b < self.max_num_seqs:
                sizes.append(b * tpr)
                b *= 2
            sizes.append(self.max_num_seqs * tpr)
            self.capture_sizes = sizes
        if not self.capture_sizes or any(s < 1 or s % tpr for s in self.capture_sizes):
            raise ValueError(
                f"capture_sizes {self.capture_sizes} must be positive multiples of 1 + num_spec = {tpr}"
            )
        self.capture_sizes = sorted(set(self.capture_sizes))
        if self.max_num_batched_tokens < max(self.capture_sizes):
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is below the largest capture size "
                f"{max(self.capture_sizes)}; raise it or shrink capture_sizes"
            )
        return self

    # ---------------------------------------------------------------- derived numbers

    @property
    def shape(self) -> ModelShape:
        return PRESETS[self.preset]

    @property
    def tokens_per_request(self) -> int:
        return 1 + self.num_spec

    @property
    def graph_max_batch(self) -> int:
        """Largest captured batch, in requests (graph-plan capacity; may exceed max_num_seqs)."""
        return max(self.capture_sizes or [1]) // self.tokens_per_request

    @property
    def plan_rows(self) -> int:
        """Rows of every per-request static buffer: live capacity and graph-plan capacity together."""
        return max(self.max_num_seqs, self.graph_max_batch)

    @property
    def num_state_slots(self) -> int:
        """Slot 0 is the null slot; each live request owns 1 + num_spec slots (per-position states)."""
        return 1 + self.max_num_seqs * self.tokens_per_request

    @property
    def attention_span(self) -> int:
        from .layout import group_span  # the one place spans are computed

        return group_span("attention", self.block_size, self.dcp_size)

    @property
    def dcp_local_shards(self) -> int:
        """DCP shards one process stores: every shard folded, one per rank distributed."""
        return self.dcp_size if self.dcp_ranks == 1 else 1

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.attention_span)

    @property
    def num_kv_blocks(self) -> int:
        """Block 0 is the null block that padding rows read and write."""
        return 1 + self.max_num_seqs * self.max_blocks_per_seq

    def public_dict(self) -> dict:
        d = self.model_dump()
        d["model_shape"] = asdict(self.shape)
        return d

    def digest(self) -> str:
        blob = json.dumps(self.public_dict(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()
