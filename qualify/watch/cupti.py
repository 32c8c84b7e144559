"""CUDA activity the harness's monitor recorded inside the engine process (qualify/monitor/cupti_monitor.py):
window reports parsed into plain values, and the `monitored` conditions computed from them. No I/O here:
the monitor check (qualify/checks/monitor.py) opens the windows, tests replay recorded ones
(tests/data/monitor/).

What a window holds (docs/MONITOR.md): kernels aggregated by (name, grid, block, stream, graph id) with a
launch count and the graph node ids seen (graph id 0: launched outside any CUDA graph), the graph API calls
(instantiate, launch, stream capture) and the device allocations and frees, all between the window's open
and close. A window that never came back carries `missing` (why).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MONITORED = "monitored"

# KDA decode kernels by backend, as CUPTI names them. Triton: the decode/verify kernel of
# kernels/kda/decode.py (its function name is the kernel name; the gated norm kernel is shared with
# prefill, so it is no signature).
# torch launches ATen kernels only: no signature of its own, proven by the absence of the others'.
KDA_SIGNATURES: dict[str, tuple[re.Pattern[str], ...]] = {
    "triton": (re.compile(r"^_kda_decode_kernel$"),),
    # b12x 1.5.1's KDA decode/verify kernel as CUPTI named it on the H200 (tests/data/monitor/h200), and any
    # kernel that names b12x or its gdn_decode path.
    "b12x": (re.compile(r"^_packed_sequential_kda_decode_kernel$"), re.compile(r"(?i)gdn|b12x")),
    "torch": (),
}
# An eager step runs every kernel its graph holds, as often as the graph does. A kernel name of a plan's graph
# counts as run eagerly when the decode window launched it outside graphs (beyond the prefill-only baseline)
# at least EAGER_RATE times as often as inside them; the plan ran its step eagerly when EAGER_NAMES of its
# graph's kernel names did. Honest host work around a replay (MTP drafting between verify steps, sampling)
# shares some names with the step, never nearly all of them at that rate.
EAGER_RATE = 0.5
EAGER_NAMES = 0.8
# A same-weights reload from a file copies into the existing parameters: new device memory of more than
# this fraction of the weights' bytes means parameters (or a copy of them) were allocated anew.
RELOAD_ALLOC_SHARE = 0.25
RELOAD_ALLOC_FLOOR = 64 << 20  # bytes; a reload may allocate small scratch (hashing, staging rows)


@dataclass(frozen=True)
class Kernel:
    name: str
    graph: int  # 0: launched outside a CUDA graph
    count: int
    grid: tuple[int, ...] = ()
    stream: int = 0
    nodes: tuple[int, ...] = ()


@dataclass
class Window:
    label: str
    missing: str | None = None  # why the monitor sent nothing for it
    error: str | None = None  # the monitor's own trouble (CUPTI absent, flush failed)
    kernels: list[Kernel] = field(default_factory=list)
    api: list[tuple[str, int]] = field(default_factory=list)  # (call name, return value)
    allocations: list[int] = field(default_factory=list)  # bytes of each device allocation
    frees: list[int] = field(default_factory=list)
    truncated: bool = False
    enabled: tuple[str, ...] = ()

    # ------------------------------------------------------------ views
    @property
    def reported(self) -> bool:
        """A complete report with kernels recorded. A truncated one is not: flooding a window with distinct
        launches must not push the kernels that matter out of it."""
        return (
            self.missing is None
            and self.error is None
            and "CONCURRENT_KERNEL" in self.enabled
            and not self.truncated
        )

    @property
    def why_not(self) -> str | None:
        if self.reported:
            return None
        if self.truncated:
            return "the report was truncated at the monitor's bounds"
        return self.missing or self.error or f"kernel records not enabled ({list(self.enabled)})"

    @property
    def api_traced(self) -> bool:
        """The monitor recorded graph API calls (instantiate, launch, capture) in this window."""
        return any(k.startswith("API:") for k in self.enabled)

    @property
    def graph_ids(self) -> set[int]:
        return {k.graph for k in self.kernels if k.graph}

    def launches(self, *, in_graph: bool, names: set[str] | None = None) -> int:
        return sum(
            k.count for k in self.kernels if bool(k.graph) == in_graph and (names is None or k.name in names)
        )

    def names(self, *, in_graph: bool | None = None) -> set[str]:
        return {k.name for k in self.kernels if in_graph is None or bool(k.graph) == in_graph}

    def calls(self, word: str) -> int:
        return sum(1 for name, _ in self.api if word in name)

    @property
    def empty(self) -> bool:
        return not self.kernels and not self.api and not self.allocations and not self.frees


def parse_window(raw: Any) -> Window:
    """One window report as the monitor sent it (or the harness's `missing` stand-in); a malformed one
    is `missing` too."""
    if not isinstance(raw, dict):
        return Window("?", missing="the window report is not a JSON object")
    label = str(raw.get("label", "?"))[:200]
    if raw.get("missing"):
        return Window(label, missing=str(raw["missing"])[:300])
    try:
        kernels = [
            Kernel(
                name=str(k["name"]),
                graph=int(k.get("graph") or 0),
                count=int(k.get("count", 1)),
                grid=tuple(int(x) for x in k.get("grid") or ()),
                stream=int(k.get("stream") or 0),
                nodes=tuple(int(x) for x in k.get("nodes") or ()),
            )
            for k in raw.get("kernels") or []
        ]
        api = [(str(a[0]), int(a[3]) if len(a) > 3 else 0) for a in raw.get("api") or []]
        allocs = [int(m[1]) for m in raw.get("memory") or [] if m[0] == "alloc"]
        frees = [int(m[1]) for m in raw.get("memory") or [] if m[0] == "free"]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return Window(label, missing=f"the window report is malformed: {type(exc).__name__}: {exc}"[:300])
    return Window(
        label,
        error=str(raw["error"])[:300] if raw.get("error") else None,
        kernels=kernels,
        api=api,
        allocations=allocs,
        frees=frees,
        truncated=bool(raw.get("truncated")),
        enabled=tuple(str(k) for k in raw.get("enabled") or ()),
    )


def signature_names(names: Iterable[str], backend: str) -> set[str]:
    pats = KDA_SIGNATURES.get(backend, ())
    return {n for n in names if any(p.search(n) for p in pats)}


def foreign_names(names: Iterable[str], backend: str) -> dict[str, list[str]]:
    """Kernel names that belong to a KDA backend other than `backend`."""
    names = set(names)
    out = {}
    for other in KDA_SIGNATURES:
        if other != backend:
            hit = sorted(signature_names(names, other))
            if hit:
                out[other] = hit
    return out


# ------------------------------------------------------------ the steps at each captured size
ATTEMPTS = 3  # decode windows per plan and phase at most: a request that ends early (EOS) shrinks the batch


@dataclass
class StepWindows:
    """For one captured plan (requests, tokens per request): a prefill-only window (max_tokens 1) and up to
    ATTEMPTS windows with decode/verify steps, all asked in graph mode (a next attempt, with other prompts,
    only where the one before did not replay the plan's own graph)."""

    plan: tuple[int, int]
    baseline: Window
    decodes: list[Window]

    @property
    def graph_ids(self) -> set[int]:
        return set().union(*(w.graph_ids for w in self.decodes)) if self.decodes else set()


def _fmt_plan(p: tuple[int, int]) -> str:
    return f"{p[0]}x{p[1]}"


def own_graphs(steps: Sequence[StepWindows]) -> dict[tuple[int, int], set[int]]:
    """Each plan's own graphs: the ids its decode windows replayed that no window of a plan with fewer
    requests (same tokens per request) replayed. Requests that end early leave the batch, so a window of
    8 requests may go on in the graphs of 4, 2 and 1; its first steps are in the graph of 8 alone."""
    out: dict[tuple[int, int], set[int]] = {}
    for tpr in sorted({s.plan[1] for s in steps}):
        seen: set[int] = set()
        for s in sorted((s for s in steps if s.plan[1] == tpr), key=lambda s: s.plan[0]):
            out[s.plan] = s.graph_ids - seen
            seen |= s.graph_ids
    return out


def step_findings(steps: Sequence[StepWindows], backend: str) -> dict[str, Any]:
    """Per plan: its own graphs, every graph id replayed, kernels in and out of graphs, the step kernels run
    eagerly beyond the prefill-only baseline, the KDA kernels seen in graphs and outside them."""
    graph_names: set[str] = set()
    for s in steps:
        for d in s.decodes:
            graph_names |= d.names(in_graph=True)
    own = own_graphs(steps)
    out: dict[str, Any] = {}
    for s in steps:
        b = s.baseline
        eager: list[str] = []  # of the attempt that ran the largest share of its step kernels eagerly
        n_names, share, kda_out = 0, -1.0, 0
        for d in s.decodes:
            names = d.names(in_graph=True) or graph_names  # no graph in it: the other plans' step kernels
            run_eagerly = sorted(
                n
                for n in names
                if d.launches(in_graph=False, names={n}) - b.launches(in_graph=False, names={n})
                >= EAGER_RATE * max(1, d.launches(in_graph=True, names={n}))
            )
            if len(run_eagerly) / max(1, len(names)) > share:
                eager, n_names, share = run_eagerly, len(names), len(run_eagerly) / max(1, len(names))
            sig = signature_names(d.names() | b.names(), backend)
            kda_out = max(
                kda_out, d.launches(in_graph=False, names=sig) - b.launches(in_graph=False, names=sig)
            )
        in_graph = min((d.launches(in_graph=True) for d in s.decodes), default=0)
        windows = [b, *s.decodes]
        all_names: set[str] = set().union(*(w.names() for w in windows))
        out[_fmt_plan(s.plan)] = {
            "reported": bool(s.decodes) and all(w.reported for w in windows),
            "why_not": next((w.why_not for w in windows if w.why_not), None),
            "attempts": len(s.decodes),
            "own_graphs": sorted(own.get(s.plan, set())),
            "graph_ids": sorted(s.graph_ids),
            "graph_launch_calls": sum(d.calls("GraphLaunch") for d in s.decodes),
            "kernel_launches_in_graphs": in_graph,  # the least of its attempts
            "kernel_launches_outside": sum(d.launches(in_graph=False) for d in s.decodes),
            "step_kernel_names": n_names,
            "step_kernel_names_run_eagerly": eager[:20],
            "step_kernel_names_run_eagerly_count": len(eager),
            "kda_kernels_in_graphs": sorted(
                set().union(*(signature_names(d.names(in_graph=True), backend) for d in s.decodes))
            ),
            "kda_launches_outside_graphs": max(0, kda_out),
            "foreign_kda_kernels": foreign_names(all_names, backend),
            "instantiations": sum(w.calls("GraphInstantiate") for w in windows),
            "truncated": any(w.truncated for w in windows),
        }
    return out


def capture_conditions(steps: Sequence[StepWindows], backend: str) -> dict[str, tuple[bool, str]]:
    """(holds, detail) for: every window reported; every captured plan replayed a graph of its own; no
    attempt ran its step eagerly beside (or instead of) the graphs; the KDA kernels ran only inside graphs."""
    f = step_findings(steps, backend)
    silent = [p for p, x in f.items() if not x["reported"]]
    no_graph = [p for p, x in f.items() if not x["own_graphs"]]
    eager = [
        f"{p}: {x['step_kernel_names_run_eagerly_count']} of {x['step_kernel_names']} step kernels run "
        f"outside graphs (e.g. {x['step_kernel_names_run_eagerly'][:3]}), {x['kernel_launches_in_graphs']} "
        "launches in graphs"
        for p, x in f.items()
        if x["step_kernel_names_run_eagerly_count"] >= EAGER_NAMES * max(1, x["step_kernel_names"])
        or not x["kernel_launches_in_graphs"]
    ]
    kda_out = [
        f"{p}: {x['kda_launches_outside_graphs']}" for p, x in f.items() if x["kda_launches_outside_graphs"]
    ]
    why_silent = next((f[p]["why_not"] for p in silent), None)
    replayed = "; ".join(f"{p}: own graphs {x['own_graphs']} of {x['graph_ids']}" for p, x in f.items())
    return {
        "capture_monitor_reported_every_window": (
            bool(f) and not silent,
            f"silent for {silent}: {why_silent}" if silent else f"plans {', '.join(f) or 'none'}",
        ),
        "capture_every_size_replayed_its_graph": (
            bool(f) and not silent and not no_graph,
            f"no graph of its own replayed for {no_graph}" if no_graph else replayed,
        ),
        "capture_no_step_kernel_ran_eagerly": (
            bool(f) and not silent and not eager,
            "; ".join(eager) if eager else "step kernels outside graphs only as host work beside them",
        ),
        "capture_kda_kernels_only_in_graphs": (
            bool(f) and not silent and not kda_out,
            f"KDA kernels outside graphs: {kda_out}" if kda_out else "none outside graphs",
        ),
    }


def backend_conditions(steps: Sequence[StepWindows], backend: str) -> dict[str, tuple[bool, str]]:
    """The KDA kernels in the graph-mode steps are the resolved backend's, and none of another backend's."""
    f = step_findings(steps, backend)
    silent = [p for p, x in f.items() if not x["reported"]]
    has_sig = bool(KDA_SIGNATURES.get(backend))
    missing = [p for p, x in f.items() if has_sig and not x["kda_kernels_in_graphs"]]
    foreign: dict[str, list[str]] = {}
    for x in f.values():
        for other, names in x["foreign_kda_kernels"].items():
            foreign[other] = sorted(set(foreign.get(other, [])) | set(names))
    seen = sorted({n for x in f.values() for n in x["kda_kernels_in_graphs"]})
    own = (
        f"{backend} kernels in the graphs of every plan: {seen}"
        if has_sig
        else f"{backend} has no kernel signature of its own: proven by the absence of the others'"
    )
    return {
        "backend_resolved_kernels_in_every_step": (
            bool(f) and not silent and not missing,
            f"no {backend} KDA kernel in the graphs of {missing}" if missing else own,
        ),
        "backend_no_kernels_of_other_backends": (
            bool(f) and not silent and not foreign,
            f"kernels of {foreign}" if foreign else "none",
        ),
    }


# ------------------------------------------------------------ reloads
@dataclass
class ReloadWindows:
    """One in-place reload: the window around the reload request, and the decode windows per plan after it."""

    name: str  # same | other | back
    reload: Window
    after: dict[tuple[int, int], list[Window]]
    from_file: bool  # loaded from a weights file (same, back); "other" generates weights on the device


def reload_conditions(
    before: Sequence[StepWindows], reloads: Sequence[ReloadWindows], weights_bytes: int | None
) -> dict[str, tuple[bool, str]]:
    """After each in-place reload: every graph replayed is one captured before it, and each plan replays its
    own graph again; no graph was instantiated (nor a stream captured) in the reload or after it; a reload
    from a file allocated no parameter-sized device memory."""
    own = own_graphs(before)
    captured: set[int] = set().union(*(s.graph_ids for s in before)) if before else set()
    silent, changed, inst, allocs = [], [], [], []
    limit = max(RELOAD_ALLOC_FLOOR, int(RELOAD_ALLOC_SHARE * (weights_bytes or 0)))
    # The API records are proven to work only by themselves: graph replays before the reloads must have come
    # with their launch calls (on the H200, a CUPTI that said it traced them once recorded none).
    launches = sum(d.calls("GraphLaunch") for s in before for d in s.decodes)
    if not launches:
        inst.append("graph API calls not traced: no graph launch call was recorded beside the replays")
    for r in reloads:
        windows = [r.reload, *(w for ws in r.after.values() for w in ws)]
        silent += [f"{r.name}:{w.label}" for w in windows if not w.reported]
        for plan, ws in r.after.items():
            ids = set().union(*(w.graph_ids for w in ws)) if ws else set()
            mine = own.get(plan, set())
            if not ids or not mine or not ids <= captured or not ids & mine:
                changed.append(f"{r.name} {_fmt_plan(plan)}: {sorted(ids)} (its own {sorted(mine)})")
        n = sum(w.calls("GraphInstantiate") + w.calls("StreamBeginCapture") for w in windows)
        if n:
            inst.append(f"{r.name}: {n}")
        untraced = [w.label for w in windows if w.reported and not w.api_traced]
        if untraced:  # no API records: an instantiation could not have been seen, so none is not proven
            inst.append(f"{r.name}: graph API calls not traced in {untraced[:2]}")
        total = sum(r.reload.allocations)
        if r.from_file and total > limit:
            allocs.append(
                f"{r.name}: {total} bytes in {len(r.reload.allocations)} allocations (limit {limit})"
            )
    ok = bool(reloads) and not silent
    return {
        "reload_monitor_reported_every_window": (
            ok,
            f"silent: {silent[:4]}" if silent else f"{len(reloads)} reloads",
        ),
        "reload_same_graphs_replayed": (
            ok and not changed,
            "; ".join(changed[:4]) or f"only graphs captured before ({len(captured)}), each plan its own",
        ),
        "reload_no_graph_instantiated": (
            ok and not inst,
            f"instantiations or captures: {inst}" if inst else "none",
        ),
        "reload_no_parameter_sized_allocation": (
            ok and not allocs,
            "; ".join(allocs) if allocs else f"under {limit} bytes in each reload from a file",
        ),
    }


def hello_condition(hello: dict[str, Any] | None, lost: str | None) -> tuple[bool, str]:
    """The monitor started inside the engine with CUPTI recording kernels, and kept its channel to the end."""
    if hello is None:
        return False, lost or "no hello from the monitor"
    if lost:
        return False, f"the monitor stopped reporting: {lost}"
    if hello.get("error") or "CONCURRENT_KERNEL" not in (hello.get("kinds") or []):
        return False, f"CUPTI not recording: {hello.get('error') or hello.get('kinds')}"
    if hello.get("torch_imported_before"):
        return False, "torch was imported before the monitor started"
    return True, f"cupti-python {hello.get('cupti')}, kinds {hello.get('kinds')}, pid {hello.get('pid')}"


# ------------------------------------------------------------ a run's windows, by label
# The monitor check names its windows so that a recorded run can be judged again from monitor.jsonl alone:
#   "before baseline NxT", "before decode NxT"          the steps at each captured plan
#   "reload same|other|back"                             the reload request itself
#   "after same|other|back decode NxT"                   the steps after it
# A decode window that did not replay its plan's own graph (a request ended early) is tried again with other
# prompts, up to ATTEMPTS in all: "... decode NxT #2", "#3"; every attempt counts against the engine.
RELOADS = ("same", "other", "back")


def label_step(phase: str, kind: str, plan: tuple[int, int], attempt: int = 1) -> str:
    """`before decode 8x4`; a later attempt of the same window: `before decode 8x4 #2`."""
    return f"{phase} {kind} {plan[0]}x{plan[1]}" + (f" #{attempt}" if attempt > 1 else "")


def evaluate(
    raw_windows: Iterable[dict[str, Any]],
    plans: Sequence[tuple[int, int]],
    backend: str,
    weights_bytes: int | None,
    hello: dict[str, Any] | None,
    lost: str | None,
) -> tuple[dict[str, tuple[bool, str]], dict[str, Any]]:
    """Every monitored condition of a run, and the evidence the receipt keeps, from its window reports."""
    by_label: dict[str, Window] = {}
    for raw in raw_windows:
        w = parse_window(raw)
        by_label.setdefault(w.label, w)  # the first window of a label counts; a repeat cannot replace it

    def get(label: str) -> Window:
        return by_label.get(label) or Window(label, missing="no window with this label was reported")

    def attempts(phase: str, p: tuple[int, int]) -> list[Window]:
        found = [
            by_label[x]
            for k in range(1, ATTEMPTS + 1)
            if (x := label_step(phase, "decode", p, k)) in by_label
        ]
        return found or [get(label_step(phase, "decode", p))]

    before = [StepWindows(p, get(label_step("before", "baseline", p)), attempts("before", p)) for p in plans]
    reloads = [
        ReloadWindows(
            r, get(f"reload {r}"), {p: attempts(f"after {r}", p) for p in plans}, from_file=r != "other"
        )
        for r in RELOADS
    ]
    ok, detail = hello_condition(hello, lost)
    conds = {
        "monitor_reported_from_the_engine": (ok, detail),
        **capture_conditions(before, backend),
        **backend_conditions(before, backend),
        **reload_conditions(before, reloads, weights_bytes),
    }
    evidence = {
        "backend": backend,
        "plans": [list(p) for p in plans],
        "steps": step_findings(before, backend),
        "reloads": {
            r.name: {
                "graph_ids_after": {
                    _fmt_plan(p): sorted(set().union(*(w.graph_ids for w in ws))) for p, ws in r.after.items()
                },
                "instantiations": r.reload.calls("GraphInstantiate"),
                "allocated_bytes": sum(r.reload.allocations),
                "allocations": len(r.reload.allocations),
                "from_file": r.from_file,
            }
            for r in reloads
        },
        "weights_bytes": weights_bytes,
        "signatures": {k: [p.pattern for p in v] for k, v in KDA_SIGNATURES.items()},
    }
    return conds, evidence
