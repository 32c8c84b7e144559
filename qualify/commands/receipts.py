"""`qualify receipts`: list, show, verify, prove, bundle (Sigstore), export and import stored receipts;
print their schema.

Exit codes: 0 done, 1 a verification found a problem, 2 bad input (nothing written)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.markup import escape
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
    parse_host_option,
    parse_since,
    parse_subject_option,
    read_json_documents,
    short,
    store_errors,
    tamper_exits_1,
    vkey_option,
    warn_served,
    write_file,
    write_or_echo,
)
from receipts import merkle
from receipts.checkpoint import format_tlog_proof, open_checkpoint
from receipts.errors import StoreError
from receipts.records import ReceiptRecord, rfc3339

if TYPE_CHECKING:
    from receipts.store import Store

# receipt_view, receipts.receipt and receipts.statement (pydantic) are imported by the commands that use
# them, so that `qualify receipts --help` and `receipts list` start without them.

VERDICT_STYLE = {"qualified": "green", "rejected": "red", "aborted": "yellow"}
CHECK_STYLE = {"pass": "green", "fail": "red", "error": "red", "skip": "yellow"}


def _subject_line(record: ReceiptRecord) -> str:
    return " ".join(f"{s.digest[:19]}" for s in record.subjects)


@click.group("receipts")
def receipts() -> None:
    """Stored receipts: list, show, verify, prove, bundle, attach, export, import, schema."""


@receipts.command("list")
@click.option("--verdict", type=click.Choice(["qualified", "rejected", "aborted"]))
@click.option(
    "--since", metavar="WHEN", help="Finished since: a duration (7d, 24h, 30m) or an RFC 3339 date/time."
)
@click.option("--subject", metavar="DIGEST", help="Only receipts about this subject (sha256:<hex>).")
@click.option("--host", metavar="NAME", help="Only receipts from this host (its hostname).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Skip this many newest matches.")
@db_option
@json_option
@store_errors
@tamper_exits_1
def list_(
    verdict: str | None,
    since: str | None,
    subject: str | None,
    host: str | None,
    limit: int,
    offset: int,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Receipts newest first, filtered by verdict, finish time, subject and host.

    With --json: {"total", "limit", "offset", "items": [...]}."""
    when = parse_since(since)
    subject = parse_subject_option(subject)
    host = parse_host_option(host)
    store = open_read_or_none(db_url)
    records: list[ReceiptRecord] = []
    total = 0
    if store is not None:
        with opened(store):
            records, total = store.find_receipts(
                verdict=verdict, since=when, subject=subject, host=host, limit=limit, offset=offset
            )
            warn_served(store)

    def human() -> None:
        if not records:
            console.print(
                "no receipts match" if not total else f"no receipts past offset {offset} ({total} match)"
            )
            return
        table = Table("log_index", "id", "verdict", "target", "host", "finished (UTC)", "subjects")
        for r in records:
            style = VERDICT_STYLE.get(r.verdict, "")
            table.add_row(
                str(r.log_idx),
                short(r.id),
                f"[{style}]{r.verdict}[/]",
                escape(r.target),
                escape(r.host),
                rfc3339(r.finished_at),
                escape(_subject_line(r)),
            )
        # A pipe gets whole rows rather than rows folded to 80 columns.
        wide = console if console.is_terminal else Console(highlight=False, width=max(console.width, 160))
        wide.print(table)
        first = offset + 1
        console.print(
            f"showing {len(records)} of {total} (newest first"
            + (f", from match {first}" if offset else "")
            + ")"
            + ("; more with --limit / --offset" if offset + len(records) < total else "")
        )

    page = {"total": total, "limit": limit, "offset": offset}
    emit(as_json, {**page, "items": [r.to_json(predicate=False) for r in records]}, human)


@receipts.command("show")
@click.argument("receipt_id", required=False)
@click.option(
    "--log-index", type=click.IntRange(min=0), help="The receipt at this log index instead of an ID."
)
@click.option("--envelope", is_flag=True, help="Print the exact stored envelope bytes.")
@db_option
@json_option
@store_errors
@tamper_exits_1
def show(
    receipt_id: str | None, log_index: int | None, envelope: bool, db_url: str | None, as_json: bool
) -> None:
    """One receipt by id (or a unique prefix of at least 4 hex digits) or by --log-index: a summary line
    with the facts an auditor looks for first, the facts table, every check with each condition and its
    source (observed, derived, monitored, engine), then the subjects and the signature."""
    if envelope and as_json:
        raise click.UsageError("give --json or --envelope, not both")
    if (receipt_id is None) == (log_index is None):
        raise click.UsageError("give a receipt ID or --log-index N")
    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id) if receipt_id is not None else store.receipt_at(log_index or 0)
        warn_served(store)
    if envelope:
        assert record.envelope is not None
        click.echo(record.envelope, nl=False)  # the exact stored bytes, nothing added
        return
    emit(as_json, record.to_json(), lambda: print_receipt(record))


