"""The owner's repair of a log that rows written outside the store have stopped: remove every row beyond
the last good signed checkpoint, save them as evidence, and record the repair in `log_repairs` and in a
note signed by the log key, kept outside the database (so that `log verify` finds a deleted record).

A repair can only cut what is provably bad:
- it runs with the log's own key (the one the store records; another key is refused, both named), so a
  checkpoint that does not verify is really not the log's;
- it refuses to keep fewer entries than the largest stored checkpoint the log key signed (a size an
  auditor or a rollout gate may hold), or none of a log that has entries, unless the owner confirms the
  exact size it keeps (`keep_size`).

Only the owner of the store's tables can run it (it lifts the append-only triggers inside its own
transaction, which the writer role may not); everything happens in one transaction under the writer lock.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from receipts import merkle
from receipts.checkpoint import NoteSigner, NoteVerifier, open_checkpoint, open_note
from receipts.db import create_engine, parse_url, shown, write_transaction
from receipts.errors import ReceiptsError, StoreError
from receipts.models import LogRepair
from receipts.subtrees import SqlSubtrees

# Rows beyond the kept size, per table, in the order they are deleted (children first).
_BEYOND = (
    (
        "receipt_subjects",
        "receipt_id IN (SELECT id FROM receipts WHERE log_idx >= :n) "
        "OR receipt_id NOT IN (SELECT id FROM receipts)",
    ),
    ("receipts", "log_idx >= :n"),
    ("approvals", "log_idx >= :n"),
    ("key_revocations", "revoked_at_idx >= :n"),
    ("signer_keys", "trusted_at_idx >= :n"),
    ("checkpoints", "size > :n"),
    ("merkle_nodes", "((node_index + 1) << level) > :n"),
    ("log_entries", "idx >= :n"),
)
TABLES = tuple(table for table, _ in _BEYOND)


@dataclass(frozen=True)
class RepairReport:
    kept_size: int
    removed_entries: int
    removed_rows: int
    evidence: Path
    evidence_sha256: str
    note: Path  # the repair note signed by the log key

    def to_json(self) -> dict[str, Any]:
        return {
            "kept_size": self.kept_size,
            "removed_entries": self.removed_entries,
            "removed_rows": self.removed_rows,
            "evidence": str(self.evidence),
            "evidence_sha256": self.evidence_sha256,
            "note": str(self.note),
        }


def _kept_size(conn: Connection, verifier: NoteVerifier, origin: str | None) -> tuple[int, int]:
    """(kept, signed): the largest size whose stored checkpoint verifies with the log key and names the
    stored tree, and the largest whose stored checkpoint the log key signed at all (a size someone outside
    may hold, even if the stored tree no longer matches it)."""
    entries = conn.execute(sa.text("SELECT count(*) FROM log_entries")).scalar_one()
    reader = SqlSubtrees(conn)
    rows = conn.execute(sa.text("SELECT size, note FROM checkpoints ORDER BY size DESC"))
    signed = 0
    for size, note in rows:
        try:
            cp = open_checkpoint(note, [verifier], origin)
        except ReceiptsError:
            continue
        if cp.size != size:
            continue
        signed = max(signed, int(size))
        try:
            if size <= entries and cp.root == reader.run(lambda r, n=size: merkle.root_from(r, n)):
                return int(size), signed
        except (ReceiptsError, merkle.ProofError):
            continue
    return 0, signed


# --------------------------------------------------------------------------- the signed repair note

NOTE_HEADER = "qualify.dev/log-repair/v1"


def note_name(origin: str, number: int) -> str:
    """The file name of a log's repair note: one log's notes never collide with another's in a data dir."""
    return f"{hashlib.sha256(origin.encode()).hexdigest()[:16]}-{number:06d}.note"


def note_body(origin: str, record: dict[str, Any], root: bytes) -> bytes:
    lines = [
        NOTE_HEADER,
        f"origin {origin}",
        f"number {record['id']}",
        f"kept {record['kept_size']}",
        f"root {root.hex()}",
        f"removed_entries {record['removed_entries']}",
        f"removed_rows {record['removed_rows']}",
        f"evidence {record['evidence_sha256']}",
    ]
    return ("\n".join(lines) + "\n").encode()


def open_repair_note(text: str, verifiers: list[NoteVerifier]) -> dict[str, str]:
    """The fields of a repair note once its signature verifies with the log key (VerificationError if not)."""
    body = open_note(text, verifiers)
    lines = body.rstrip("\n").split("\n")
    if not lines or lines[0] != NOTE_HEADER:
        raise StoreError(f"not a {NOTE_HEADER} note")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(" ")
        fields[name] = value
    return fields


def repair_notes(notes_dir: Path, origin: str) -> dict[int, Path]:
    """This log's repair notes in `notes_dir`, by repair number."""
    prefix = hashlib.sha256(origin.encode()).hexdigest()[:16] + "-"
    found: dict[int, Path] = {}
    if notes_dir.is_dir():
        for path in notes_dir.glob(prefix + "*.note"):
            number = path.name[len(prefix) : -len(".note")]
            if number.isdigit():
                found[int(number)] = path
    return found


