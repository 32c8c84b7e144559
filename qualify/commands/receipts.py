"""`qualify receipts`: list, show, verify, prove, export and import stored receipts; print their schema.

Exit codes: 0 done, 1 a verification found a problem, 2 bad input (nothing written)."""

from __future__ import annotations

import json

import click
from rich.table import Table

from qualify.commands._common import (
    console,
    db_option,
    emit,
    json_option,
    log_verifiers,
    open_append,
    open_read,
    open_read_or_none,
    opened,
    parse_since,
    read_json_documents,
    short,
    store_errors,
    vkey_option,
    write_or_echo,
)
from receipts import merkle
from receipts.checkpoint import format_tlog_proof, open_checkpoint
from receipts.receipt import parse_receipt
from receipts.records import ReceiptRecord, rfc3339
from receipts.statement import predicate_json_schema, statement_json_schema

VERDICT_STYLE = {"qualified": "green", "rejected": "red", "aborted": "yellow"}


def _subject_line(record: ReceiptRecord) -> str:
    return ", ".join(f"{s.name} {s.digest[:19]}…" for s in record.subjects)


@click.group("receipts")
def receipts() -> None:
    """Stored receipts: list, show, verify, prove, export, import, schema."""


@receipts.command("list")
@click.option("--verdict", type=click.Choice(["qualified", "rejected", "aborted"]))
@click.option("--since", metavar="WHEN", help="Finished since: 7d, 24h, 30m, or an ISO date/time.")
@click.option("--subject", metavar="DIGEST", help="Only receipts about this subject (sha256:<hex>).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0)
@db_option
@json_option
@store_errors
def list_(
    verdict: str | None,
    since: str | None,
    subject: str | None,
    limit: int,
    offset: int,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Receipts in log order, filtered by verdict, finish time and subject."""
    when = parse_since(since)
    store = open_read_or_none(db_url)
    records: list[ReceiptRecord] = []
    if store is not None:
        with opened(store):
            records = store.list_receipts(
                verdict=verdict, since=when, subject=subject, limit=limit, offset=offset, checked=True
            )

    def human() -> None:
        if not records:
            console.print("no receipts match")
            return
        table = Table("id", "log", "verdict", "target", "host", "finished", "subjects")
        for r in records:
            style = VERDICT_STYLE.get(r.verdict, "")
            table.add_row(
                short(r.id),
                str(r.log_idx),
                f"[{style}]{r.verdict}[/]",
                r.target,
                r.host,
                rfc3339(r.finished_at),
                _subject_line(r),
            )
        console.print(table)

    emit(as_json, [r.to_json(predicate=False) for r in records], human)


@receipts.command("show")
@click.argument("receipt_id")
@click.option("--envelope", is_flag=True, help="Print the exact stored envelope bytes.")
@db_option
@json_option
@store_errors
def show(receipt_id: str, envelope: bool, db_url: str | None, as_json: bool) -> None:
    """One receipt by id (or a unique prefix of at least 4 hex digits)."""
    if envelope and as_json:
        raise click.UsageError("give --json or --envelope, not both")
    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id)
    if envelope:
        assert record.envelope is not None
        click.echo(record.envelope, nl=False)  # the exact stored bytes, nothing added
        return

    def human() -> None:
        style = VERDICT_STYLE.get(record.verdict, "")
        console.print(f"receipt {record.id}  [{style}]{record.verdict}[/]  (log index {record.log_idx})")
        console.print(
            f"  target {record.target} on {record.host}, {rfc3339(record.started_at)} → "
            f"{rfc3339(record.finished_at)}"
        )
        console.print(f"  signed by key {record.keyid}")
        for s in record.subjects:
            console.print(f"  subject {s.name}: {s.digest}")
        for check in record.predicate.get("checks", []):
            reason = f" — {check['reason']}" if check.get("reason") else ""
            console.print(f"  check {check['name']}: {check['status']} ({check['seconds']:.2f}s){reason}")

    emit(as_json, record.to_json(), human)


@receipts.command("verify")
@click.argument("receipt_id", required=False)
@click.option("--all", "all_", is_flag=True, help="Verify every receipt in the store.")
@vkey_option
@db_option
@json_option
@store_errors
@click.pass_context
def verify(
    ctx: click.Context,
    receipt_id: str | None,
    all_: bool,
    vkey: str | None,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Check a receipt's bytes, signature (against the key history at its index) and inclusion under the
    latest signed checkpoint."""
    if bool(receipt_id) == all_:
        raise click.UsageError("give a receipt ID or --all")
    with opened(open_read(db_url)) as store:
        verifiers, _ = log_verifiers(store, vkey)
        history = store.key_history()
        ids = [receipt_id] if receipt_id else [r.id for r in store.list_receipts(limit=None)]
        reports = [store.verify_receipt(i, verifiers=verifiers, history=history) for i in ids]

    def human() -> None:
        for report in reports:
            if report.ok:
                console.print(
                    f"[green]ok[/] {report.id} (log index {report.log_idx}, "
                    f"signed by {short(report.keyid or '')}, "
                    f"included in checkpoint of size {report.checkpoint_size})"
                )
            else:
                console.print(f"[red]FAILED[/] {report.id}: {report.problem}")
        if not reports:
            console.print("no receipts to verify")

    emit(as_json, [r.to_json() for r in reports], human)
    if not all(r.ok for r in reports):
        ctx.exit(1)


@receipts.command("prove")
@click.argument("receipt_id")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the proof here instead of stdout.")
@db_option
@store_errors
def prove(receipt_id: str, out: str | None, db_url: str | None) -> None:
    """Print a C2SP tlog-proof: the receipt's inclusion under the latest signed checkpoint."""
    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id)
        note = store.latest_checkpoint()
        cp = open_checkpoint(note, [store.log_verifier()])
        proof = store.inclusion_proof(record.log_idx, cp.size)
        entry = store.entry(record.log_idx)
    # Never hand out a proof that does not verify.
    merkle.verify_inclusion(record.log_idx, cp.size, entry.leaf_hash, proof, cp.root)
    text = format_tlog_proof(record.log_idx, proof, note)
    write_or_echo(text, out, f"wrote {out} (leaf {record.log_idx} of {cp.size})")


@receipts.command("export")
@click.option("--format", "fmt", type=click.Choice(["jsonl"]), default="jsonl", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@db_option
@store_errors
def export(fmt: str, out: str | None, db_url: str | None) -> None:
    """Every receipt's exact envelope, one per line, in log order (what `import` reads)."""
    store = open_read_or_none(db_url)
    lines = []
    if store is not None:
        with opened(store):
            lines = [entry.envelope.decode() for entry in store.iter_entries(kind="receipt")]
    text = "".join(line + "\n" for line in lines)
    write_or_echo(text, out, f"wrote {len(lines)} receipts to {out}")


@receipts.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
@db_option
@json_option
@store_errors
def import_(file: str, db_url: str | None, as_json: bool) -> None:
    """Append envelopes from another node (one JSON envelope, or JSON Lines): every signature is checked
    against the keys this log trusts; all are appended, or none."""
    parsed = [parse_receipt(document) for document in read_json_documents(file)]
    with opened(open_append(db_url)) as store:
        records = store.append_receipts(parsed)
    emit(
        as_json,
        [{"id": r.id, "log_index": r.log_idx, "verdict": r.verdict} for r in records],
        lambda: [console.print(f"imported {r.id} at log index {r.log_idx} ({r.verdict})") for r in records],
    )


@receipts.command("schema")
@click.option("--predicate", is_flag=True, help="Only the qualification predicate's schema.")
def schema(predicate: bool) -> None:
    """Print the JSON Schema of a receipt's statement (or of its predicate)."""
    click.echo(json.dumps(predicate_json_schema() if predicate else statement_json_schema(), indent=2))