def print_receipt(record: ReceiptRecord) -> None:
    """The human view of `receipts show`: facts first, then checks and conditions, then identity."""
    from qualify import receipt_view as view

    p = record.predicate
    style = VERDICT_STYLE.get(record.verdict, "")
    console.print(f"receipt {record.id}  [{style}]{record.verdict}[/]  log_index {record.log_idx}")
    console.print(escape(view.summary_line(p)))
    console.print()
    rows = view.facts(p)
    width = max(len(k) for k, _ in rows)
    for name, value in rows:
        console.print(f"  {name:<{width}}  {escape(value)}")
    console.print()
    console.print("checks (condition, source: observed = measured by the harness, derived = computed by")
    console.print("the harness from observed values, monitored = recorded inside the engine process by the")
    console.print("harness's CUDA activity monitor, engine = the engine's own report):")
    oom = view.is_oom(p)
    for check in view.checks(p):
        cstyle = CHECK_STYLE.get(check.status, "")
        reason = f" — {escape(view.explain_exit(check.reason, oom))}" if check.reason else ""
        name, status = escape(f"{check.name:<11}"), escape(f"{check.status:<5}")
        console.print(f"  {name}[{cstyle}]{status}[/] {check.seconds:7.2f} s{reason}")
        if not check.conditions and check.status != "skip":
            console.print("      (no conditions recorded for this check)")
        cwidth = max((len(c.name) for c in check.conditions), default=0)
        for c in check.conditions:
            mark = "[green]✓[/]" if c.holds else "[red]✗[/]"
            detail = f"  {escape(view.explain_exit(c.detail, oom))}" if c.detail else ""
            console.print(f"      {mark} {escape(f'{c.name:<{cwidth}}  {c.source:<8}')}{detail}".rstrip())
    console.print()
    for s in record.subjects:
        console.print(f"  subject {escape(s.name)}: {s.digest}")
    console.print(f"  signed by key {record.keyid} (verify with: qualify receipts verify {short(record.id)})")


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
        if receipt_id:
            reports = [store.verify_receipt(receipt_id, verifiers=verifiers)]
        else:
            # Every receipt against one last good checkpoint (found and checked once, with the trusted
            # log key), each query row checked; entries and proof subtrees read in batches.
            records = store.list_receipts(limit=None)
            reports = [report for report, _ in store.verify_receipts(records, verifiers)]
    for notice in sorted({r.notice for r in reports if r.notice}):
        click.echo(f"warning: {notice}", err=True)

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
@tamper_exits_1
def prove(receipt_id: str, out: str | None, db_url: str | None) -> None:
    """Print a C2SP tlog-proof: the receipt's inclusion under the latest signed checkpoint."""
    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id)
        # Never hand out a proof that does not verify (inclusion_of checks it).
        text, size = inclusion_of(store, record)
    write_or_echo(text, out, f"wrote {out} (leaf {record.log_idx} of {size})")


def _proof_path(out: str) -> str:
    """receipt.sigstore.json -> receipt.tlog-proof (beside it); any other name gets .tlog-proof added."""
    for suffix in (".sigstore.json", ".json"):
        if out.endswith(suffix):
            return out[: -len(suffix)] + ".tlog-proof"
    return out + ".tlog-proof"


def inclusion_of(store: Store, record: ReceiptRecord) -> tuple[str, int]:
    """The receipt's C2SP tlog-proof under the last good checkpoint (the latest that verifies with the
    trusted log key and names the stored tree; checked before it is handed out), and that checkpoint's
    size."""
    note = store.good_checkpoint()
    cp = open_checkpoint(note, [store.trusted_log_key()[0]])
    proof = store.inclusion_proof(record.log_idx, cp.size)
    entry = store.entry(record.log_idx)
    merkle.verify_inclusion(record.log_idx, cp.size, entry.leaf_hash, proof, cp.root)
    return format_tlog_proof(record.log_idx, proof, note), cp.size


