"""A receipt's predicate in words, facts first: the one-line summary, the facts table, and every check's
conditions with their sources. Reads plain JSON and tolerates receipts written before a field existed."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from datetime import UTC
from typing import Any

from receipts.statement import parse_time

# How a comparison of two greedy runs is named for people (generation/capture evidence keys).
COMPARISONS = {
    "replay_vs_eager": "replay vs eager",
    "before_vs_after_reload": "post-reload generation",
    "speculative_vs_plain": "speculative vs plain",
}
_EXIT_137 = re.compile(r"exited with code 137\b")


@dataclass(frozen=True)
class ConditionView:
    name: str
    holds: bool
    source: str
    detail: str | None


@dataclass(frozen=True)
class CheckView:
    name: str
    status: str
    seconds: float
    reason: str | None
    conditions: tuple[ConditionView, ...]

    @property
    def failing(self) -> tuple[ConditionView, ...]:
        return tuple(c for c in self.conditions if not c.holds)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _spans(value: Any) -> str:
    return "[" + ", ".join(str(v) for v in _list(value)) + "]"


def is_oom(predicate: dict[str, Any]) -> bool:
    oom = _dict(_dict(predicate.get("faults")).get("oom"))
    return bool(oom.get("container")) or bool(oom.get("cuda_oom_count"))


def explain_exit(text: str, oom: bool) -> str:
    """Exit code 137 is a SIGKILL: say OOM when the run recorded one, else say what 137 means."""
    if oom:
        return _EXIT_137.sub("was killed for memory (OOM, exit code 137)", text)
    return _EXIT_137.sub("was killed (exit code 137: SIGKILL)", text)


def checks(predicate: dict[str, Any]) -> list[CheckView]:
    """Every check with its conditions (none in receipts written before conditions were recorded)."""
    out = []
    for c in _list(predicate.get("checks")):
        if not isinstance(c, dict):
            continue
        conditions = tuple(
            ConditionView(str(name), bool(v.get("holds")), str(v.get("source") or "?"), v.get("detail"))
            for name, v in _dict(c.get("conditions")).items()
            if isinstance(v, dict)
        )
        out.append(
            CheckView(
                str(c.get("name")),
                str(c.get("status")),
                float(c.get("seconds") or 0.0),
                c.get("reason"),
                conditions,
            )
        )
    return out


def _check(predicate: dict[str, Any], name: str) -> dict[str, Any]:
    return next((c for c in _list(predicate.get("checks")) if _dict(c).get("name") == name), {})


def failures(predicate: dict[str, Any]) -> list[str]:
    """What differed, one item per failed or errored check: its failing conditions, else its reason."""
    oom = is_oom(predicate)
    out = []
    for check in checks(predicate):
        if check.status not in ("fail", "error"):
            continue
        if check.name == "layout" and _layout_differs(predicate):
            out.append(f"layout: {_mismatch(predicate)}")
            continue
        parts = [f"{c.name} ({c.source}){': ' + c.detail if c.detail else ''}" for c in check.failing]
        text = "; ".join(parts) or check.reason or check.status
        out.append(f"{check.name}: {explain_exit(text, oom)}")
    return out


# --------------------------------------------------------------------------- the parts of the summary


def _layout_differs(predicate: dict[str, Any]) -> bool:
    registered = _dict(predicate.get("layout")).get("spans")
    requested = _dict(predicate.get("request")).get("layout")
    return bool(requested) and registered is not None and registered != requested


def _allocations(predicate: dict[str, Any]) -> str:
    """ "four CUDA-IPC allocations" from the layout check's groups (handle kinds), else from the layout."""
    groups = _list(_dict(_check(predicate, "layout").get("evidence")).get("groups"))
    kinds = Counter(str(_dict(g).get("handle_kind") or "") for g in groups)
    if groups and "" not in kinds:
        names = {"cuda-ipc": "CUDA-IPC", "shm": "shared-memory"}
        return " + ".join(f"{n} {names.get(k, k)}" for k, n in kinds.items()) + " allocations"
    n = len(_list(_dict(predicate.get("layout")).get("groups")))
    return f"{n} allocations" if n else ""


def _mismatch(predicate: dict[str, Any]) -> str:
    registered = _dict(predicate.get("layout")).get("spans")
    return (
        f"registered {_spans(registered)} ≠ requested {_spans(_dict(predicate.get('request')).get('layout'))}"
    )


def _layout_phrase(predicate: dict[str, Any], mismatch: bool = True) -> str:
    """The registered layout, its allocations and the peer's verdict; `mismatch`: say what differed from
    the request (False where the failures already say it)."""
    layout = _dict(predicate.get("layout"))
    if not layout:
        return "no layout registered (the run stopped before the engine described it)"
    spans = layout.get("spans")
    requested = _dict(predicate.get("request")).get("layout")
    allocations = _allocations(predicate)
    across = f" across {allocations}" if allocations else ""
    peer = "" if layout.get("peer_verified") else ", NOT verified by the peer"
    if requested and spans != requested:
        return f"{_mismatch(predicate) if mismatch else 'layout'}{across}{peer}"
    exact = "the exact layout" if requested else "layout"
    none = "" if requested else " (none demanded)"
    return f"registered {exact} {_spans(spans)}{none}{across}{peer}"


