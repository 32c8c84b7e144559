"""A second engine, written from docs/PROTOCOL.md, PEER.md, LAYOUT.md, generation.md and DCP.md alone.

It proves the protocol is a contract another team can implement: it imports nothing of qualify (not the
reference engine, not kernels, not qualify.protocol's models), has a model of its own dimensions and its own
KDA, attention and MLP math in torch on the CPU, and its own HTTP server on the standard library. The
harness qualifies it through `QUALIFY_ENGINE_MODULE=tests.second_engine`
(tests/harness/test_second_engine.py).

What it does not do: CUDA graphs (it reports why, and a CPU target skips capture), distributed DCP (its
manifest says `dcp_distributed: false`, so the harness refuses `--dcp N` for it before boot).
"""
