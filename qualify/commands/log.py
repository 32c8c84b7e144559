"""`qualify log`: export the latest signed checkpoint, print the log's verifier key, prove the log extends an
old checkpoint (consistency), verify the whole log (optionally against a checkpoint kept outside the
database), and the owner's repair.

Exit codes: 0 verified, 1 verification found tampering, 2 bad input."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from qualify import settings
from qualify.commands._common import (
    console,
    db_option,
    emit,
    host_log_verifier,
    json_option,
    load_log_signer,
    local_log_signer,
    log_verifiers,
    open_append,
    open_read,
    opened,
    parse_vkey,
    store_errors,
    vkey_option,
    warn_served,
    write_file,
)
from qualify.commands.offline import MAX_PROOF_BYTES, consistency_document
from qualify.errors import UsageError
from qualify.limits import read_text_limited
from receipts import merkle
from receipts.checkpoint import Checkpoint, open_checkpoint
from receipts.errors import TamperError

if TYPE_CHECKING:
    from receipts.verify import LogReport

# receipts.verify and receipts.repair (SQLAlchemy) are imported by the commands that run them, so that
# `qualify log --help` starts at once.


@click.group("log")
def log() -> None:
    """The Merkle log: checkpoints and whole-log verification."""


@log.command("checkpoint")
@click.option(
    "--out", type=click.Path(dir_okay=False), help="Write the signed checkpoint here (keep it safe)."
)
@db_option
@json_option
@store_errors
def checkpoint(out: str | None, db_url: str | None, as_json: bool) -> None:
    """The latest signed checkpoint (C2SP signed note): keep a copy outside the database."""
    with opened(open_read(db_url)) as store:
        note = store.good_checkpoint()  # the latest one that verifies with the trusted log key
        vkey = store.trusted_log_key()[0].vkey()
        warn_served(store)
    cp = Checkpoint.parse(note[: note.rfind("\n\n") + 1])
    if out:
        write_file(out, note)
    data = {"origin": cp.origin, "size": cp.size, "root_hash": cp.root.hex(), "vkey": vkey, "note": note}

    def human() -> None:
        if out:
            console.print(f"wrote checkpoint of size {cp.size} to {out}")
        else:
            click.echo(note, nl=False)

    emit(as_json, data, human)


@log.command("consistency")
@click.argument("old", type=click.Path(dir_okay=False))
@click.option(
    "--out", type=click.Path(dir_okay=False), help="Write the proof document here (for verify-consistency)."
)
@vkey_option
@db_option
@json_option
@store_errors
def consistency(old: str, out: str | None, vkey: str | None, db_url: str | None, as_json: bool) -> None:
    """Prove that the log's latest checkpoint extends OLD (a checkpoint kept with `log checkpoint --out`):
    the RFC 9162 consistency proof between their sizes, verified here and written with both signed
    checkpoints, so that `qualify verify-consistency` can check it later without the store."""
    old_note = read_text_limited(old, MAX_PROOF_BYTES, "checkpoint")
    with opened(open_read(db_url)) as store:
        verifiers, source = log_verifiers(store, vkey)
        # The latest checkpoint that verifies with that key and names the stored tree (not a junk row).
        new_note = store.good_head(verifier=(verifiers[0], source)).note or store.latest_checkpoint()
        warn_served(store)
        first = open_checkpoint(old_note, verifiers)
        latest = open_checkpoint(new_note, verifiers, origin=first.origin)
        if first.size > latest.size:
            raise UsageError(
                f"checkpoint {old} has {first.size} entries but the log has {latest.size}: "
                "it is not this log's past"
            )
        proof = store.consistency_proof(first.size, latest.size)
    merkle.verify_consistency(
        first.size, latest.size, proof, first.root, latest.root
    )  # never hand out a bad one
    doc = consistency_document(old_note, new_note, proof)
    if out:
        write_file(out, json.dumps(doc, indent=2) + "\n")
    data = {
        "origin": first.origin,
        "old_size": first.size,
        "new_size": latest.size,
        "root_hash": latest.root.hex(),
        "hashes": doc["hashes"],
        "trusted": source,
    }

    def human() -> None:
        console.print(
            f"log {first.origin} at size {latest.size} extends the checkpoint at size {first.size} "
            f"({len(proof)} proof hashes; checkpoints checked with {source})"
            + (f"; wrote {out}" if out else "")
        )

    emit(as_json, data, human)


@log.command("vkey")
@db_option
@store_errors
def vkey(db_url: str | None) -> None:
    """The store's log verifier key (its key name is the log's origin), for auditors and hosts
    (`log verify --vkey`, `qualify run --vkey`). Where the local log key is this log's, the key printed is
    the local one; otherwise the one the store records, and a note on stderr says so."""
    with opened(open_read(db_url)) as store:
        meta = store.meta()
        if meta is None:
            raise UsageError("the log is empty: it has no log key yet; it gets one with its first entry")
        signer = local_log_signer(store)
        if signer is not None:
            click.echo(signer.vkey())
            return
        click.echo(
            "note: this is the key the store records (no local log key of this log here); "
            "compare it with the one its sequencer prints before you trust it",
            err=True,
        )
        click.echo(store.log_verifier().vkey())


def run_sequencer(
    db_url: str | None,
    *,
    batch: int = 256,
    interval: float = 0.25,
    once: bool = False,
    duration: float | None = None,
    stop: threading.Event | None = None,
    quiet: bool = False,
) -> int:
    """The sequencer loop (`qualify log sequence`, `qualify serve --sequencer`); how many it integrated."""
    from receipts import sequencer

    stop = stop or threading.Event()
    deadline = None if duration is None else time.monotonic() + duration
    total = 0
    with opened(open_append(db_url)) as store:
        if store.log_signer is None:
            raise UsageError(
                "the sequencer signs the log's checkpoints: run it where the log key is (keys/log.key), "
                "not on a host that holds only the verifier key"
            )
        store.ensure_log()
        if not quiet:
            click.echo(f"sequencing log {store.origin} ({store.log_signer.vkey()})", err=True)

        def done() -> bool:
            return stop.is_set() or (deadline is not None and time.monotonic() >= deadline)

        while not done():
            result = sequencer.integrate(store, batch)
            total += result.integrated
            if (result.integrated or result.refused) and not quiet:
                click.echo(
                    f"sequenced {result.integrated} (refused {result.refused}), log size {result.size}",
                    err=True,
                )
            if result.integrated + result.refused < batch:
                if once:
                    break
                stop.wait(interval)
    return total


@log.command("sequence")
@click.option(
    "--batch", default=256, show_default=True, type=click.IntRange(1, 10_000), help="Entries per batch."
)
@click.option(
    "--interval",
    default=0.25,
    show_default=True,
    type=click.FloatRange(0.01, 60),
    help="Seconds to wait for more entries when a batch is not full.",
)
@click.option("--once", is_flag=True, help="Integrate what is queued now, then exit.")
@click.option("--duration", type=click.FloatRange(min=0), help="Stop after this many seconds.")
@db_option
@store_errors
def sequence(batch: int, interval: float, once: bool, duration: float | None, db_url: str | None) -> None:
    """The log's sequencer, the one process that holds the log key: integrates the entries hosts queue
    (up to --batch per transaction), gives each the next log index, signs one checkpoint per batch and
    records why it refused any. Stop it with SIGTERM or Ctrl-C; killed outright it loses nothing (a batch
    is committed whole or not at all) and a restart goes on where the log stands."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run_sequencer(db_url, batch=batch, interval=interval, once=once, duration=duration, stop=stop)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary(report: LogReport) -> str:
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.kinds.items())) or "no entries"
    text = (
        f"log OK: {report.size} entries ({kinds}), root {report.root.hex()[:16]}…, "
        f"{report.checkpoints} signed checkpoints and {report.subtrees} subtrees match, {report.seconds:.2f}s"
    )
    if report.external is not None:
        text += f"; consistent with the external checkpoint of size {report.external.size}"
    if report.repairs:
        last = report.repairs[-1]
        text += (
            f"; {len(report.repairs)} owner repair(s) recorded, the latest at {last['repaired_at']} kept "
            f"size {last['kept_size']} and removed {last['removed_entries']} entries ({last['reason']})"
        )
    return text