def _backend_phrase(predicate: dict[str, Any]) -> str:
    backend = _dict(predicate.get("backend"))
    if not backend.get("resolved"):
        return "KDA backend not resolved"
    kernels = ", ".join(str(k) for k in _list(backend.get("kernel_names")))
    proof = f" proven by kernels {kernels}" if kernels else " (no kernel seen)"
    return f"KDA backend {backend['resolved']} (requested {backend.get('requested', '?')}){proof}"


def _capture_phrase(predicate: dict[str, Any]) -> str:
    check = _check(predicate, "capture")
    if not check:
        return "capture not run"
    status = check.get("status")
    capture = _dict(_dict(check.get("evidence")).get("capture"))
    if status == "pass":
        sizes = capture.get("sizes")
        return f"FULL capture of sizes {_spans(sizes)}" if sizes else "FULL capture"
    if status == "skip":
        return f"no capture ({check.get('reason') or 'skipped'})"
    return f"capture {str(status).upper()}"


def coherence(predicate: dict[str, Any]) -> list[tuple[str, str]]:
    """(comparison, outcome) for every greedy comparison the generation check recorded."""
    evidence = _dict(_check(predicate, "generation").get("evidence"))
    out = []
    for key, found in _dict(evidence.get("comparisons")).items():
        found = _dict(found)
        label = COMPARISONS.get(key, key.replace("_", " "))
        if "not_applicable" in found:
            out.append((label, f"not applicable: {found['not_applicable']}"))
            continue
        outcome = found.get("summary") or found.get("outcome")
        if outcome is None and "identical" in found:
            outcome = "identical" if found["identical"] else "not identical"
        agrees = found.get("agrees")
        word = "coherent" if agrees else "NOT coherent" if agrees is False else "compared"
        out.append((label, f"{word} ({outcome})" if outcome else word))
    return out


def _coherence_phrase(predicate: dict[str, Any]) -> str:
    compared = [(label, text) for label, text in coherence(predicate) if not text.startswith("not appl")]
    if not compared:
        return "generation not compared"
    return ", ".join(f"{label} {text}" for label, text in compared)


def _xid_words(faults: dict[str, Any]) -> tuple[str | None, bool]:
    """(what to say about Xid, whether "no Xid" may be said)."""
    events = [_dict(e) for e in _list(faults.get("xid_events"))]
    watch = faults.get("xid_watch")
    if events:
        codes = ", ".join(f"{e.get('code')}{' (fatal)' if e.get('fatal') else ''}" for e in events)
        return f"Xid {codes}", False
    if watch == "active":
        return None, True
    why = str(faults.get("xid_watch_reason") or "").split(":")[0]
    state = "not applicable" if watch == "not_applicable" else "UNAVAILABLE"
    return f"Xid watch {state}{f' ({why})' if why else ''}", False


def _xid_fact(faults: dict[str, Any]) -> str:
    events = [_dict(e) for e in _list(faults.get("xid_events"))]
    state = faults.get("xid_watch")
    watch = (
        "watched for the whole run"
        if state == "active"
        else f"watch {str(state).replace('_', ' ')}: {faults.get('xid_watch_reason') or 'no reason given'}"
    )
    if not events:
        return f"none ({watch})"
    codes = ", ".join(f"{e.get('code')}{' (fatal)' if e.get('fatal') else ''}" for e in events)
    return f"{codes} ({watch})"


