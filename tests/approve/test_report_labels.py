"""The audit report as Chromium lays it out: no chart label runs off the left edge of its chart, however
long the subject name; and where the report lists checks it names each failing condition's source."""

from __future__ import annotations

import re
from pathlib import Path

from qualify.report import collect, render
from receipts import dsse
from receipts.canonical import canonical_json

from .approve_predicates import predicate
from .conftest import SUBJECT, Log, statement
from .test_report import Dom, rendered

LONG_NAME = "qualify-reference-engine-weights-for-the-proxy-preset"
# Test only: the page forbids scripts (CSP); this copy measures each label's box where Chromium drew it.
MEASURE = """<script>
for (const svg of document.querySelectorAll('svg')) {
  for (const t of svg.querySelectorAll('text.label')) {
    const b = t.getBBox();
    t.setAttribute('data-x', b.x.toFixed(1));
    t.setAttribute('data-right', (b.x + b.width).toFixed(1));
    t.setAttribute('data-chart-left', svg.dataset.left);
  }
}
</script>"""


def measured(tmp_path: Path, html: str) -> Dom:
    """The page with the measuring script in place of its CSP, as Chromium rendered it."""
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    return rendered(tmp_path, page.replace("</body>", MEASURE + "</body>"), name="measured")


def _add_named(log: Log, name: str, subject: str = SUBJECT, **kwargs) -> str:
    body = statement(subject, predicate(**kwargs))
    body["subject"][0]["name"] = name
    envelope = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(body), log.key)
    return log.store.append_receipt(envelope).id


def test_no_chart_label_is_clipped_at_the_left(log: Log, tmp_path: Path) -> None:
    _add_named(log, LONG_NAME, failed_check="layout", verdict="rejected")
    _add_named(log, "engine-image", subject="sha256:" + "cd" * 32)
    dom = measured(tmp_path, render(collect(log.store)))
    labels = [a for t, a in dom.elements if t == "text" and "label" in a.get("class", "").split()]
    assert len(labels) >= 2 + 4 + 6  # history (one per subject), failures, faults, durations
    for label in labels:
        assert float(label["data-x"]) >= 0, label
        assert float(label["data-right"]) <= float(label["data-chart-left"]), label
    subject_labels = [a for a in labels if "subject-label" in a["class"].split()]
    assert len(subject_labels) == 2


def test_failed_checks_name_the_condition_and_its_source(log: Log, tmp_path: Path) -> None:
    pred = predicate(verdict="rejected", spans=[2304, 2304, 9216], failed_check="layout")
    for check in pred["checks"]:
        if check["name"] == "layout":
            check["conditions"] = {
                "chunk_is_lcm": {"holds": True, "source": "derived", "detail": "chunk 9216, lcm 9216"},
                "spans_equal_request": {
                    "holds": False,
                    "source": "engine",
                    "detail": "registered [2304, 2304, 9216] != requested [2304, 2304, 2304, 9216]",
                },
            }
        if check["name"] == "boot":
            check["conditions"] = {
                "ready_within_timeout": {"holds": True, "source": "observed", "detail": None}
            }
    envelope = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement(SUBJECT, pred)), log.key)
    log.store.append_receipt(envelope)
    old = predicate()  # a receipt from before conditions were recorded
    for check in old["checks"]:
        check["conditions"] = {}
    log.store.append_receipt(
        dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement(SUBJECT, old)), log.key)
    )
    dom = rendered(tmp_path, render(collect(log.store)))
    rows = {(a["data-check"], a["data-condition"]): a for a in dom.classed("tr", "condition-row")}
    assert rows[("layout", "spans_equal_request")]["data-source"] == "engine"
    assert rows[("layout", "spans_equal_request")]["data-failed"] == "1"
    assert rows[("layout", "chunk_is_lcm")]["data-source"] == "derived"
    assert rows[("boot", "ready_within_timeout")]["data-source"] == "observed"
    text = dom.all_text
    assert "layout : spans_equal_request ( engine ): registered [2304, 2304, 9216] != requested" in text
    assert "1 receipt(s) were written before conditions were recorded" in text