@log.command("verify")
@click.option(
    "--checkpoint", "checkpoint_file", type=click.Path(dir_okay=False), help="A checkpoint kept elsewhere."
)
@vkey_option
@click.option(
    "--workers", type=click.IntRange(min=0), help="Worker processes (default: one per CPU when large)."
)
@db_option
@json_option
@store_errors
@click.pass_context
def verify(
    ctx: click.Context,
    checkpoint_file: str | None,
    vkey: str | None,
    workers: int | None,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Recompute every leaf and the tree from the stored bytes; check every signature, stored checkpoint
    and subtree; with --checkpoint, prove the log still extends that older checkpoint."""
    text = None
    if checkpoint_file:
        try:
            text = Path(checkpoint_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read checkpoint {checkpoint_file}: {error}") from None
    with opened(open_read(db_url)) as store:
        verifiers, source = log_verifiers(store, vkey)
        if text is not None:
            # A checkpoint that does not verify, or of another log, is bad input (exit 2), not tampering.
            open_checkpoint(text, verifiers, store.origin)
        from receipts.verify import verify_log

        signer = local_log_signer(store)
        try:
            report = verify_log(
                store,
                checkpoint_text=text,
                verifiers=verifiers,
                log_signer=signer,
                workers=workers,
                notes_dir=settings.repair_notes_dir(),
            )
        except TamperError as error:
            report = error.report  # type: ignore[attr-defined]
            if as_json:
                emit(True, report.to_json(), lambda: None)
            else:
                click.echo(f"error: {error}", err=True)
                for problem in report.problems[1:10]:
                    click.echo(f"  also: {problem}", err=True)
            ctx.exit(1)
    emit(as_json, {**report.to_json(), "trusted_log_key": source}, lambda: console.print(_summary(report)))


@log.command("repair")
@click.option(
    "--evidence",
    type=click.Path(dir_okay=False),
    required=True,
    help="Where to save the removed rows (JSON Lines, 0600; must not exist).",
)
@click.option("--reason", required=True, help="Why the log is repaired (recorded with the repair).")
@click.option(
    "--keep-size",
    type=click.IntRange(min=0),
    help="Confirm the size the repair keeps, where it would cut below a checkpoint the log key signed.",
)
@vkey_option
@db_option
@json_option
@store_errors
@click.pass_context
def repair_(
    ctx: click.Context,
    evidence: str,
    reason: str,
    keep_size: int | None,
    vkey: str | None,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Owner only, where the log key is: remove rows written outside the store beyond the last checkpoint
    that verifies with the log key (they stop every append), saving them to --evidence first; the repair
    is recorded in the append-only log_repairs table and in a note signed by the log key in the data dir
    (log verify requires both). Entries covered by a good signed checkpoint are never touched; a cut below
    a checkpoint the log key signed, or to nothing, needs --keep-size."""
    with opened(open_read(db_url)) as store:  # brings the schema to head first, as the owner
        url = store.engine.url.render_as_string(hide_password=False)
        # The local log key named as this log signs (key name = origin), when it is this log's key.
        signer = local_log_signer(store)
        held = host_log_verifier() if signer is None else None
        own_key = load_log_signer(create=False) if signer is None else None
    if signer is None and held is not None and own_key is None:
        raise UsageError(
            f"this host holds only the log's verifier key ({held[1]}), not the log key: a repair is signed "
            "by the log key, so it is the sequencer's act; run qualify log repair where the log key is"
        )
    if signer is None:
        raise UsageError(
            f"a repair is signed by the log key, and there is no key of this log at "
            f"{settings.log_key_path()}; run it where the log key is"
        )
    if vkey and parse_vkey(vkey).vkey() != signer.vkey():
        raise UsageError(
            f"--vkey {parse_vkey(vkey).vkey()} is not the local log key {signer.vkey()}; nothing removed"
        )
    verifiers = [signer.verifier()]
    from receipts.repair import repair

    report = repair(
        url, signer, Path(evidence), reason, notes_dir=settings.repair_notes_dir(), keep_size=keep_size
    )
    if report is None:
        # Nothing lies beyond the last good checkpoint; but "nothing to repair" is said only of a log that
        # also verifies: tampering inside the signed part is not the repair's to fix, and must not read
        # as a clean bill.
        problem = _verify_problem(db_url, verifiers)
        if problem is not None:
            emit(as_json, {"repaired": False, "verified": False, "problem": problem}, lambda: None)
            click.echo(
                f"error: no rows lie beyond the last good signed checkpoint, so there is nothing a repair "
                f"may remove, but the log does not verify: {problem}; see: qualify log verify",
                err=True,
            )
            ctx.exit(1)
        emit(
            as_json,
            {"repaired": False, "verified": True},
            lambda: console.print("nothing to repair: every row is covered and the log verifies"),
        )
        return
    emit(
        as_json,
        {"repaired": True, **report.to_json()},
        lambda: console.print(
            f"removed {report.removed_entries} entries ({report.removed_rows} rows) beyond the signed "
            f"checkpoint of size {report.kept_size}; evidence {report.evidence} ({report.evidence_sha256}); "
            f"the repair is recorded in log_repairs and in {report.note} (signed by the log key)"
        ),
    )


def _verify_problem(db_url: str | None, verifiers: list) -> str | None:
    """The first problem `log verify` finds with the log (None when it verifies)."""
    from receipts.verify import verify_log

    with opened(open_read(db_url)) as store:
        try:
            verify_log(
                store,
                verifiers=verifiers,
                log_signer=local_log_signer(store),
                notes_dir=settings.repair_notes_dir(),
            )
        except TamperError as error:
            return str(error)
    return None
