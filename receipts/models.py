"""The store's tables as SQLAlchemy 2 typed ORM models: the append-only log, its Merkle subtrees,
checkpoints, and the query tables derived from log entries (receipts, approvals, signer keys)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# The Alembic revision this code expects; a test checks it is the head of migrations/versions.
SCHEMA_REVISION = "0004_statement_guards"

ENTRY_KINDS = ("receipt", "approval", "key-trust", "key-revoke")

# Every table here is append-only: triggers forbid UPDATE, DELETE (and TRUNCATE on PostgreSQL).
APPEND_ONLY_TABLES = (
    "log_meta",
    "log_entries",
    "merkle_nodes",
    "checkpoints",
    "signer_keys",
    "key_revocations",
    "receipts",
    "receipt_subjects",
    "approvals",
)

# BIGINT everywhere, but INTEGER on SQLite so that an integer primary key is the rowid (faster lookups).
BigInt = BigInteger().with_variant(Integer(), "sqlite")


class UtcDateTime(TypeDecorator[datetime]):
    """Timestamps stored as UTC and read back timezone-aware (SQLite keeps no zone of its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; pass a timezone-aware one")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class LogMeta(Base):
    """One row: the log's origin line and the verifier key of its checkpoint signer."""

    __tablename__ = "log_meta"
    __table_args__ = (CheckConstraint("id = 1", name="log_meta_single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    origin: Mapped[str] = mapped_column(Text)
    vkey: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class LogEntry(Base):
    """The log itself: gapless `idx` from 0, the exact entry bytes and their RFC 9162 leaf hash."""

    __tablename__ = "log_entries"
    __table_args__ = (
        CheckConstraint(
            "kind IN ('receipt', 'approval', 'key-trust', 'key-revoke')", name="log_entries_kind"
        ),
        CheckConstraint("idx >= 0", name="log_entries_idx_nonnegative"),
    )

    idx: Mapped[int] = mapped_column(BigInt, primary_key=True, autoincrement=False)
    kind: Mapped[str] = mapped_column(String(16))
    # Receipts and approvals: canonical DSSE envelope bytes. Key entries: a canonical JSON record.
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    leaf_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class MerkleNode(Base):
    """Every complete aligned subtree (level 0 = a leaf), so proofs need O(log n) reads."""

    __tablename__ = "merkle_nodes"

    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    node_index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))


class CheckpointRow(Base):
    """A C2SP signed checkpoint note for every tree size, signed by the log key after each append."""

    __tablename__ = "checkpoints"

    size: Mapped[int] = mapped_column(BigInt, primary_key=True, autoincrement=False)
    root: Mapped[bytes] = mapped_column(LargeBinary(32))
    note: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class SignerKey(Base):
    """A key trusted to sign receipts, from the key-trust entry at `trusted_at_idx`."""

    __tablename__ = "signer_keys"

    keyid: Mapped[str] = mapped_column(String(64), primary_key=True)
    algorithm: Mapped[str] = mapped_column(String(16))
    public_pem: Mapped[str] = mapped_column(Text)
    note: Mapped[str] = mapped_column(Text, default="")
    trusted_at_idx: Mapped[int] = mapped_column(BigInt, ForeignKey("log_entries.idx"), unique=True)


class KeyRevocation(Base):
    """A revocation is its own row (UPDATE is forbidden): from `revoked_at_idx` on, the key signs nothing."""

    __tablename__ = "key_revocations"

    keyid: Mapped[str] = mapped_column(String(64), ForeignKey("signer_keys.keyid"), primary_key=True)
    revoked_at_idx: Mapped[int] = mapped_column(BigInt, ForeignKey("log_entries.idx"), unique=True)
    reason: Mapped[str] = mapped_column(Text, default="")


class ReceiptRow(Base):
    """Query view of a receipt entry; `id` is the sha256 hex of the stored envelope bytes."""

    __tablename__ = "receipts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    log_idx: Mapped[int] = mapped_column(BigInt, ForeignKey("log_entries.idx"), unique=True)
    verdict: Mapped[str] = mapped_column(String(16), index=True)
    target: Mapped[str] = mapped_column(Text)
    host: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    keyid: Mapped[str] = mapped_column(String(64))
    predicate: Mapped[dict[str, Any]] = mapped_column(JSON)


class ReceiptSubject(Base):
    """One row per subject digest of a receipt (`sha256:<hex>`), so lookups by subject use an index."""

    __tablename__ = "receipt_subjects"

    receipt_id: Mapped[str] = mapped_column(String(64), ForeignKey("receipts.id"), primary_key=True)
    digest: Mapped[str] = mapped_column(String(200), primary_key=True, index=True)
    name: Mapped[str] = mapped_column(Text)


class ApprovalRow(Base):
    """Query view of a rollout decision; `id` is the sha256 hex of the stored envelope bytes."""

    __tablename__ = "approvals"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    log_idx: Mapped[int] = mapped_column(BigInt, ForeignKey("log_entries.idx"), unique=True)
    subject: Mapped[str] = mapped_column(String(200), index=True)
    decision: Mapped[str] = mapped_column(String(16))
    policy_digest: Mapped[str] = mapped_column(String(200))
    receipt_ids: Mapped[list[str]] = mapped_column(JSON)
    reasons: Mapped[list[str]] = mapped_column(JSON)
    keyid: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class LogRepair(Base):
    """An owner's repair (`qualify log repair`): rows beyond the last good signed checkpoint were removed,
    and this row, written in the same transaction, says how many and the digest of the saved evidence.
    Append-only; the writer role may read it but not write it."""

    __tablename__ = "log_repairs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    repaired_at: Mapped[datetime] = mapped_column(UtcDateTime)
    kept_size: Mapped[int] = mapped_column(BigInteger)
    removed_entries: Mapped[int] = mapped_column(BigInteger)
    removed_rows: Mapped[int] = mapped_column(BigInteger)
    evidence_sha256: Mapped[str] = mapped_column(String(71))
    by_role: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)


class PendingEntry(Base):
    """An entry a host submitted (a signed receipt or approval), waiting for the sequencer to give it a
    log index. A queue: the sequencer deletes the row in the transaction that integrates or refuses it."""

    __tablename__ = "pending_entries"
    __table_args__ = (
        CheckConstraint("kind IN ('receipt', 'approval')", name="pending_entries_kind"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigInt, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    digest: Mapped[str] = mapped_column(String(64), index=True)  # sha256 hex of the bytes: the entry's id
    submitted_at: Mapped[datetime] = mapped_column(UtcDateTime)
    submitter: Mapped[str] = mapped_column(Text)


class PendingRefusal(Base):
    """Why the sequencer refused a submitted entry (append-only): the host waiting for it is told."""

    __tablename__ = "pending_refusals"

    pending_id: Mapped[int] = mapped_column(BigInt, primary_key=True, autoincrement=False)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    problem: Mapped[str] = mapped_column(Text)
    refused_at: Mapped[datetime] = mapped_column(UtcDateTime)
