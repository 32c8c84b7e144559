"""The audit report: `collect` reads and verifies the store; `render` draws one self-contained HTML page
(inline CSS and SVG, no script, no network): history, failures, faults, timings, log growth, verification."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import TYPE_CHECKING, Any

from qualify.receipt_view import explain_exit
from receipts import dsse
from receipts.checkpoint import NoteVerifier
from receipts.errors import NotFound, ReceiptsError, TamperError
from receipts.records import Entry
from receipts.statement import parse_time
from receipts.verify import verify_log

if TYPE_CHECKING:
    from receipts.store import Store

VERDICT_COLOURS = {"qualified": "#2e7d32", "rejected": "#c62828", "aborted": "#ef6c00"}
DECISION_COLOURS = {"approved": "#2e7d32", "denied": "#c62828", "warn": "#ef6c00"}
FAULT_KINDS = ("restarts", "fatal Xid", "non-fatal Xid", "container OOM", "CUDA OOM", "engine dead")
CHART_WIDTH = 1040


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class ConditionPoint:
    name: str
    holds: bool
    source: str  # observed | derived | monitored | engine
    detail: str | None = None


@dataclass(frozen=True)
class CheckPoint:
    name: str
    status: str
    seconds: float
    conditions: tuple[ConditionPoint, ...] = ()  # none in receipts written before conditions were recorded
    reason: str | None = None


@dataclass(frozen=True)
class ReceiptPoint:
    """What the report shows of one receipt (from its verified envelope where it verified)."""

    receipt_id: str
    log_index: int
    subject: str  # the subject the report files it under, "sha256:..." (see `collect`)
    subject_name: str
    verdict: str
    host: str
    finished_at: datetime
    checks: tuple[CheckPoint, ...] = ()
    faults: dict[str, int] = field(default_factory=dict)  # FAULT_KINDS -> count
    verified: bool = True
    subjects: tuple[tuple[str, str], ...] = ()  # every (name, digest) the statement names, in order


@dataclass(frozen=True)
class CheckpointPoint:
    size: int
    created_at: datetime


@dataclass(frozen=True)
class ApprovalPoint:
    approval_id: str
    log_index: int
    subject: str
    decision: str
    created_at: datetime
    reasons: tuple[str, ...] = ()
    subject_name: str = ""  # the name receipts give that digest ("" when no receipt names it)


@dataclass(frozen=True)
class LogStatus:
    """The whole log's verification at report time."""

    ok: bool
    size: int
    summary: str
    problems: tuple[str, ...] = ()
    checkpoint: str | None = None  # latest signed checkpoint note


@dataclass(frozen=True)
class ReportData:
    generated_at: datetime
    store: str  # the store URL with any password hidden
    receipts: tuple[ReceiptPoint, ...]
    checkpoints: tuple[CheckpointPoint, ...]
    approvals: tuple[ApprovalPoint, ...]
    status: LogStatus


def faults_of(predicate: dict[str, Any]) -> dict[str, int]:
    """Fault counts of a predicate, keyed by FAULT_KINDS."""
    faults = predicate.get("faults") or {}
    xids = faults.get("xid_events") or []
    oom = faults.get("oom") or {}
    return {
        "restarts": int(faults.get("restart_count") or 0),
        "fatal Xid": sum(1 for x in xids if isinstance(x, dict) and x.get("fatal")),
        "non-fatal Xid": sum(1 for x in xids if isinstance(x, dict) and not x.get("fatal")),
        "container OOM": 1 if oom.get("container") else 0,
        "CUDA OOM": int(oom.get("cuda_oom_count") or 0),
        "engine dead": 1 if faults.get("engine_dead") else 0,
    }


def _conditions(check: dict[str, Any]) -> tuple[ConditionPoint, ...]:
    found = check.get("conditions")
    if not isinstance(found, dict):
        return ()
    return tuple(
        ConditionPoint(str(name), bool(c.get("holds")), str(c.get("source") or "?"), c.get("detail"))
        for name, c in found.items()
        if isinstance(c, dict)
    )


