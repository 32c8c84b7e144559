"""The audit report, opened in headless Chromium: it renders with zero, one and many receipts, shows what
the store holds, needs no network, and says so when the log does not verify."""

from __future__ import annotations

import os
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import pytest

from qualify.cli import main
from qualify.report import collect, render
from receipts.store import Store

from .approve_predicates import MONITORED, OBSERVED
from .conftest import OTHER_SUBJECT, SUBJECT, Log

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if IN_CI:
        pytest.fail("chromium is not installed (CI requires it: apt-get install -y chromium)")
    pytest.skip("chromium is not installed: apt-get install -y chromium")


class Dom(HTMLParser):
    """Elements of the rendered DOM as (tag, attributes) with the text inside each section."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def classed(self, tag: str, css: str) -> list[dict[str, str]]:
        """Elements of `tag` whose class list holds `css`."""
        return [a for t, a in self.elements if t == tag and css in a.get("class", "").split()]

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def rendered(tmp_path: Path, html: str, name: str = "report") -> Dom:
    """Load the page in Chromium and return the DOM it rendered."""
    page = tmp_path / f"{name}.html"
    page.write_text(html)
    result = subprocess.run(
        [
            chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "</html>" in result.stdout
    return Dom(result.stdout)


def stat(dom: Dom, name: str) -> int:
    """The number shown in the summary's `name` box."""
    (value,) = [a["data-value"] for a in dom.classed("div", "stat") if a.get("data-stat") == name]
    return int(value)


def test_report_renders_with_zero_receipts(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        dom = rendered(tmp_path, render(collect(store)))
    finally:
        store.close()
    status = dom.classed("div", "status")
    assert status and status[0]["data-ok"] == "true" and status[0]["data-size"] == "0"
    assert dom.classed("circle", "receipt-dot") == []
    assert "No receipts yet" in dom.all_text and "The log is empty" in dom.all_text
    assert stat(dom, "receipts") == 0


def test_report_renders_with_one_receipt(log: Log, tmp_path: Path) -> None:
    rid = log.add(host="gpu-7")
    dom = rendered(tmp_path, render(collect(log.store)))
    dots = dom.classed("circle", "receipt-dot")
    assert [d["data-receipt"] for d in dots] == [rid]
    assert "verdict-qualified" in dots[0]["class"]
    assert dom.classed("div", "status")[0]["data-ok"] == "true"
    assert stat(dom, "receipts") == 1 and stat(dom, "hosts") == 1
    assert len(dom.classed("line", "duration-range")) == len(OBSERVED) + len(MONITORED)  # one per check
    assert len(dom.classed("circle", "checkpoint-dot")) == 2  # key trust, then the receipt
    assert "gpu-7" in dom.all_text


def test_report_renders_many_receipts_with_their_history_failures_and_faults(
    log: Log, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    verdicts = {"qualified": 0, "rejected": 0, "aborted": 0}
    for i in range(24):
        verdict = ("qualified", "rejected", "aborted")[i % 3] if i % 2 else "qualified"
        verdicts[verdict] += 1
        failed = {"rejected": "layout", "aborted": "boot"}.get(verdict)
        log.add(
            subject=SUBJECT if i % 2 else OTHER_SUBJECT,
            host=f"gpu-{i % 4}",
            verdict=verdict,
            failed_check=failed,
            restarts=1 if verdict == "aborted" else 0,
            xids=[(79, True)] if verdict == "rejected" else [(13, False)],
            finished=now - timedelta(hours=24 - i),
        )
    log.store.revoke_key(log.key.keyid, "rotated")  # a key entry after the receipts: still verifies
    dom = rendered(tmp_path, render(collect(log.store)))
    for verdict, count in verdicts.items():
        assert len(dom.classed("circle", f"verdict-{verdict}")) == count
    assert stat(dom, "receipts") == 24 and stat(dom, "subjects") == 2 and stat(dom, "hosts") == 4
    failed_bars = {a["data-name"]: int(a["data-value"]) for a in dom.classed("rect", "failed")}
    assert failed_bars == {"layout (24 runs)": verdicts["rejected"], "boot (24 runs)": verdicts["aborted"]}
    faults = {a["data-name"]: int(a["data-value"]) for a in dom.classed("rect", "fault")}
    assert faults["restarts"] == verdicts["aborted"]
    assert faults["fatal Xid"] == verdicts["rejected"]
    assert faults["non-fatal Xid"] == 24 - verdicts["rejected"]
    assert dom.classed("div", "status")[0]["data-ok"] == "true"
    assert len(dom.classed("tr", "receipt-row")) == 24


def test_report_says_the_log_does_not_verify_and_marks_the_tampered_receipt(log: Log, tmp_path: Path) -> None:
    log.add(host="gpu-1")
    bad = log.add(host="gpu-2")
    entry = log.store.entry(2)
    sig = entry.envelope.split(b'"sig":"')[1][:8]
    edited = entry.envelope.replace(sig, b"AAAAAAAA" if sig != b"AAAAAAAA" else b"BBBBBBBB")
    log.raw("UPDATE log_entries SET envelope = ? WHERE idx = 2", edited)
    dom = rendered(tmp_path, render(collect(log.store)))
    status = dom.classed("div", "status")[0]
    assert status["data-ok"] == "false"
    assert "log does NOT verify" in dom.all_text and "index 2" in dom.all_text
    dashed = [d["data-receipt"] for d in dom.classed("circle", "receipt-dot") if "stroke-dasharray" in d]
    assert len(dashed) == 1 and dashed[0] != bad  # the edited entry (its id is now another hash) is dashed


def test_report_needs_no_network(log: Log) -> None:
    log.add()
    html = render(collect(log.store))
    assert "<script" not in html and "<link" not in html and "src=" not in html and "@import" not in html
    assert {
        u for u in ("http://", "https://") if u in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    } == set()
    assert "default-src 'none'" in html


def test_audit_report_command_writes_the_page_and_exits_1_when_tampered(
    log: Log, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log.add()
    out = tmp_path / "report.html"
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "report", "--out", str(out), "--db", log.url, "--json"])
    assert exit_.value.code == 0
    assert '"log_verifies": true' in capsys.readouterr().out
    assert out.read_text().startswith("<!DOCTYPE html>")
    exported = tmp_path / "checkpoint.txt"
    exported.write_text(log.store.latest_checkpoint())  # an auditor's copy, kept outside the database
    log.raw("DELETE FROM log_entries WHERE idx = 1")  # the newest entry: the stored tree still looks whole
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "report", "--out", str(out), "--db", log.url, "--checkpoint", str(exported)])
    assert exit_.value.code == 1
    assert "LOG DOES NOT VERIFY" in capsys.readouterr().out
    assert 'data-ok="false"' in out.read_text()


