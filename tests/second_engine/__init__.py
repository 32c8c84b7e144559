"""A second engine, written from docs/PROTOCOL.md, PEER.md, LAYOUT.md, generation.md and DCP.md alone.

It proves the protocol is a contract another team can implement: it imports nothing of qualify (not the
reference engine, not kernels, not qualify.protocol's models), has a model of its own dimensions and its own
KDA, attention and MLP math in torch on the CPU, and its own HTTP server on the standard library. The
harness qualifies it through `QUALIFY_ENGINE_MODULE=tests.second_engine`
(tests/harness/test_second_engine.py).

Distributed DCP (`--dcp N`): rank 0 starts ranks 1..N-1 as its children, each stores its shard of the
attention KV in its own allocations and every rank steps the whole model in lockstep, the attention rows
gathered from the shards in position order (so the output equals its DCP 1 engine's exactly). What it does
not do: CUDA graphs (it reports why, and a CPU target skips capture), any GPU.
"""
