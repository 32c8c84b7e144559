"""On CUDA the census copies parameters through pinned buffers in chunks on streams of its own: the
digests must be exactly the sha256 of each parameter's bytes, as the host path computes them (sizes across
chunk boundaries, bf16 and fp32, a zero-dim parameter), and a change to one byte changes one digest."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from qualify.engine import weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _host_sha(p: torch.Tensor) -> str:
    return hashlib.sha256(
        p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def test_the_cuda_census_is_the_sha256_of_each_parameters_bytes() -> None:
    model = nn.Module()
    chunk = weights.CHUNK_BYTES
    sizes = {"big": (chunk * 3 + 6) // 2, "exact": chunk // 2, "small": 7, "one": 1}
    for name, n in sizes.items():
        model.register_parameter(name, nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16)))
    model.register_parameter("f32", nn.Parameter(torch.randn(33, 65, device="cuda")))
    model.register_parameter("scalar", nn.Parameter(torch.tensor(3.0, device="cuda")))
    snap = weights.snapshot(model)
    params = dict(model.named_parameters())
    assert snap.checksums == {n: _host_sha(p) for n, p in params.items()}
    with torch.no_grad():
        params["big"].view(-1)[-1] += 1.0  # the last element: inside the last, partial chunk
    again = weights.snapshot(model)
    assert [n for n in params if again.checksums[n] != snap.checksums[n]] == ["big"]
