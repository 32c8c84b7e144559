"""On CUDA the census hashes on the device (kernels/census.py): each parameter's digest must be the one the
numpy reference gives for its bytes (sizes across the kernel's blocks, bf16 and fp32, a zero-dim parameter),
a change to one element changes one digest, and a second census allocates no device memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import census
from qualify.engine import weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _reference(p: torch.Tensor) -> str:
    data = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return census.digest(len(data), census.block_words_reference(data))


def test_the_cuda_census_is_the_reference_digest_of_each_parameters_bytes() -> None:
    model = nn.Module()
    block = census.BLOCK
    sizes = {"big": (block * 300 + 6) // 2, "exact": block // 2, "small": 7, "one": 1}
    for name, n in sizes.items():
        model.register_parameter(name, nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16)))
    model.register_parameter("f32", nn.Parameter(torch.randn(33, 65, device="cuda")))
    model.register_parameter("scalar", nn.Parameter(torch.tensor(3.0, device="cuda")))
    snap = weights.snapshot(model)
    params = dict(model.named_parameters())
    assert snap.checksums == {n: _reference(p) for n, p in params.items()}
    with torch.no_grad():
        params["big"].view(-1)[-1] += 1.0  # the last element: inside the last, partial block
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    again = weights.snapshot(model)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated  # the words' buffer is kept
    assert [n for n in params if again.checksums[n] != snap.checksums[n]] == ["big"]


def test_the_background_save_of_device_tensors_writes_the_bytes_save_writes(tmp_path) -> None:
    """Engine.reload's background save: CUDA tensors through pinned buffers on a stream of its own (chunks
    of CHUNK_BYTES: one tensor spans several), the same file `save` writes."""
    state = {
        "big": torch.randn(weights.CHUNK_BYTES // 2 + 1000, device="cuda", dtype=torch.bfloat16),
        "f32": torch.randn(33, 65, device="cuda"),
        "small.norm_weight": torch.ones(7, device="cuda", dtype=torch.bfloat16),
    }
    state["big"].mul_(3.0)  # queued on the current stream: the save must see it
    meta = {"seed": "1", "preset": "proxy"}
    weights.save(state, tmp_path / "a.safetensors", meta)
    weights.save_streamed(state, tmp_path / "b.safetensors", meta)
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