def checks_of(predicate: dict[str, Any]) -> tuple[CheckPoint, ...]:
    return tuple(
        CheckPoint(
            str(c.get("name")),
            str(c.get("status")),
            float(c.get("seconds") or 0.0),
            _conditions(c),
            c.get("reason") if isinstance(c.get("reason"), str) else None,
        )
        for c in predicate.get("checks") or []
        if isinstance(c, dict)
    )


# --------------------------------------------------------------------------- SVG helpers


def _t(text: Any) -> str:
    return escape(str(text), quote=True)


def _svg(height: int, body: list[str], label: str, left: int = 0) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_t(label)}" data-left="{left}" '
        f'width="{CHART_WIDTH}" height="{height}" viewBox="0 0 {CHART_WIDTH} {height}">'
        + "".join(body)
        + "</svg>"
    )


# Width of one character of a 12 px chart label, rounded up (wide letters included), so that a margin sized
# from it holds the label: labels are right-aligned against the chart and must not run off its left edge.
LABEL_CHAR_PX = 7.6
LABEL_MAX_CHARS = 40


def _fit(text: str, limit: int = LABEL_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _margin(labels: list[str], least: int = 120) -> int:
    """The left margin (px) that holds the longest label and a gap before the chart."""
    longest = max((len(label) for label in labels), default=0)
    return max(least, int(longest * LABEL_CHAR_PX) + 24)


def _empty(message: str) -> str:
    return f'<p class="empty">{_t(message)}</p>'


def _short(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"{algo}:{hexpart[:12]}" if hexpart else digest[:19]


def _time_axis(lo: float, hi: float, x0: int, x1: int, y: int) -> tuple[list[str], Any]:
    """Tick marks for a time axis and the x(t) mapping; a single instant is centred."""
    span = hi - lo

    def x_of(ts: float) -> float:
        return (x0 + x1) / 2 if span <= 0 else x0 + (ts - lo) / span * (x1 - x0)

    parts = [f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" class="axis"/>']
    ticks = 1 if span <= 0 else 5
    # Label precision follows the span, so a burst of appends within a minute still gets distinct ticks.
    fmt = (
        "%H:%M:%S.%f"
        if span < 60
        else "%H:%M:%S"
        if span < 3600
        else "%m-%d %H:%M"
        if span < 5 * 86400
        else "%Y-%m-%d"
    )
    for i in range(ticks):
        ts = lo if ticks == 1 else lo + span * i / (ticks - 1)
        x = x_of(ts)
        label = datetime.fromtimestamp(ts, UTC).strftime(fmt)
        label = label[:-3] if fmt.endswith("%f") else label  # milliseconds are enough
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 5}" class="axis"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 18}" class="tick" text-anchor="middle">{label}</text>')
    return parts, x_of


def history_chart(receipts: tuple[ReceiptPoint, ...]) -> str:
    """One row per subject (its name over its short digest); one dot per receipt at its finish time,
    coloured by verdict."""
    if not receipts:
        return _empty("No receipts yet: run `qualify run` to qualify a build.")
    by_subject: dict[str, list[ReceiptPoint]] = defaultdict(list)
    for r in receipts:
        by_subject[r.subject].append(r)
    subjects = sorted(by_subject, key=lambda s: min(r.finished_at for r in by_subject[s]))
    names = {s: _fit(by_subject[s][0].subject_name) for s in subjects}
    row, top, right = 38, 16, CHART_WIDTH - 60
    left = _margin([*names.values(), *(_short(s) for s in subjects)])
    height = top + row * len(subjects) + 40
    times = [r.finished_at.timestamp() for r in receipts]
    axis, x_of = _time_axis(min(times), max(times), left, right, top + row * len(subjects) + 4)
    body = list(axis)
    for i, subject in enumerate(subjects):
        y = top + row * i + row / 2
        body.append(f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" class="grid"/>')
        body.append(
            f'<text x="{left - 12}" y="{y - 3}" text-anchor="end" class="label subject-label">'
            f"<title>{_t(by_subject[subject][0].subject_name)} {_t(subject)}</title>"
            f'{_t(names[subject])}<tspan x="{left - 12}" dy="14" class="tick">{_t(_short(subject))}</tspan>'
            "</text>"
        )
        for r in sorted(by_subject[subject], key=lambda r: r.log_index):
            colour = VERDICT_COLOURS.get(r.verdict, "#616161")
            ring = "" if r.verified else ' stroke="#000" stroke-width="2" stroke-dasharray="2 2"'
            body.append(
                f'<circle class="receipt-dot verdict-{_t(r.verdict)}" data-receipt="{_t(r.receipt_id)}" '
                f'cx="{x_of(r.finished_at.timestamp()):.1f}" cy="{y}" r="7" fill="{colour}"{ring}>'
                f"<title>{_t(r.verdict)} on {_t(r.host)} at {r.finished_at.isoformat()} "
                f"(log #{r.log_index}{'' if r.verified else ', DOES NOT VERIFY'})</title></circle>"
            )
    return _svg(height, body, "qualification history per subject", left)


def _bars(rows: list[tuple[str, list[tuple[int | float, str, str]]]], label: str, unit: str = "") -> str:
    """Horizontal stacked bars: rows of (label, [(value, colour, css class)])."""
    row, top, right = 28, 10, CHART_WIDTH - 90
    left = _margin([_fit(name) for name, _ in rows])
    height = top + row * len(rows) + 10
    peak = max((sum(v for v, _, _ in parts) for _, parts in rows), default=0) or 1
    body = []
    for i, (name, parts) in enumerate(rows):
        y = top + row * i
        body.append(
            f'<text x="{left - 10}" y="{y + 17}" text-anchor="end" class="label">'
            f"<title>{_t(name)}</title>{_t(_fit(name))}</text>"
        )
        x = float(left)
        for value, colour, css in parts:
            width = (right - left) * value / peak
            if width > 0:
                body.append(
                    f'<rect class="bar {css}" data-name="{_t(name)}" data-value="{value}" x="{x:.1f}" '
                    f'y="{y + 4}" width="{width:.1f}" height="{row - 10}" fill="{colour}">'
                    f"<title>{_t(name)}: {value}{unit} {css}</title></rect>"
                )
            x += width
        total = sum(v for v, _, _ in parts)
        shown = f"{total:.2f}{unit}" if isinstance(total, float) else f"{total}{unit}"
        body.append(f'<text x="{x + 6:.1f}" y="{y + 17}" class="value">{shown}</text>')
    return _svg(height, body, label, left)


def failures_chart(receipts: tuple[ReceiptPoint, ...]) -> str:
    """Per check: how many runs failed or errored (stacked), out of how many ran it."""
    failed: Counter[str] = Counter()
    errored: Counter[str] = Counter()
    ran: Counter[str] = Counter()
    for r in receipts:
        for c in r.checks:
            ran[c.name] += 1
            if c.status == "fail":
                failed[c.name] += 1
            elif c.status == "error":
                errored[c.name] += 1
    if not ran:
        return _empty("No checks recorded yet.")
    rows = [
        (
            f"{name} ({ran[name]} runs)",
            [(failed[name], "#c62828", "failed"), (errored[name], "#8e24aa", "errored")],
        )
        for name in sorted(ran, key=lambda n: (-(failed[n] + errored[n]), n))
    ]
    return _bars(rows, "failures by check")


def faults_chart(receipts: tuple[ReceiptPoint, ...]) -> str:
    """Totals of restarts, Xid events, OOMs and dead engines over all receipts."""
    if not receipts:
        return _empty("No faults to count: there are no receipts.")
    totals = {kind: sum(r.faults.get(kind, 0) for r in receipts) for kind in FAULT_KINDS}
    colours = {"restarts": "#1565c0", "fatal Xid": "#c62828", "non-fatal Xid": "#f9a825"}
    rows = [(kind, [(totals[kind], colours.get(kind, "#6d4c41"), "fault")]) for kind in FAULT_KINDS]
    return _bars(rows, "restart, Xid and OOM counts")


def durations_chart(receipts: tuple[ReceiptPoint, ...]) -> str:
    """Per check: the range of wall times (min to max) with the median marked."""
    seconds: dict[str, list[float]] = defaultdict(list)
    for r in receipts:
        for c in r.checks:
            seconds[c.name].append(c.seconds)
    if not seconds:
        return _empty("No check timings recorded yet.")
    names = sorted(seconds)
    row, top, right = 28, 10, CHART_WIDTH - 150
    left = _margin([_fit(name) for name in names])
    height = top + row * len(names) + 34
    peak = max(max(v) for v in seconds.values()) or 1.0
    axis_y = top + row * len(names)
    body = [f'<line x1="{left}" y1="{axis_y}" x2="{right}" y2="{axis_y}" class="axis"/>']
    for i in range(5):
        value = peak * i / 4
        x = left + (right - left) * i / 4
        body.append(
            f'<text x="{x:.1f}" y="{top + row * len(names) + 18}" class="tick" text-anchor="middle">'
            f"{value:.2f} s</text>"
        )
    for i, name in enumerate(names):
        values = sorted(seconds[name])
        lo, mid, hi = values[0], statistics.median(values), values[-1]
        y = top + row * i + row / 2
        xs = [left + (right - left) * v / peak for v in (lo, mid, hi)]
        body.append(
            f'<text x="{left - 10}" y="{y + 4}" text-anchor="end" class="label">'
            f"<title>{_t(name)}</title>{_t(_fit(name))}</text>"
        )
        body.append(
            f'<line class="duration-range" data-check="{_t(name)}" '
            f'x1="{xs[0]:.1f}" y1="{y}" x2="{xs[2]:.1f}" '
            f'y2="{y}" stroke="#1565c0" stroke-width="6" stroke-linecap="round"/>'
        )
        body.append(
            f'<circle cx="{xs[1]:.1f}" cy="{y}" r="5" fill="#fff" stroke="#0d47a1" stroke-width="2">'
            f"<title>{_t(name)}: min {lo:.3f} s, median {mid:.3f} s, max {hi:.3f} s "
            f"({len(values)} runs)</title>"
            "</circle>"
        )
        body.append(
            f'<text x="{xs[2] + 10:.1f}" y="{y + 4}" class="value">'
            f"median {mid:.2f} s (n={len(values)})</text>"
        )
    return _svg(height, body, "check durations", left)


def log_chart(checkpoints: tuple[CheckpointPoint, ...]) -> str:
    """Tree size of every signed checkpoint over time (a step line)."""
    if not checkpoints:
        return _empty("The log is empty: no checkpoint has been signed yet.")
    points = sorted(checkpoints, key=lambda c: (c.created_at, c.size))
    top, left, right, bottom = 14, 80, CHART_WIDTH - 60, 190
    times = [c.created_at.timestamp() for c in points]
    axis, x_of = _time_axis(min(times), max(times), left, right, bottom)
    peak = max(c.size for c in points) or 1
    body = list(axis)
    body.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" class="axis"/>')
    for i in range(3):
        value = round(peak * i / 2)
        y = bottom - (bottom - top) * value / peak
        body.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end" class="tick">{value}</text>')
    coords: list[str] = []
    previous_y: float | None = None
    for c in points:
        x, y = x_of(c.created_at.timestamp()), bottom - (bottom - top) * c.size / peak
        if previous_y is not None:
            coords.append(f"{x:.1f},{previous_y:.1f}")
        coords.append(f"{x:.1f},{y:.1f}")
        previous_y = y
    body.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="#1565c0" stroke-width="2"/>')
    # Dots for at most 200 checkpoints keep the page light; the line still shows every one.
    step = max(1, len(points) // 200)
    for c in points[::step]:
        x, y = x_of(c.created_at.timestamp()), bottom - (bottom - top) * c.size / peak
        body.append(
            f'<circle class="checkpoint-dot" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#0d47a1">'
            f"<title>size {c.size} at {c.created_at.isoformat()}</title></circle>"
        )
    return _svg(bottom + 30, body, "log size and checkpoint history")


# --------------------------------------------------------------------------- page

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;background:#f5f5f5;
color:#212121}
header{background:#263238;color:#fff;padding:18px 32px}
header h1{margin:0;font-size:24px} header p{margin:4px 0 0;color:#cfd8dc;font-size:13px}
main{padding:16px 32px;max-width:1100px}
section{background:#fff;border-radius:6px;padding:14px 20px;margin:14px 0;box-shadow:0 1px 2px #0002}
h2{font-size:17px;margin:0 0 10px}
.status{padding:14px 20px;border-radius:6px;font-size:16px;color:#fff}
.status.ok{background:#2e7d32} .status.bad{background:#c62828}
.status ul{margin:6px 0 0;font-size:13px}
.stats{display:flex;gap:14px;flex-wrap:wrap}
.stat{background:#eceff1;border-radius:6px;padding:8px 14px;min-width:110px}
.stat b{display:block;font-size:22px}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
.legend i{display:inline-block;width:11px;height:11px;border-radius:6px;margin-right:5px;vertical-align:-1px}
table{border-collapse:collapse;width:100%;font-size:12px}
th,td{text-align:left;padding:4px 6px;border-bottom:1px solid #e0e0e0;vertical-align:top}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
pre{background:#eceff1;padding:8px;border-radius:4px;overflow-x:auto}
.empty{color:#757575;font-style:italic}
svg text{font-size:12px;fill:#37474f} svg .tick{font-size:11px;fill:#78909c}
svg .axis{stroke:#90a4ae} svg .grid{stroke:#eceff1}
.verdict{font-weight:600}
ul.sources{margin:0 0 8px;font-size:13px} .source{font-weight:600} .failed-check{margin:0 0 2px}
"""


def _status_section(status: LogStatus) -> str:
    css = "ok" if status.ok else "bad"
    mark = "\u2714 log verifies" if status.ok else "\u2718 log does NOT verify"
    problems = "".join(f"<li>{_t(p)}</li>" for p in status.problems[:20])
    more = f"<li>and {len(status.problems) - 20} more</li>" if len(status.problems) > 20 else ""
    checkpoint = f"<pre>{_t(status.checkpoint)}</pre>" if status.checkpoint else ""
    return (
        f'<section id="verification"><h2>Verification at report time</h2>'
        f'<div class="status {css}" data-ok="{str(status.ok).lower()}" data-size="{status.size}">'
        f"<b>{mark}</b>: {_t(status.summary)}"
        f"{'<ul>' + problems + more + '</ul>' if problems else ''}</div>"
        f"<p>Latest signed checkpoint:</p>{checkpoint or _empty('none')}</section>"
    )


def _stats(data: ReportData) -> str:
    verdicts = Counter(r.verdict for r in data.receipts)
    items = [
        ("receipts", len(data.receipts)),
        ("qualified", verdicts.get("qualified", 0)),
        ("rejected", verdicts.get("rejected", 0)),
        ("aborted", verdicts.get("aborted", 0)),
        ("subjects", len({r.subject for r in data.receipts})),
        ("hosts", len({r.host for r in data.receipts})),
        ("approvals", len(data.approvals)),
        ("log entries", data.status.size),
    ]
    cells = "".join(
        f'<div class="stat" data-stat="{_t(k)}" data-value="{v}"><b>{v}</b>{_t(k)}</div>' for k, v in items
    )
    return f'<section id="summary"><h2>Summary</h2><div class="stats">{cells}</div></section>'


def _legend(colours: dict[str, str]) -> str:
    return (
        '<p class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{_t(k)}</span>' for k, c in colours.items())
        + "</p>"
    )


def _receipts_table(receipts: tuple[ReceiptPoint, ...], limit: int = 50) -> str:
    if not receipts:
        return _empty("No receipts.")
    rows = []
    for r in sorted(receipts, key=lambda r: r.log_index, reverse=True)[:limit]:
        colour = VERDICT_COLOURS.get(r.verdict, "#616161")
        rows.append(
            f'<tr class="receipt-row" data-subject="{_t(r.subject)}"><td>{r.log_index}</td>'
            f"<td><code>{_t(r.receipt_id[:16])}</code></td>"
            f"<td>{_t(r.subject_name)} <code>{_t(_short(r.subject))}</code></td>"
            f'<td class="verdict" style="color:{colour}">{_t(r.verdict)}</td><td>{_t(r.host)}</td>'
            f"<td>{r.finished_at.strftime('%Y-%m-%d %H:%M:%S')}</td><td>{_failed_cell(r)}</td>"
            f"<td>{'yes' if r.verified else '<b>NO</b>'}</td></tr>"
        )
    more = f"<p>{len(receipts) - limit} older receipts not listed.</p>" if len(receipts) > limit else ""
    return (
        "<table><tr><th>log #</th><th>receipt</th><th>subject</th><th>verdict</th><th>host</th>"
        "<th>finished (UTC)</th><th>failed checks: conditions (source)</th><th>verifies</th></tr>"
        + "".join(rows)
        + "</table>"
        + more
    )


SOURCE_COLOURS = {"observed": "#2e7d32", "derived": "#1565c0", "monitored": "#6a1b9a", "engine": "#ef6c00"}
SOURCE_WORDS = {
    "observed": "measured by the harness (or a process it launched that is not the engine)",
    "derived": "computed by the harness from observed values",
    "monitored": "recorded inside the engine process by the harness's CUDA activity monitor (CUPTI)",
    "engine": "the engine's own report",
}


def _source(source: str) -> str:
    colour = SOURCE_COLOURS.get(source, "#616161")
    return f'<span class="source source-{_t(source)}" style="color:{colour}">{_t(source)}</span>'


def _failed_cell(r: ReceiptPoint) -> str:
    """Each failed check, with its failing conditions and their sources (or its reason)."""
    items = []
    for c in r.checks:
        if c.status not in ("fail", "error"):
            continue
        failing = [
            f"{_t(x.name)} ({_source(x.source)}){': ' + _t(x.detail[:160]) if x.detail else ''}"
            for x in c.conditions
            if not x.holds
        ]
        reason = explain_exit(
            c.reason or c.status, bool(r.faults.get("container OOM") or r.faults.get("CUDA OOM"))
        )
        why = "; ".join(failing) or _t(reason[:160])
        items.append(f'<div class="failed-check"><b>{_t(c.name)}</b>: {why}</div>')
    return "".join(items) or "-"


def conditions_table(receipts: tuple[ReceiptPoint, ...]) -> str:
    """Every check condition seen, with its source and how often it held or failed over all receipts."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    without = 0
    for r in receipts:
        if r.checks and not any(c.conditions for c in r.checks):
            without += 1
        for c in r.checks:
            for x in c.conditions:
                row = rows.setdefault(
                    (c.name, x.name), {"sources": Counter(), "held": 0, "failed": 0, "last": None}
                )
                row["sources"][x.source] += 1
                row["held" if x.holds else "failed"] += 1
                if not x.holds and x.detail:
                    row["last"] = x.detail
    note = (
        f"<p>{without} receipt(s) were written before conditions were recorded: their checks show status "
        "only.</p>"
        if without
        else ""
    )
    if not rows:
        return _empty("No check conditions recorded yet.") + note
    legend = "".join(f"<li>{_source(k)}: {_t(v)}</li>" for k, v in SOURCE_WORDS.items())
    body = []
    for (check, name), row in rows.items():
        sources = ", ".join(_source(k) for k in row["sources"])
        body.append(
            f'<tr class="condition-row" data-check="{_t(check)}" data-condition="{_t(name)}" '
            f'data-source="{_t(",".join(row["sources"]))}" data-failed="{row["failed"]}">'
            f"<td>{_t(check)}</td><td><code>{_t(name)}</code></td><td>{sources}</td>"
            f"<td>{row['held']}</td><td>{row['failed']}</td><td>{_t((row['last'] or '')[:160])}</td></tr>"
        )
    return (
        f'<ul class="sources">{legend}</ul>'
        "<table><tr><th>check</th><th>condition</th><th>source</th><th>held</th><th>failed</th>"
        "<th>last failure</th></tr>" + "".join(body) + "</table>" + note
    )


def _approvals_table(approvals: tuple[ApprovalPoint, ...], limit: int = 50) -> str:
    if not approvals:
        return _empty("No rollout decisions recorded.")
    rows = []
    for a in sorted(approvals, key=lambda a: a.log_index, reverse=True)[:limit]:
        colour = DECISION_COLOURS.get(a.decision, "#616161")
        reason = a.reasons[0] if a.reasons else ""
        rows.append(
            f'<tr class="approval-row" data-subject="{_t(a.subject)}"><td>{a.log_index}</td>'
            f"<td>{_t(a.subject_name)} <code>{_t(_short(a.subject))}</code></td>"
            f'<td class="verdict" style="color:{colour}">{_t(a.decision)}</td>'
            f"<td>{a.created_at.strftime('%Y-%m-%d %H:%M:%S')}</td><td>{_t(reason[:160])}</td></tr>"
        )
    return (
        "<table><tr><th>log #</th><th>subject</th><th>decision</th><th>decided (UTC)</th>"
        "<th>first reason</th></tr>" + "".join(rows) + "</table>"
    )


def render(data: ReportData) -> str:
    """The complete HTML page."""
    sections = [
        _status_section(data.status),
        _stats(data),
        '<section id="history"><h2>Qualification history per subject (times in UTC)</h2>'
        + _legend(VERDICT_COLOURS)
        + history_chart(data.receipts)
        + "</section>",
        '<section id="failures"><h2>Failures by check</h2>'
        + _legend({"failed": "#c62828", "errored": "#8e24aa"})
        + failures_chart(data.receipts)
        + "</section>",
        '<section id="faults"><h2>Restarts, Xid events and OOMs (all receipts)</h2>'
        + faults_chart(data.receipts)
        + "</section>",
        '<section id="durations"><h2>Check durations (min to max, median marked)</h2>'
        + durations_chart(data.receipts)
        + "</section>",
        f'<section id="log"><h2>Log size and checkpoint history ({len(data.checkpoints)} checkpoints)</h2>'
        + log_chart(data.checkpoints)
        + "</section>",
        '<section id="conditions"><h2>Check conditions and where each is known from</h2>'
        + conditions_table(data.receipts)
        + "</section>",
        '<section id="receipts"><h2>Receipts (newest first)</h2>'
        + _receipts_table(data.receipts)
        + "</section>",
        '<section id="approvals"><h2>Rollout decisions</h2>'
        + _approvals_table(data.approvals)
        + "</section>",
    ]
    generated = data.generated_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # Forbid every fetch: the page must stand alone, offline, as an auditor's archived copy.
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>qualify audit report {generated}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>qualify audit report</h1>"
        f"<p>store {_t(data.store)} &middot; generated {generated}</p></header>"
        f"<main>{''.join(sections)}</main></body></html>"
    )


# --------------------------------------------------------------------------- collecting from the store


def _digests(statement: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for subject in statement["subject"]:
        algorithm, value = next(iter(subject["digest"].items()))
        out.append((str(subject.get("name", "")), f"{algorithm}:{value}"))
    return tuple(out)


def _receipt_point(entry: Entry, bad: set[int], decided: frozenset[str] = frozenset()) -> ReceiptPoint:
    """What the log's own bytes say about a receipt; bytes that do not parse still show, as unreadable.
    It is filed under the first of its subjects that a rollout decision names (so that receipts and
    decisions meet under one digest), else under its first subject."""
    rid = hashlib.sha256(entry.envelope).hexdigest()
    try:
        statement = json.loads(dsse.parse(entry.envelope).payload)
        predicate = statement["predicate"]
        subjects = _digests(statement)
        name, digest = next((s for s in subjects if s[1] in decided), subjects[0])
        host = str((predicate.get("host") or {}).get("hostname", "?"))
    except (ReceiptsError, ValueError, KeyError, IndexError, TypeError, AttributeError, StopIteration):
        return ReceiptPoint(
            rid,
            entry.idx,
            "unreadable",
            "unreadable entry",
            "unreadable",
            "?",
            entry.created_at,
            verified=False,
        )
    return ReceiptPoint(
        receipt_id=rid,
        log_index=entry.idx,
        subject=digest,
        subject_name=name,
        verdict=str(predicate.get("verdict")),
        host=host,
        finished_at=parse_time(predicate.get("finished_at")) or entry.created_at,
        checks=checks_of(predicate),
        faults=faults_of(predicate),
        verified=entry.idx not in bad,
        subjects=subjects,
    )


def verify_status(
    store: Store, checkpoint_text: str | None = None, verifiers: list[NoteVerifier] | None = None
) -> tuple[LogStatus, set[int]]:
    """Verify the whole log now; the status and the indices of entries found bad."""
    try:
        report = verify_log(store, checkpoint_text=checkpoint_text, verifiers=verifiers)
    except TamperError as error:
        report = getattr(error, "report", None)
        if report is None:
            return LogStatus(ok=False, size=store.size(), summary=str(error)), set()
    except ReceiptsError as error:  # e.g. an external checkpoint that does not parse
        return LogStatus(ok=False, size=store.size(), summary=str(error)), set()
    try:
        note: str | None = store.latest_checkpoint()
    except NotFound:
        note = None
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.kinds.items())) or "no entries"
    if report.ok:
        external = (
            ""
            if report.external is None
            else f"; consistent with the external checkpoint of size {report.external.size}"
        )
        summary = (
            f"{report.size} entries ({kinds}), {report.checkpoints} checkpoints and every signature "
            f"verified in {report.seconds:.2f} s; root {report.root.hex()[:16]}{external}"
        )
    else:
        summary = f"{len(report.problems)} problem(s) in {report.size} entries ({kinds})"
    bad = {p.idx for p in report.problems if p.idx is not None}
    return LogStatus(report.ok, report.size, summary, tuple(str(p) for p in report.problems), note), bad


def collect(
    store: Store,
    *,
    checkpoint_text: str | None = None,
    verifiers: list[NoteVerifier] | None = None,
    now: datetime | None = None,
) -> ReportData:
    """Everything the report shows, read from the log's entries (not the query tables) and verified."""
    status, bad = verify_status(store, checkpoint_text, verifiers)
    decisions = list(store.list_approvals())
    decided = frozenset(a.subject for a in decisions)
    receipts: list[ReceiptPoint] = []
    entry_times: dict[int, datetime] = {}
    for entry in store.iter_entries():
        entry_times[entry.idx] = entry.created_at
        if entry.kind == "receipt":
            receipts.append(_receipt_point(entry, bad, decided))
    names = {digest: name for r in receipts for name, digest in r.subjects}
    # A checkpoint of size n is signed in the transaction that appends entry n-1, at that entry's time.
    checkpoints = tuple(
        CheckpointPoint(size, entry_times[size - 1])
        for size, _, _ in store.iter_checkpoints()
        if size - 1 in entry_times
    )
    approvals = tuple(
        ApprovalPoint(
            a.id, a.log_idx, a.subject, a.decision, a.created_at, tuple(a.reasons), names.get(a.subject, "")
        )
        for a in decisions
    )
    return ReportData(
        generated_at=now or datetime.now(UTC),
        store=store.url,
        receipts=tuple(receipts),
        checkpoints=checkpoints,
        approvals=approvals,
        status=status,
    )
