"""The audit report: `collect` reads and verifies the store; `render` fills the jinja2 templates in
qualify/templates/report/ into one self-contained HTML page (inline CSS and SVG, no script, no network):
history, failures, faults, timings, log growth, verification. Python computes what is shown and every
chart coordinate; the templates only lay it out (autoescaped)."""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import markupsafe

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


# --------------------------------------------------------------------------- chart geometry

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


def _short(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"{algo}:{hexpart[:12]}" if hexpart else digest[:19]


def _px(value: float) -> str:
    return f"{value:.1f}"


def _time_axis(lo: float, hi: float, x0: int, x1: int, y: int) -> tuple[dict[str, Any], Any]:
    """Tick marks for a time axis and the x(t) mapping; a single instant is centred."""
    span = hi - lo

    def x_of(ts: float) -> float:
        return (x0 + x1) / 2 if span <= 0 else x0 + (ts - lo) / span * (x1 - x0)

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
    marks = []
    for i in range(ticks):
        ts = lo if ticks == 1 else lo + span * i / (ticks - 1)
        label = datetime.fromtimestamp(ts, UTC).strftime(fmt)
        marks.append({"x": _px(x_of(ts)), "label": label[:-3] if fmt.endswith("%f") else label})
    return {"x0": x0, "x1": x1, "y": y, "ticks": marks}, x_of


def _chart(label: str, height: int, left: int = 0, **rest: Any) -> dict[str, Any]:
    return {"label": label, "width": CHART_WIDTH, "height": height, "left": left, "empty": None, **rest}


def _empty_chart(message: str) -> dict[str, Any]:
    return {"empty": message}


def history_chart(receipts: tuple[ReceiptPoint, ...]) -> dict[str, Any]:
    """One row per subject (its name over its short digest); one dot per receipt at its finish time,
    coloured by verdict."""
    if not receipts:
        return _empty_chart("No receipts yet: run `qualify run` to qualify a build.")
    by_subject: dict[str, list[ReceiptPoint]] = defaultdict(list)
    for r in receipts:
        by_subject[r.subject].append(r)
    subjects = sorted(by_subject, key=lambda s: min(r.finished_at for r in by_subject[s]))
    names = {s: _fit(by_subject[s][0].subject_name) for s in subjects}
    row, top, right = 38, 16, CHART_WIDTH - 60
    left = _margin([*names.values(), *(_short(s) for s in subjects)])
    times = [r.finished_at.timestamp() for r in receipts]
    axis, x_of = _time_axis(min(times), max(times), left, right, top + row * len(subjects) + 4)
    rows = []
    for i, subject in enumerate(subjects):
        dots = [
            {
                "verdict": r.verdict,
                "receipt_id": r.receipt_id,
                "x": _px(x_of(r.finished_at.timestamp())),
                "colour": VERDICT_COLOURS.get(r.verdict, "#616161"),
                "verified": r.verified,
                "host": r.host,
                "finished": r.finished_at.isoformat(),
                "log_index": r.log_index,
            }
            for r in sorted(by_subject[subject], key=lambda r: r.log_index)
        ]
        rows.append(
            {
                "y": top + row * i + row / 2,
                "name": by_subject[subject][0].subject_name,
                "subject": subject,
                "fitted": names[subject],
                "short": _short(subject),
                "dots": dots,
            }
        )
    height = top + row * len(subjects) + 40
    return _chart("qualification history per subject", height, left, right=right, axis=axis, rows=rows)


def _bars(rows: list[tuple[str, list[tuple[int | float, str, str]]]], label: str, unit: str = "") -> dict:
    """Horizontal stacked bars: rows of (label, [(value, colour, css class)])."""
    row, top, right = 28, 10, CHART_WIDTH - 90
    left = _margin([_fit(name) for name, _ in rows])
    peak = max((sum(v for v, _, _ in parts) for _, parts in rows), default=0) or 1
    out = []
    for i, (name, parts) in enumerate(rows):
        x = float(left)
        drawn = []
        for value, colour, css in parts:
            width = (right - left) * value / peak
            if width > 0:
                drawn.append({"value": value, "colour": colour, "css": css, "x": _px(x), "width": _px(width)})
            x += width
        total = sum(v for v, _, _ in parts)
        shown = f"{total:.2f}{unit}" if isinstance(total, float) else f"{total}{unit}"
        out.append(
            {
                "y": top + row * i,
                "name": name,
                "fitted": _fit(name),
                "parts": drawn,
                "total": shown,
                "total_x": _px(x + 6),
            }  # fmt: skip
        )
    height = top + row * len(rows) + 10
    return _chart(label, height, left, rows=out, unit=unit, bar_height=row - 10)


def failures_chart(receipts: tuple[ReceiptPoint, ...]) -> dict[str, Any]:
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
        return _empty_chart("No checks recorded yet.")
    rows = [
        (
            f"{name} ({ran[name]} runs)",
            [(failed[name], "#c62828", "failed"), (errored[name], "#8e24aa", "errored")],
        )
        for name in sorted(ran, key=lambda n: (-(failed[n] + errored[n]), n))
    ]
    return _bars(rows, "failures by check")


def faults_chart(receipts: tuple[ReceiptPoint, ...]) -> dict[str, Any]:
    """Totals of restarts, Xid events, OOMs and dead engines over all receipts."""
    if not receipts:
        return _empty_chart("No faults to count: there are no receipts.")
    totals = {kind: sum(r.faults.get(kind, 0) for r in receipts) for kind in FAULT_KINDS}
    colours = {"restarts": "#1565c0", "fatal Xid": "#c62828", "non-fatal Xid": "#f9a825"}
    rows = [(kind, [(totals[kind], colours.get(kind, "#6d4c41"), "fault")]) for kind in FAULT_KINDS]
    return _bars(rows, "restart, Xid and OOM counts")


def durations_chart(receipts: tuple[ReceiptPoint, ...]) -> dict[str, Any]:
    """Per check: the range of wall times (min to max) with the median marked."""
    seconds: dict[str, list[float]] = defaultdict(list)
    for r in receipts:
        for c in r.checks:
            seconds[c.name].append(c.seconds)
    if not seconds:
        return _empty_chart("No check timings recorded yet.")
    names = sorted(seconds)
    row, top, right = 28, 10, CHART_WIDTH - 150
    left = _margin([_fit(name) for name in names])
    peak = max(max(v) for v in seconds.values()) or 1.0
    ticks = [{"x": _px(left + (right - left) * i / 4), "label": f"{peak * i / 4:.2f} s"} for i in range(5)]
    rows = []
    for i, name in enumerate(names):
        values = sorted(seconds[name])
        lo, mid, hi = values[0], statistics.median(values), values[-1]
        xs = [left + (right - left) * v / peak for v in (lo, mid, hi)]
        rows.append(
            {
                "y": top + row * i + row / 2,
                "name": name,
                "fitted": _fit(name),
                "x_lo": _px(xs[0]),
                "x_mid": _px(xs[1]),
                "x_hi": _px(xs[2]),
                "x_value": _px(xs[2] + 10),
                "lo": f"{lo:.3f}",
                "mid": f"{mid:.3f}",
                "hi": f"{hi:.3f}",
                "mid_short": f"{mid:.2f}",
                "n": len(values),
            }
        )
    height = top + row * len(names) + 34
    return _chart(
        "check durations", height, left, right=right, axis_y=top + row * len(names), ticks=ticks, rows=rows
    )


def log_chart(checkpoints: tuple[CheckpointPoint, ...]) -> dict[str, Any]:
    """Tree size of every signed checkpoint over time (a step line)."""
    if not checkpoints:
        return _empty_chart("The log is empty: no checkpoint has been signed yet.")
    points = sorted(checkpoints, key=lambda c: (c.created_at, c.size))
    top, left, right, bottom = 14, 80, CHART_WIDTH - 60, 190
    times = [c.created_at.timestamp() for c in points]
    axis, x_of = _time_axis(min(times), max(times), left, right, bottom)
    peak = max(c.size for c in points) or 1
    ticks = []
    for i in range(3):
        value = round(peak * i / 2)
        ticks.append({"y": _px(bottom - (bottom - top) * value / peak + 4), "label": value})
    coords: list[str] = []
    previous_y: float | None = None
    for c in points:
        x, y = x_of(c.created_at.timestamp()), bottom - (bottom - top) * c.size / peak
        if previous_y is not None:
            coords.append(f"{x:.1f},{previous_y:.1f}")
        coords.append(f"{x:.1f},{y:.1f}")
        previous_y = y
    # Dots for at most 200 checkpoints keep the page light; the line still shows every one.
    step = max(1, len(points) // 200)
    dots = [
        {
            "x": _px(x_of(c.created_at.timestamp())),
            "y": _px(bottom - (bottom - top) * c.size / peak),
            "size": c.size,
            "at": c.created_at.isoformat(),
        }
        for c in points[::step]
    ]
    return _chart(
        "log size and checkpoint history",
        bottom + 30,
        0,
        axis=axis,
        top=top,
        bottom=bottom,
        axis_left=left,
        ticks=ticks,
        points=" ".join(coords),
        dots=dots,
    )


# --------------------------------------------------------------------------- page

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
SOURCE_COLOURS = {"observed": "#2e7d32", "derived": "#1565c0", "monitored": "#6a1b9a", "engine": "#ef6c00"}
SOURCE_WORDS = {
    "observed": "measured by the harness (or a process it launched that is not the engine)",
    "derived": "computed by the harness from observed values",
    "monitored": "recorded inside the engine process by the harness's CUDA activity monitor (CUPTI)",
    "engine": "the engine's own report",
}
TEMPLATES = Path(__file__).parent / "templates" / "report"


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,  # every value from the store is escaped (subject names, details, hosts)
        undefined=jinja2.StrictUndefined,  # a missing field is a bug, never an empty cell
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
    )


def _failed(r: ReceiptPoint) -> list[dict[str, Any]]:
    """Each failed check, with its failing conditions and their sources (or its reason)."""
    oom = bool(r.faults.get("container OOM") or r.faults.get("CUDA OOM"))
    out = []
    for c in r.checks:
        if c.status not in ("fail", "error"):
            continue
        failing = [
            {"name": x.name, "source": x.source, "detail": x.detail[:160] if x.detail else None}
            for x in c.conditions
            if not x.holds
        ]
        out.append(
            {"check": c.name, "conditions": failing, "reason": explain_exit(c.reason or c.status, oom)[:160]}
        )
    return out


def _receipt_rows(receipts: tuple[ReceiptPoint, ...], limit: int = 50) -> dict[str, Any]:
    newest = sorted(receipts, key=lambda r: r.log_index, reverse=True)[:limit]
    rows = [
        {
            "log_index": r.log_index,
            "receipt_id": r.receipt_id,
            "subject": r.subject,
            "subject_name": r.subject_name,
            "short": _short(r.subject),
            "colour": VERDICT_COLOURS.get(r.verdict, "#616161"),
            "verdict": r.verdict,
            "host": r.host,
            "finished": r.finished_at.strftime("%Y-%m-%d %H:%M:%S"),
            "failed": _failed(r),
            "verified": r.verified,
        }
        for r in newest
    ]
    return {"rows": rows, "older": max(0, len(receipts) - limit)}


def conditions_rows(receipts: tuple[ReceiptPoint, ...]) -> dict[str, Any]:
    """Every check condition seen, with its sources and how often it held or failed over all receipts."""
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
    out = [
        {
            "check": check,
            "name": name,
            "sources": list(row["sources"]),
            "held": row["held"],
            "failed": row["failed"],
            "last": (row["last"] or "")[:160],
        }  # fmt: skip
        for (check, name), row in rows.items()
    ]
    return {"rows": out, "without": without}


def _approval_rows(approvals: tuple[ApprovalPoint, ...], limit: int = 50) -> list[dict[str, Any]]:
    return [
        {
            "log_index": a.log_index,
            "subject": a.subject,
            "subject_name": a.subject_name,
            "short": _short(a.subject),
            "colour": DECISION_COLOURS.get(a.decision, "#616161"),
            "decision": a.decision,
            "decided": a.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "reason": (a.reasons[0] if a.reasons else "")[:160],
        }
        for a in sorted(approvals, key=lambda a: a.log_index, reverse=True)[:limit]
    ]


def _stats(data: ReportData) -> list[tuple[str, int]]:
    verdicts = Counter(r.verdict for r in data.receipts)
    return [
        ("receipts", len(data.receipts)),
        ("qualified", verdicts.get("qualified", 0)),
        ("rejected", verdicts.get("rejected", 0)),
        ("aborted", verdicts.get("aborted", 0)),
        ("subjects", len({r.subject for r in data.receipts})),
        ("hosts", len({r.host for r in data.receipts})),
        ("approvals", len(data.approvals)),
        ("log entries", data.status.size),
    ]


def page_context(data: ReportData) -> dict[str, Any]:
    """Everything templates/report/page.html.j2 shows, computed from the collected data."""
    return {
        "csp": markupsafe.Markup(_CSP),  # a constant with quotes the policy needs, not data
        "generated": data.generated_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "store": data.store,
        "status": data.status,
        "stats": _stats(data),
        "verdict_colours": VERDICT_COLOURS,
        "failure_colours": {"failed": "#c62828", "errored": "#8e24aa"},
        "source_colours": SOURCE_COLOURS,
        "source_words": SOURCE_WORDS,
        "history": history_chart(data.receipts),
        "failures": failures_chart(data.receipts),
        "faults": faults_chart(data.receipts),
        "durations": durations_chart(data.receipts),
        "log": log_chart(data.checkpoints),
        "checkpoint_count": len(data.checkpoints),
        "conditions": conditions_rows(data.receipts),
        "receipts": _receipt_rows(data.receipts),
        "approvals": _approval_rows(data.approvals),
    }


def render(data: ReportData) -> str:
    """The complete HTML page, from the jinja2 templates in qualify/templates/report/."""
    return _environment().get_template("page.html.j2").render(page_context(data))


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
