"""The owner's repair of a log that rows written outside the store have stopped: remove every row beyond
the last good signed checkpoint, save them as evidence, and record the repair in `log_repairs`.

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
from receipts.checkpoint import NoteVerifier, open_checkpoint
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

    def to_json(self) -> dict[str, Any]:
        return {
            "kept_size": self.kept_size,
            "removed_entries": self.removed_entries,
            "removed_rows": self.removed_rows,
            "evidence": str(self.evidence),
            "evidence_sha256": self.evidence_sha256,
        }


def _kept_size(conn: Connection, verifier: NoteVerifier, origin: str | None) -> int:
    """The largest size whose stored checkpoint verifies with the log key and names the stored tree."""
    entries = conn.execute(sa.text("SELECT count(*) FROM log_entries")).scalar_one()
    reader = SqlSubtrees(conn)
    rows = conn.execute(
        sa.text("SELECT size, note FROM checkpoints WHERE size <= :n ORDER BY size DESC"), {"n": entries}
    )
    for size, note in rows:
        try:
            cp = open_checkpoint(note, [verifier], origin)
            if cp.size == size and cp.root == reader.run(lambda r, n=size: merkle.root_from(r, n)):
                return int(size)
        except (ReceiptsError, merkle.ProofError):
            continue
    return 0


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


def repair(url: str, verifier: NoteVerifier, evidence: Path, reason: str) -> RepairReport | None:
    """Remove the rows beyond the last good signed checkpoint (None when there are none). The removed rows
    are written to `evidence` (JSON Lines, mode 0600, never overwritten) before anything is deleted."""
    if not reason.strip():
        raise StoreError("say why the log is repaired (--reason); it is recorded with the repair")
    if evidence.exists():
        raise StoreError(f"evidence file {evidence} already exists; choose another path")
    engine = create_engine(parse_url(url), create=False)  # as the connecting user: the owner, no SET ROLE
    written = False
    try:
        with write_transaction(engine) as conn:
            origin = conn.execute(sa.text("SELECT origin FROM log_meta")).scalar()
            kept = _kept_size(conn, verifier, origin)
            removed: list[tuple[str, dict[str, Any]]] = []
            for table, condition in _BEYOND:
                for row in conn.execute(sa.text(f"SELECT * FROM {table} WHERE {condition}"), {"n": kept}):
                    removed.append((table, {k: _json(v) for k, v in row._mapping.items()}))
            if not removed:
                return None
            lines = "".join(json.dumps({"table": t, "row": r}, sort_keys=True) + "\n" for t, r in removed)
            data = lines.encode()
            try:
                fd = os.open(evidence, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError as error:
                raise StoreError(f"cannot write evidence file {evidence}: {error.strerror}") from error
            written = True
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
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
            conn.execute(
                sa.insert(LogRepair),
                {
                    "id": number,
                    "repaired_at": datetime.now(UTC),
                    "kept_size": kept,
                    "removed_entries": sum(1 for t, _ in removed if t == "log_entries"),
                    "removed_rows": len(removed),
                    "evidence_sha256": digest,
                    "by_role": str(role),
                    "reason": reason,
                },
            )
    except BaseException as error:
        if written:
            evidence.unlink(missing_ok=True)  # nothing was removed: no evidence of a removal
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
        kept, sum(1 for t, _ in removed if t == "log_entries"), len(removed), evidence, digest
    )
