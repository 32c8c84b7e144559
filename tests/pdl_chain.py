"""One check for chains of kernels launched with programmatic dependent launch (kernels.fused.PDL), shared
by the GPU tests of the fused glue and of the KDA decode."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_replay_with_pdl_equals_serial(
    chain: Callable[[], tuple[torch.Tensor, ...]],
    new_inputs: Callable[[], None],
    before_serial: Callable[[], None] = lambda: None,
    rounds: int = 3,
) -> None:
    """chain() launches kernels each reading what the one before it wrote and returns the tensors to
    compare. Captured in a CUDA graph with PDL and replayed on new inputs every round (`new_inputs`), it
    must give the bytes the same kernels give launched without PDL (`before_serial` resets what the replay
    changed). A kernel that read its input before its wait would read the previous replay's."""
    from kernels import fused

    pdl = fused.PDL
    try:
        fused.PDL = True
        chain()  # compiles, and allocates what a first call allocates, before the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for i in range(rounds):
            new_inputs()
            graph.replay()
            replayed = [t.clone() for t in out]
            before_serial()
            fused.PDL = False
            serial = chain()
            fused.PDL = True
            for a, b in zip(replayed, serial, strict=True):
                assert torch.equal(a, b), i
    finally:
        fused.PDL = pdl
