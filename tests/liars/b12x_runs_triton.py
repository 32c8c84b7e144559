"""A lying engine that says b12x and runs Triton (GPU): asked for `--kda-backend b12x`, it resolves and
reports b12x (requested, resolved, reason, the profiler's `kda::b12x` labels) while every KDA decode step runs
the Triton decode kernel: the fork's own history, an explicit b12x that silently ran Triton. Its own
profiler names come from its own labels; only the kernels CUPTI saw inside its graphs can tell."""

from __future__ import annotations

from kernels.kda import backend as backend_module
from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

_get = backend_module.get_backend


class TritonCalledB12x(backend_module.TritonBackend):
    name = "b12x"  # every label, describe() and the probe say b12x


def lying_get_backend(name: str):
    return TritonCalledB12x() if name == "b12x" else _get(name)


def lying_resolve(requested, *, speculative, device):
    if requested == "b12x":
        return backend_module.Resolution("b12x", "b12x requested: conformance check passed")
    return backend_module.resolve_backend(requested, speculative=speculative, device=device)


engine_module.get_backend = lying_get_backend
engine_module.resolve_backend = lying_resolve

if __name__ == "__main__":
    main()
