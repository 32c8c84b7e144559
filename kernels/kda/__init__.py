"""KDA (Kimi Delta Attention): torch references, Triton decode/verify and prefill, one backend contract."""

from .backend import (
    BACKENDS,
    BackendUnavailable,
    Binding,
    Caps,
    DecodePlan,
    KdaBackend,
    Resolution,
    TensorSpec,
    decode_reference,
    get_backend,
    resolve_backend,
)
from .chunk import build_chunk_metadata, chunk_reference, prefill
from .decode import decode
from .naive import bounded_gate, gated_rmsnorm, l2norm, naive_recurrent, unbounded_gate

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "Binding",
    "Caps",
    "DecodePlan",
    "KdaBackend",
    "Resolution",
    "TensorSpec",
    "bounded_gate",
    "build_chunk_metadata",
    "chunk_reference",
    "decode",
    "decode_reference",
    "gated_rmsnorm",
    "get_backend",
    "l2norm",
    "naive_recurrent",
    "prefill",
    "resolve_backend",
    "unbounded_gate",
]
