"""SYNTHETIC monitor traces for the CPU tests of the monitored conditions: a whole monitor check's windows,
in the monitor's own report format (qualify/monitor/cupti_monitor.py), for an honest engine and for each lie
the conditions must catch. They are written from what the H200 probe of 2026-12-01 showed CUPTI records
(per-kernel records inside graphs carry the graph id and node id; a graph launch is a cuGraphLaunch call),
NOT recorded on a GPU: the kernel names other than the two KDA kernels (Triton's `_kda_decode_kernel`, b12x's
`_packed_sequential_kda_decode_kernel`, both as CUPTI named them on the H200) are stand-ins. The H200
recordings are replayed from tests/data/monitor/h200 (its README says how they were made)."""

from __future__ import annotations

from typing import Any

PLANS = [(8, 4), (4, 4), (2, 4), (1, 4), (8, 1), (4, 1), (2, 1), (1, 1)]
DECODE_TOKENS = 6
WEIGHTS_BYTES = 2_900_000_000
KDA = {"triton": "_kda_decode_kernel", "b12x": "_packed_sequential_kda_decode_kernel", "torch": None}
STEP = ["_rmsnorm_residual_kernel", "linear_small_kernel", "_conv_state_kernel", "_select_attn_kernel"]
PREFILL = ["inter_solve_kernel", "_rmsnorm_residual_kernel", "linear_small_kernel", "gemm_sm90"]
HELLO = {
    "t": "hello",
    "v": 1,
    "pid": 4242,
    "cupti": "13.0.1",
    "error": None,
    "kinds": ["CONCURRENT_KERNEL", "MEMORY2", "API:selected"],
    "torch_imported_before": False,
}


def _k(name: str, graph: int, count: int, nodes: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "grid": [1, 1, 1],
        "block": [128, 1, 1],
        "stream": 7,
        "graph": graph,
        "count": count,
        "nodes": list(range(1, nodes + 1)),
    }


def _window(label: str, kernels: list[dict], api: list[list] | None = None, memory: list[list] | None = None):
    return {
        "t": "window",
        "w": 0,
        "label": label,
        "kernels": kernels,
        "api": api or [],
        "memory": memory or [],
        "truncated": False,
        "enabled": HELLO["kinds"],
        "error": None,
    }


def _prefill() -> list[dict]:
    return [_k(n, 0, 4) for n in PREFILL]


def _steps(plan: tuple[int, int], graph: int, kda: str | None, *, eager: bool = False) -> tuple[list, list]:
    """Kernels and API calls of the decode steps after the prefill: replays of `graph`, or eager steps."""
    steps = 1 if plan[1] > 1 else DECODE_TOKENS - 1
    names = [*STEP, *([kda] if kda else [])]
    g = 0 if eager else graph
    kernels = [_k(n, g, steps * 6, 6 if g else 0) for n in names] + [_k("argmax_kernel", 0, steps)]
    api = [] if eager else [["cuGraphLaunch", 0, i, 0] for i in range(steps)]
    return kernels, api


def run(
    backend: str = "triton",
    *,
    kda: str | None = "",
    eager_requests: int | None = None,
    recapture: bool = False,
    reload_alloc: int = 0,
    silent: bool = False,
) -> list[dict[str, Any]]:
    """Every window of one monitor check. kda: the KDA kernel the engine really runs ("" = the backend's own);
    eager_requests: plans of that many requests step eagerly; recapture: every reload instantiates new graphs;
    reload_alloc: bytes a same-weights reload allocates; silent: the monitor reports nothing."""
    kda = KDA[backend] if kda == "" else kda
    graph_of = {p: i + 1 for i, p in enumerate(PLANS)}
    out = []
    for p in sorted(PLANS, key=lambda p: (p[1], p[0])):  # the check's order: fewest requests first
        eager = p[0] == eager_requests
        out.append(_window(f"before baseline {p[0]}x{p[1]}", _prefill()))
        ks, api = _steps(p, graph_of[p], kda, eager=eager)
        out.append(_window(f"before decode {p[0]}x{p[1]}", _prefill() + ks, api))
    for i, name in enumerate(("same", "other", "back")):
        api = [["cuGraphInstantiateWithFlags", 0, j, 0] for j in range(len(PLANS))] if recapture else []
        mem = [["alloc", reload_alloc, 1 << 40, 2, 0]] if reload_alloc and name != "other" else []
        out.append(_window(f"reload {name}", [_k("copy_kernel", 0, 300)], api, mem))
        for p in PLANS:
            gid = graph_of[p] + (100 * (i + 1) if recapture else 0)
            ks, api = _steps(p, gid, kda, eager=p[0] == eager_requests)
            out.append(_window(f"after {name} decode {p[0]}x{p[1]}", _prefill() + ks, api))
    if silent:
        out = [{**w, "kernels": [], "api": [], "memory": []} for w in out]
    return out