def _write_exclusive(path: Path, data: bytes, what: str) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise StoreError(f"cannot write {what} {path}: {error.strerror}") from error
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _json(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _lift_triggers(conn: Connection) -> list[str]:
    """Drop (SQLite) or disable (PostgreSQL) the triggers of the log's tables in this transaction; returns
    the statements that put them back."""
    if conn.dialect.name == "sqlite":
        rows = conn.execute(
            sa.text(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN :t"
            ).bindparams(sa.bindparam("t", expanding=True)),
            {"t": list(TABLES)},
        ).all()
        for name, _ in rows:
            conn.exec_driver_sql(f'DROP TRIGGER "{name}"')
        return [sql for _, sql in rows]
    rows = conn.execute(
        sa.text(
            "SELECT tgname, tgrelid::regclass::text, tgenabled FROM pg_trigger "
            "WHERE NOT tgisinternal AND tgrelid::regclass::text = ANY(:t)"
        ),
        {"t": list(TABLES)},
    ).all()
    restore = []
    for name, table, enabled in rows:
        conn.exec_driver_sql(f'ALTER TABLE {table} DISABLE TRIGGER "{name}"')
        mode = {"A": "ENABLE ALWAYS", "R": "ENABLE REPLICA"}.get(enabled, "ENABLE")
        restore.append(f'ALTER TABLE {table} {mode} TRIGGER "{name}"')
    return restore


def repair(
    url: str,
    signer: NoteSigner,
    evidence: Path,
    reason: str,
    *,
    notes_dir: Path,
    keep_size: int | None = None,
) -> RepairReport | None:
    """Remove the rows beyond the last good signed checkpoint (None when there are none). The removed rows
    are written to `evidence` (JSON Lines, mode 0600, never overwritten) before anything is deleted, and
    the repair is recorded in `log_repairs` and in a note signed by `signer` (the log key) in
    `notes_dir`. Refused when `signer` is not the log's key, or when it would keep fewer entries than the
    largest checkpoint the log key signed (or none) and `keep_size` does not confirm that exact size."""
    if not reason.strip():
        raise StoreError("say why the log is repaired (--reason); it is recorded with the repair")
    if evidence.exists():
        raise StoreError(f"evidence file {evidence} already exists; choose another path")
    verifier = signer.verifier()
    engine = create_engine(parse_url(url), create=False)  # as the connecting user: the owner, no SET ROLE
    written: list[Path] = []
    try:
        with write_transaction(engine) as conn:
            meta = conn.execute(sa.text("SELECT origin, vkey FROM log_meta")).first()
            if meta is None:
                return None
            origin, vkey = meta
            if vkey != verifier.vkey():
                raise StoreError(
                    f"the key given ({verifier.vkey()}) is not this log's key ({vkey}): with another key no "
                    "checkpoint verifies and the repair would remove good entries; nothing removed; repair "
                    "with the log's own key"
                )
            entries = conn.execute(sa.text("SELECT count(*) FROM log_entries")).scalar_one()
            kept, signed = _kept_size(conn, verifier, origin)
            if keep_size is not None and keep_size != kept:
                raise StoreError(
                    f"--keep-size {keep_size} is not what the repair would keep ({kept} entries, the last "
                    f"checkpoint that verifies and names the stored tree); nothing removed"
                )
            if keep_size is None and (kept < signed or (kept == 0 and entries > 0)):
                why = (
                    f"the log key signed a checkpoint of size {signed}, which someone outside may hold"
                    if kept < signed
                    else f"the log holds {entries} entries and no stored checkpoint verifies with its key"
                )
                raise StoreError(
                    f"the repair would keep only {kept} of {entries} entries, but {why}: the entries "
                    f"beyond {kept} may be good ones damaged in place; nothing removed; compare with a "
                    "checkpoint kept outside the database (qualify log verify --checkpoint FILE), and if "
                    f"the cut is right, confirm it with: --keep-size {kept}"
                )
            removed: list[tuple[str, dict[str, Any]]] = []
            for table, condition in _BEYOND:
                for row in conn.execute(sa.text(f"SELECT * FROM {table} WHERE {condition}"), {"n": kept}):
                    removed.append((table, {k: _json(v) for k, v in row._mapping.items()}))
            if not removed:
                return None
            lines = "".join(json.dumps({"table": t, "row": r}, sort_keys=True) + "\n" for t, r in removed)
            data = lines.encode()
            _write_exclusive(evidence, data, "evidence file")
            written.append(evidence)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            root = SqlSubtrees(conn).run(lambda r: merkle.root_from(r, kept))
            restore = _lift_triggers(conn)
            for table, condition in _BEYOND:
                conn.execute(sa.text(f"DELETE FROM {table} WHERE {condition}"), {"n": kept})
            for statement in restore:
                conn.exec_driver_sql(statement)
            role = (
                "sqlite"
                if conn.dialect.name == "sqlite"
                else conn.exec_driver_sql("SELECT current_user").scalar()
            )
            number = conn.execute(sa.select(sa.func.count()).select_from(LogRepair)).scalar_one() + 1
            record = {
                "id": number,
                "repaired_at": datetime.now(UTC),
                "kept_size": kept,
                "removed_entries": sum(1 for t, _ in removed if t == "log_entries"),
                "removed_rows": len(removed),
                "evidence_sha256": digest,
                "by_role": str(role),
                "reason": reason,
            }
            conn.execute(sa.insert(LogRepair), record)
            # The signed note, before the commit: a repair is never recorded only where its owner can
            # delete the record (log verify requires the note's row, and the row's note).
            note = notes_dir / note_name(origin, number)
            _write_exclusive(note, signer.sign(note_body(origin, record, root)).encode(), "repair note")
            written.append(note)
    except BaseException as error:
        for path in written:
            path.unlink(missing_ok=True)  # nothing was removed: no evidence of a removal
        if not isinstance(error, exc.DBAPIError):
            raise
        first = str(getattr(error, "orig", error)).strip().splitlines()
        raise StoreError(
            f"cannot repair the store at {shown(engine.url)}: {first[0] if first else error}; only the "
            "owner of the store's tables can (connect as the user who created them)"
        ) from error
    finally:
        engine.dispose()
    return RepairReport(
        kept, sum(1 for t, _ in removed if t == "log_entries"), len(removed), evidence, digest, note
    )