@receipts.command("bundle")
@click.argument("receipt_id")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    required=True,
    help="The Sigstore bundle file (e.g. receipt.sigstore.json).",
)
@click.option(
    "--proof-out",
    type=click.Path(dir_okay=False),
    help="Where the log's C2SP tlog-proof goes (default: beside --out, as NAME.tlog-proof).",
)
@db_option
@json_option
@store_errors
@tamper_exits_1
def bundle(receipt_id: str, out: str, proof_out: str | None, db_url: str | None, as_json: bool) -> None:
    """Write a receipt as a Sigstore bundle v0.3 (the exact stored DSSE envelope, the signer's key id as
    publicKey.hint) and, beside it, its inclusion in the log (a C2SP tlog-proof: a Rekor tlog entry
    cannot describe this log's leaves, see docs/FORMATS.md). Verify the bundle with the operator's
    public key (qualify keys export-public KEYID) and the proof with qualify verify-proof."""
    from receipts.sigstore_bundle import bundle_of

    proof_path = proof_out or _proof_path(out)
    if proof_path == out:
        raise click.UsageError("--proof-out must differ from --out")
    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id)
        proof, _ = inclusion_of(store, record)
    assert record.envelope is not None
    data = bundle_of(record.envelope)
    write_file(out, json.dumps(data, indent=2) + "\n")
    write_file(proof_path, proof)
    info = {
        "id": record.id,
        "log_index": record.log_idx,
        "keyid": data["verificationMaterial"]["publicKey"]["hint"],
        "bundle": out,
        "tlog_proof": proof_path,
    }
    emit(
        as_json,
        info,
        lambda: console.print(
            f"wrote Sigstore bundle {out} (receipt {short(record.id)}, key {short(info['keyid'])}) "
            f"and its log inclusion {proof_path}"
        ),
    )


@receipts.command("attach")
@click.argument("receipt_id")
@click.option(
    "--image", "image", required=True, metavar="REF", help="The image: REGISTRY/REPO:TAG or @sha256:…"
)
@click.option("--plain-http", is_flag=True, help="Talk HTTP to the registry (default: only for loopback).")
@db_option
@json_option
@store_errors
@tamper_exits_1
def attach(receipt_id: str, image: str, plain_http: bool, db_url: str | None, as_json: bool) -> None:
    """Store a receipt with the image it is about, in the image's registry: its Sigstore bundle and
    tlog-proof as an OCI 1.1 artifact whose subject is the image's manifest (listed by the referrers API,
    or the sha256-<digest> referrers tag where the registry has no such API), and its envelope in
    cosign's sha256-<digest>.att tag. The receipt must name the image (its id or manifest digest)."""
    from qualify import oci
    from receipts.sigstore_bundle import bundle_of
    from receipts.statement import PREDICATE_TYPE

    with opened(open_read(db_url)) as store:
        record = store.get_receipt(receipt_id)
        proof, _ = inclusion_of(store, record)
    assert record.envelope is not None
    found = oci.Registry(image, plain_http or None).image()
    named = {s.digest for s in record.subjects}
    if not named & {found.digest, found.config_digest}:
        raise click.UsageError(
            f"receipt {short(record.id)} is not about {image} (manifest {found.digest}, image id "
            f"{found.config_digest}); its subjects are {', '.join(sorted(named))}"
        )
    info = oci.attach(
        image,
        bundle=bundle_of(record.envelope),
        proof=proof,
        predicate_type=PREDICATE_TYPE,
        plain_http=plain_http or None,
    )
    where = "the referrers API" if info["referrers_api"] else f"referrers tag {info['referrers_tag']}"
    emit(
        as_json,
        info,
        lambda: console.print(
            f"attached receipt {short(record.id)} to {image} ({found.digest}): artifact {info['referrer']} "
            f"(listed by {where}) and tag {info['att_tag']}"
        ),
    )


@receipts.command("export")
@click.option("--format", "fmt", type=click.Choice(["jsonl"]), default="jsonl", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@db_option
@store_errors
@tamper_exits_1
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
    from receipts.db import MissingStore
    from receipts.receipt import parse_receipt

    parsed = [parse_receipt(document) for document in read_json_documents(file)]
    try:
        # Never a new store: a log that does not exist trusts no key, so every envelope would be refused,
        # and a refused import must leave nothing behind (no database, no log key).
        with opened(open_read(db_url)) as probe:
            history, size = probe.key_history(), probe.size()
    except MissingStore as error:
        raise StoreError(
            f"{error}; a new log trusts no key, so nothing would be imported: trust the signer's public "
            "key there first (qualify keys trust FILE), then import"
        ) from None
    # Refused before anything is opened for writing (which may make the log key of a log that has no
    # entries yet); the append checks every signature again, under the writer lock.
    for offset, receipt in enumerate(parsed):
        history.signers(receipt.envelope, size + offset, f"receipt {receipt.id[:16]}")
    with opened(open_append(db_url, create=False)) as store:
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
    from receipts.statement import predicate_json_schema, statement_json_schema

    click.echo(json.dumps(predicate_json_schema() if predicate else statement_json_schema(), indent=2))
