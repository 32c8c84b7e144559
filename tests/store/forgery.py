"""A whole append forged by a member of the writer role (or anyone who can write the SQLite file): the entry,
the Merkle subtrees it completes, its query rows and a checkpoint signed by a note key that is not the
log's, all in one transaction, as the store itself would write them. The insert guards cannot tell it
from a real append; only the checkpoint's signature can."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from receipts import dsse, merkle
from receipts.checkpoint import Checkpoint, NoteSigner, sign_checkpoint
from receipts.keylog import trust_record
from receipts.keys import SigningKey
from receipts.models import Base
from receipts.receipt import parse_receipt
from receipts.subtrees import SqlSubtrees
from receipts.testing import synthetic_envelope

NOW = datetime(2026, 1, 1, tzinfo=UTC).replace(tzinfo=None)


def forged_append(
    raw: Any,
    kind: str,
    data: bytes,
    rows: list[tuple[str, dict[str, Any]]],
    origin: str,
    note_signer: NoteSigner | None = None,
) -> int:
    """Append `data` as the next entry with its query `rows` (table, values; `idx` filled in) and a
    checkpoint of the true new root signed by `note_signer` (default: a fresh key under the log's own
    origin); returns the entry's index."""
    signer = note_signer or NoteSigner(origin, Ed25519PrivateKey.generate())
    leaf = merkle.leaf_hash(data)
    with raw.engine.begin() as conn:
        if raw.dialect == "postgresql":
            conn.execute(sa.text("SET LOCAL ROLE qualify_writer"))
        n = conn.execute(sa.text("SELECT coalesce(max(idx) + 1, 0) FROM log_entries")).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO log_entries (idx, kind, envelope, leaf_hash, created_at) "
                "VALUES (:n, :k, :e, :h, :t)"
            ),
            {"n": n, "k": kind, "e": data, "h": leaf, "t": NOW},
        )
        reader = SqlSubtrees(conn)
        nodes = merkle.new_subtrees(n, leaf, reader)
        for level, index, digest in nodes:
            conn.execute(
                sa.text("INSERT INTO merkle_nodes (level, node_index, hash) VALUES (:l, :i, :h)"),
                {"l": level, "i": index, "h": digest},
            )
        reader.add(nodes)
        for table, values in rows:
            values = {key: (n if value == "IDX" else value) for key, value in values.items()}
            conn.execute(sa.insert(Base.metadata.tables[table]), values)
        root = merkle.root_from(reader, n + 1)
        note = sign_checkpoint(Checkpoint(origin, n + 1, root), signer)
        conn.execute(
            sa.text("INSERT INTO checkpoints (size, root, note, created_at) VALUES (:s, :r, :note, :t)"),
            {"s": n + 1, "r": root, "note": note, "t": NOW},
        )
    return n


def receipt_rows(data: bytes, keyid: str) -> list[tuple[str, dict[str, Any]]]:
    parsed = parse_receipt(data)
    row = parsed.row(0, keyid)
    row = {**row, "log_idx": "IDX"}
    subjects = [
        ("receipt_subjects", {"receipt_id": parsed.id, "digest": s.digest, "name": s.name})
        for s in parsed.subjects
    ]
    return [("receipts", row), *subjects]


def forged_receipt(raw: Any, origin: str, signer: SigningKey, name_keyid: str, n: int = 77) -> str:
    """A receipt signed by `signer` but naming `name_keyid`, appended by a forged append; returns its id."""
    envelope = synthetic_envelope(signer, n)
    envelope["signatures"] = [{**s, "keyid": name_keyid} for s in envelope["signatures"]]
    data = dsse.envelope_bytes(envelope)
    forged_append(raw, "receipt", data, receipt_rows(data, name_keyid), origin)
    return parse_receipt(data).id


def forged_key_trust(raw: Any, origin: str, key: SigningKey) -> None:
    """A key-trust entry for `key` (with its signer_keys row), appended by a forged append."""
    public = key.public_key()
    data = trust_record(public, "forged", datetime.now(UTC))
    row = {
        "keyid": public.keyid,
        "algorithm": public.algorithm,
        "public_pem": public.public_pem().decode("ascii"),
        "note": "forged",
        "trusted_at_idx": "IDX",
    }
    forged_append(raw, "key-trust", data, [("signer_keys", row)], origin)
