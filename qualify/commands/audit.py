"""`qualify audit report`: a self-contained HTML page of the store's history, verified at report time."""

from __future__ import annotations

from pathlib import Path

import click

from qualify.commands._common import (
    console,
    db_option,
    emit,
    json_option,
    log_verifiers,
    open_read,
    opened,
    store_errors,
    vkey_option,
)
from qualify.errors import UsageError
from receipts.checkpoint import open_checkpoint


@click.group("audit")
def audit() -> None:
    """Reports for auditors."""


@audit.command("report")
@click.option("--out", "out", required=True, metavar="FILE", help="Where to write the HTML page.")
@db_option
@click.option(
    "--checkpoint",
    "checkpoint_file",
    default=None,
    metavar="FILE",
    help="A checkpoint exported earlier (qualify log checkpoint --out); the log must still extend it.",
)
@vkey_option
@json_option
@store_errors
def report(
    out: str, db_url: str | None, checkpoint_file: str | None, vkey: str | None, as_json: bool
) -> None:
    """Write one HTML page (no network needed to view it): history, failures, faults, timings, log growth,
    and whether the whole log verifies now. Exit 0 when it verifies, 1 when it does not."""
    from qualify.report import collect, render  # jinja2 and the store: only when a report is written

    checkpoint_text = None
    if checkpoint_file:
        try:
            checkpoint_text = Path(checkpoint_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read the checkpoint file {checkpoint_file}: {exc}") from None
    with opened(open_read(db_url)) as store:
        verifiers, source = log_verifiers(store, vkey)
        if checkpoint_text is not None:
            open_checkpoint(checkpoint_text, verifiers)  # one that does not verify is bad input: exit 2
        data = collect(store, checkpoint_text=checkpoint_text, verifiers=verifiers)
    target = Path(out)
    try:
        target.write_text(render(data), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror}") from None
    summary = {
        "out": str(target),
        "receipts": len(data.receipts),
        "approvals": len(data.approvals),
        "log_size": data.status.size,
        "log_verifies": data.status.ok,
        "checkpoint_key": source,
        "problems": list(data.status.problems),
    }

    def human() -> None:
        state = "log verifies" if data.status.ok else "[bold red]LOG DOES NOT VERIFY[/]"
        console.print(f"wrote {target}: {len(data.receipts)} receipts, {data.status.size} entries, {state}")
        for problem in data.status.problems[:10]:
            console.print(f"  [red]-[/] {problem}")

    emit(as_json, summary, human)
    if not data.status.ok:
        raise SystemExit(1)
