"""`receipts show` puts what an auditor looks for first (layout, backend and its kernels, capture,
coherence, restarts, Xid, OOM, a dead engine), then every check's conditions with their sources; `receipts
list` is newest first, filtered in SQL, and says how many of how many it shows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from receipts.store import Store
from receipts.testing import synthetic_envelope

from .shown_predicates import REQUESTED, SHORT, gpu_run


def _append(store, key, n: int, **kwargs) -> str:
    return store.append_receipt(synthetic_envelope(key, n, **kwargs)).id


def _one_line_error(result) -> str:
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.err
    return lines[0]


@pytest.fixture
def sqlite_store(sqlite_url, log_signer, operator):
    store = Store.open(sqlite_url, log_signer=log_signer)
    store.trust_key(operator.public_key(), "test operator")
    yield store
    store.close()


def _show(cli, url: str, *args: str):
    result = cli("receipts", "show", *args, "--db", url)
    assert result.code == 0, result.err
    return result.out.splitlines()


def test_show_starts_with_the_facts_then_each_condition_and_its_source(
    cli, sqlite_store, sqlite_url, operator
) -> None:
    rid = _append(sqlite_store, operator, 1, overrides=gpu_run())
    lines = _show(cli, sqlite_url, rid[:8])
    assert lines[0].split() == ["receipt", rid, "qualified", "log_index", "1"]
    summary = lines[1]
    for fact in (
        "qualified (gpu target)",
        "registered the exact layout [2304, 2304, 2304, 9216] across 4 CUDA-IPC allocations",
        "KDA backend triton (requested auto) proven by kernels kda_decode",
        "FULL capture of sizes [8, 4, 2, 1]",
        "replay vs eager coherent (identical)",
        "post-reload generation coherent (near tie at prompt 1 token 7)",
        "restart count 0",
        "no Xid/OOM/EngineDead",
    ):
        assert fact in summary, (fact, summary)
    text = "\n".join(lines)
    facts = text.index("  backend ")
    checks = text.index("  layout     pass")
    assert facts < checks < text.index("subject ") < text.index("signed by key")
    assert re.search(r"✓ spans_equal_request\s+engine$", text, re.M)
    assert re.search(r"✓ chunk_is_lcm\s+derived\s+chunk 9216, lcm 9216$", text, re.M)
    assert re.search(r"✓ ready_within_timeout\s+observed\s+ready after 3.1 s$", text, re.M)
    # The harness's CUDA activity monitor: its own source, and a fact row.
    assert re.search(r"✓ reload_same_graphs_replayed\s+monitored\s+the graphs captured before$", text, re.M)
    assert "2 of 2 monitored conditions hold" in text and "monitored = recorded inside the engine" in text


def test_show_says_what_differed_when_a_check_failed(cli, sqlite_store, sqlite_url, operator) -> None:
    rid = _append(sqlite_store, operator, 2, overrides=gpu_run(registered=SHORT))
    lines = _show(cli, sqlite_url, rid)
    assert "rejected  log_index 1" in lines[0]
    assert "layout: registered [2304, 2304, 9216] ≠ requested [2304, 2304, 2304, 9216]" in lines[1]
    assert lines[1].count("≠") == 1  # said once, among the failures
    text = "\n".join(lines)
    assert re.search(
        rf"✗ spans_equal_request\s+engine\s+registered {re.escape(str(SHORT))} != requested "
        rf"{re.escape(str(REQUESTED))}$",
        text,
        re.M,
    )


def test_an_oom_says_oom_not_exit_code_137(cli, sqlite_store, sqlite_url, operator) -> None:
    rid = _append(sqlite_store, operator, 3, overrides=gpu_run(oom=True))
    lines = _show(cli, sqlite_url, rid)
    assert "OOM: the container was killed for memory" in lines[1]
    assert "boot: the engine container was killed for memory (OOM, exit code 137)" in lines[1]
    assert "exited with code 137" not in "\n".join(lines)
    assert any(re.match(r"\s+OOM\s+OOM: the container was killed for memory", line) for line in lines)


def test_a_receipt_from_before_conditions_still_shows(cli, sqlite_store, sqlite_url, operator) -> None:
    rid = _append(sqlite_store, operator, 4)  # no layout, backend or conditions: an older receipt's shape
    text = "\n".join(_show(cli, sqlite_url, rid))
    assert "no layout registered" in text and "KDA backend not resolved" in text
    assert "no conditions recorded" in text


def test_show_by_log_index_and_its_bad_input(cli, sqlite_store, sqlite_url, operator) -> None:
    rid = _append(sqlite_store, operator, 5)
    assert rid in _show(cli, sqlite_url, "--log-index", "1")[0]
    url = sqlite_url
    assert "key-trust entry, not a receipt" in _one_line_error(
        cli("receipts", "show", "--log-index", "0", "--db", url)
    )
    assert "no log entry at index 9" in _one_line_error(
        cli("receipts", "show", "--log-index", "9", "--db", url)
    )
    assert "ID or --log-index" in _one_line_error(
        cli("receipts", "show", rid, "--log-index", "1", "--db", url)
    )


def test_list_is_newest_first_filtered_in_sql_and_counts_what_it_hides(cli, store, db_url, operator) -> None:
    recent = datetime.now(UTC) - timedelta(hours=1)
    ids = [
        _append(store, operator, 0, hostname="gpu-a"),
        _append(store, operator, 1, hostname="gpu-b", verdict="rejected"),
        _append(store, operator, 2, hostname="gpu-a", verdict="aborted"),
        _append(store, operator, 3, hostname="gpu-b", started_at=recent),
        _append(store, operator, 4, hostname="gpu-a", started_at=recent),
    ]

    def listed(*args: str) -> dict:
        result = cli("receipts", "list", *args, "--db", db_url, "--json")
        assert result.code == 0, result.err
        return json.loads(result.out)

    page = listed()
    assert [r["id"] for r in page["items"]] == ids[::-1] and page["total"] == 5
    page = listed("--limit", "2")
    assert [r["id"] for r in page["items"]] == [ids[4], ids[3]] and page["total"] == 5
    assert [r["id"] for r in listed("--limit", "2", "--offset", "2")["items"]] == [ids[2], ids[1]]
    assert [r["id"] for r in listed("--host", "gpu-a")["items"]] == [ids[4], ids[2], ids[0]]
    assert [r["id"] for r in listed("--verdict", "rejected")["items"]] == [ids[1]]
    assert [r["id"] for r in listed("--since", "7d")["items"]] == [ids[4], ids[3]]
    assert [r["id"] for r in listed("--since", "2025-01-01T00:02:00Z")["items"]] == ids[:1:-1]
    subject = listed()["items"][2]["subjects"][0]["digest"]
    assert listed("--subject", subject, "--host", "gpu-a")["items"][0]["id"] == ids[2]
    assert listed("--host", "gpu-b", "--verdict", "qualified")["total"] == 1
    human = cli("receipts", "list", "--limit", "2", "--db", db_url).out
    assert "showing 2 of 5 (newest first); more with --limit / --offset" in human
    assert human.index(ids[4][:16]) < human.index(ids[3][:16])
    assert "2025-01-01T00:00:30Z" not in human  # the oldest is not on the first page of two
    assert "2025-01-01T00:00:30Z" in cli("receipts", "list", "--db", db_url).out  # RFC 3339, UTC


def test_coherence_reads_summary_outcome_or_identical_and_tolerates_none() -> None:
    from qualify.receipt_view import coherence, summary_line

    def with_comparisons(comparisons) -> dict:
        return {"checks": [{"name": "generation", "evidence": {"comparisons": comparisons}}]}

    found = coherence(
        with_comparisons(
            {
                "replay_vs_eager": {"agrees": True, "outcome": "near_tie"},
                "before_vs_after_reload": {"agrees": False, "identical": False},
                "speculative_vs_plain": {"agrees": True},
            }
        )
    )
    assert found == [
        ("replay vs eager", "coherent (near_tie)"),
        ("post-reload generation", "NOT coherent (not identical)"),
        ("speculative vs plain", "coherent"),
    ]
    assert coherence({}) == [] and coherence(with_comparisons("not a dict")) == []
    assert "generation not compared" in summary_line({"verdict": "aborted", "target": "cpu"})


def test_exit_code_137_is_named_for_what_it_is() -> None:
    from qualify.receipt_view import explain_exit

    line = "the engine exited with code 137 before it was ready"
    assert (
        explain_exit(line, oom=True)
        == "the engine was killed for memory (OOM, exit code 137) before it was ready"
    )
    assert (
        explain_exit(line, oom=False) == "the engine was killed (exit code 137: SIGKILL) before it was ready"
    )
    assert explain_exit("the engine exited with code 1370", oom=True) == "the engine exited with code 1370"