def test_an_entry_whose_bytes_no_longer_parse_still_shows_as_unreadable(log: Log) -> None:
    log.add()
    log.raw("UPDATE log_entries SET envelope = ? WHERE idx = 1", b"{not json")
    data = collect(log.store)
    assert data.status.ok is False
    (point,) = data.receipts
    assert (point.verdict, point.verified) == ("unreadable", False)
    assert 'class="receipt-dot verdict-unreadable"' in render(data)


def test_receipts_and_decisions_are_shown_under_the_same_subject(log: Log, tmp_path: Path) -> None:
    """A decision about the engine config (not the receipt's first subject) meets its receipts under that
    config digest, named as the receipts name it, in both tables (issue 25)."""
    from receipts.statement import config_digest
    from tests.store.approvals import approval_envelope

    from .approve_predicates import CONFIG

    rid = log.add(host="gpu-1")
    other = log.add(subject=OTHER_SUBJECT, host="gpu-2")  # another image, the same config
    config = config_digest(CONFIG)
    # Before any decision, each receipt is filed under its first subject (the image).
    assert {r.subject for r in collect(log.store).receipts} == {SUBJECT, OTHER_SUBJECT}
    log.store.append_approval(approval_envelope(log.key, subject=config, receipt_ids=[rid], reasons=["ok"]))
    data = collect(log.store)
    shown = {r.receipt_id: (r.subject_name, r.subject) for r in data.receipts}
    assert shown[rid] == ("engine-config", config)
    assert shown[other] == ("engine-config", config)
    (decision,) = data.approvals
    assert (decision.subject, decision.subject_name) == (config, "engine-config")
    dom = rendered(tmp_path, render(data))
    receipt_rows = {a["data-subject"] for a in dom.classed("tr", "receipt-row")}
    (approval_row,) = dom.classed("tr", "approval-row")
    assert approval_row["data-subject"] == config and config in receipt_rows


def test_the_templates_escape_what_the_store_holds(log: Log) -> None:
    """Subject names, hosts and condition details come from signed but operator-written receipts: the
    jinja2 templates autoescape them, so no markup from a receipt reaches the page."""
    hostile = '<script>alert(1)</script>"><img src=x>'
    log.add(host=hostile, failed_check="layout", verdict="rejected")
    html = render(collect(log.store))
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