def _time(predicate: dict[str, Any]) -> str:
    start, end = parse_time(predicate.get("started_at")), parse_time(predicate.get("finished_at"))
    if start is None or end is None:
        return f"{predicate.get('started_at')} → {predicate.get('finished_at')}"
    iso = [t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z") for t in (start, end)]
    return f"{iso[0]} → {iso[1]} ({(end - start).total_seconds():.1f} s)"


def _faults_phrase(predicate: dict[str, Any]) -> str:
    faults = _dict(predicate.get("faults"))
    if not faults:
        return "faults not recorded"
    parts = [f"restart count {int(faults.get('restart_count') or 0)}"]
    absent = []
    xid, no_xid = _xid_words(faults)
    if xid:
        parts.append(xid)
    if no_xid:
        absent.append("Xid")
    oom = _dict(faults.get("oom"))
    if oom.get("container"):
        parts.append("OOM: the container was killed for memory")
    if oom.get("cuda_oom_count"):
        parts.append(f"CUDA OOM {oom['cuda_oom_count']} time(s)")
    if not is_oom(predicate):
        absent.append("OOM")
    if faults.get("engine_dead"):
        parts.append("engine DEAD before the end")
    else:
        absent.append("EngineDead")
    if absent:
        parts.append("no " + "/".join(absent))
    return "; ".join(parts)


def _monitor_phrase(predicate: dict[str, Any]) -> str:
    """What the harness's CUDA activity monitor inside the engine said: how many monitored conditions held,
    or why there are none (a CPU target, a receipt from before the monitor)."""
    check = _check(predicate, "monitor")
    if not check:
        return "not run"
    conds = [_dict(c) for c in _dict(check.get("conditions")).values()]
    mine = [c for c in conds if c.get("source") == "monitored"]
    if not mine:
        return f"{check.get('status', '?')}: {check.get('reason') or 'no monitored conditions'}"
    held = sum(1 for c in mine if c.get("holds"))
    return f"{held} of {len(mine)} monitored conditions hold (CUPTI inside the engine process)"


def summary_line(predicate: dict[str, Any]) -> str:
    """One line with what an auditor looks for first, like: qualified (gpu): registered the exact layout
    [2304, 2304, 2304, 9216] across 4 CUDA-IPC allocations; …; restart count 0; no Xid/OOM/EngineDead."""
    head = f"{predicate.get('verdict', '?')} ({predicate.get('target', '?')} target)"
    failed = failures(predicate)
    if failed:
        head += " — failed: " + " | ".join(failed)
    parts = [
        _layout_phrase(predicate, mismatch=not _layout_differs(predicate) or not failed),
        _backend_phrase(predicate),
        _capture_phrase(predicate),
        _coherence_phrase(predicate),
        _faults_phrase(predicate),
    ]
    return f"{head}{' — ' if failed else ': '}" + "; ".join(parts)


def facts(predicate: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows: target and host, engine, request, layout, backend, capture, coherence, faults."""
    host = _dict(predicate.get("host"))
    request = _dict(predicate.get("request"))
    layout = _dict(predicate.get("layout"))
    backend = _dict(predicate.get("backend"))
    faults = _dict(predicate.get("faults"))
    engine = _dict(predicate.get("engine"))
    gpus = ", ".join(str(_dict(g).get("name")) for g in _list(predicate.get("gpu")))
    rows = [
        ("verdict", str(predicate.get("verdict"))),
        (
            "target",
            f"{predicate.get('target')} on {host.get('hostname', '?')} ({host.get('os', '?')}, kernel "
            f"{host.get('kernel', '?')}{', ' + host['arch'] if host.get('arch') else ''})"
            + (f"; GPUs: {gpus}" if gpus else ""),
        ),
        (
            "engine",
            " ".join(
                str(v)
                for v in (
                    engine.get("name"),
                    engine.get("version"),
                    engine.get("image_digest") or engine.get("code_digest"),
                )
                if v
            ),
        ),
        (
            "request",
            f"layout {_spans(request['layout']) if request.get('layout') else 'any'}, backend "
            f"{request.get('kda_backend', '?')}, spec {request.get('spec', '?')}, preset "
            f"{request.get('preset') or '?'}, launcher {request.get('launcher', '?')}",
        ),
    ]
    if layout:
        groups = ", ".join(
            f"{_dict(g).get('kind')} span {_dict(g).get('span')}" for g in _list(layout.get("groups"))
        )
        rows.append(
            (
                "layout",
                f"{_layout_phrase(predicate)}; chunk {layout.get('chunk')}, "
                f"ratios {_spans(layout.get('ratios'))}" + (f"; groups: {groups}" if groups else ""),
            )
        )
    else:
        rows.append(("layout", _layout_phrase(predicate)))
    if backend:
        kernels = ", ".join(str(k) for k in _list(backend.get("kernel_names"))) or "none seen"
        rows.append(
            (
                "backend",
                f"{backend.get('requested')} → {backend.get('resolved')} "
                f"({backend.get('reason') or 'no reason'})"
                f"; kernels: {kernels}",
            )
        )
    else:
        rows.append(("backend", "not resolved"))
    rows.append(("capture", _capture_phrase(predicate)))
    rows.append(("monitor", _monitor_phrase(predicate)))
    for label, text in coherence(predicate) or [("coherence", "not compared")]:
        rows.append((label, text))
    oom = _dict(faults.get("oom"))
    rows += [
        ("restarts", str(faults.get("restart_count", "?"))),
        ("Xid", _xid_fact(faults)),
        (
            "OOM",
            "OOM: the container was killed for memory"
            if oom.get("container")
            else f"CUDA OOM {oom['cuda_oom_count']} time(s)"
            if oom.get("cuda_oom_count")
            else "none",
        ),
        ("engine dead", "YES, before the run ended" if faults.get("engine_dead") else "no"),
        ("time", _time(predicate)),
    ]
    return rows
