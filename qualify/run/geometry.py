"""The KV geometry the harness asks an engine for, per preset: the engine flags that ask for it, and the
geometry the harness's peer reads to derive spans and byte layouts (it mirrors the reference engine's
presets; tests/engine/test_peer.py pins that it does)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from qualify.protocol import KV_ALIGNMENT, KV_PROBE_BYTES

if TYPE_CHECKING:
    from qualify.run.request import RunRequest


@dataclass(frozen=True)
class KvGeometry:
    layer_pattern: str  # K = KDA layer, A = attention layer
    group_size: int  # layers of one kind per KV group
    block_size: int
    dcp_size: int
    max_num_seqs: int
    max_model_len: int
    # per-layer cache shapes of the preset's model
    kda_heads: int
    kda_head_dim: int
    conv_width: int
    attn_kv_heads: int
    attn_head_dim: int
    # processes the DCP shards run in: 1 folded, dcp_size distributed (each rank stores one shard)
    dcp_ranks: int = 1
    # positions dealt to the DCP shards round-robin, this many at a time (where the peer's intervention
    # looks for a token's K/V)
    interleave: int = 1

    def engine_args(self) -> tuple[str, ...]:
        """The serve flags that ask for this geometry explicitly (group_size is the engine's default)."""
        return (
            "--layer-pattern", self.layer_pattern,
            "--block-size", str(self.block_size),
            "--dcp-size", str(self.dcp_size),
            "--dcp-ranks", str(self.dcp_ranks),
            "--interleave", str(self.interleave),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-model-len", str(self.max_model_len),
        )  # fmt: skip

    def for_peer(self, num_spec: int, target: str) -> dict[str, Any]:
        """What the peer reads: this geometry, the speculation depth, and the cache dtype the engine uses on
        the target (bfloat16 on a GPU, float32 on a CPU)."""
        return {
            **asdict(self),
            "num_spec": num_spec,
            "dtype": "bfloat16" if target == "gpu" else "float32",
            "alignment": KV_ALIGNMENT,
            "probe_bytes": KV_PROBE_BYTES,
        }


_COMMON = {"layer_pattern": "KKKAKKKA", "group_size": 2, "block_size": 2304, "dcp_size": 4}
_RUN = {"max_num_seqs": 8, "max_model_len": 4096, "conv_width": 4}
GEOMETRY: dict[str, KvGeometry] = {
    "tiny": KvGeometry(**_COMMON, **_RUN, kda_heads=2, kda_head_dim=16, attn_kv_heads=1, attn_head_dim=16),
    "proxy": KvGeometry(
        **_COMMON, **_RUN, kda_heads=32, kda_head_dim=128, attn_kv_heads=4, attn_head_dim=128
    ),
}


def geometry_for(req: RunRequest) -> KvGeometry:
    """The preset's geometry, with `--dcp N` distributing N shards over N ranks."""
    g = GEOMETRY[req.preset]
    return g if req.dcp is None else replace(g, dcp_size=req.dcp, dcp_ranks=req.dcp)
