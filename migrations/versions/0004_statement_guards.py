"""Statement-level insert guards on PostgreSQL: the same rules as 0002/0003, judged once per statement.

Revision ID: 0004_statement_guards
Revises: 0003_sequencer
Create Date: 2026-12-03

The guards of 0002 (changed by 0003 for batches) are row-level BEFORE INSERT triggers: the sequencer's
batch of 256 receipts fires them more than a thousand times (entries, Merkle subtrees, receipts,
subjects), each a PL/pgSQL call with its own lookups. Measured on the 2-core machine (8 hosts, 8,000
receipts), they cost about a quarter of the sequencer's throughput. Here each guarded table gets one
AFTER INSERT ... FOR EACH STATEMENT trigger with a transition table (`REFERENCING NEW TABLE AS
new_rows`), which judges all rows of the statement in a few set queries against the table as the
statement left it. The rules are those of 0003, restated for a set of rows:
- log_entries: the rows are contiguous and start right after the entries before them (the log was
  gapless before the statement, and primary keys are unique, so it is gapless after); every leaf hash is
  the RFC 9162 hash of its bytes.
- checkpoints: the size is the log's size (and not 0).
- merkle_nodes: each subtree is completed by an entry not sealed yet (its last leaf at or after the
  latest checkpoint's size, before the log's end); a leaf is its entry's leaf hash; an inner node is the
  hash of its two children.
- receipts, approvals, receipt_subjects, signer_keys, key_revocations: rows of an entry not sealed yet,
  of the right kind, saying what the entry says; ids are the sha256 of the entry's bytes.
- log_meta: only while the log has no entry.
A NULL field now fails a comparison (IS DISTINCT FROM) where 0002 let it pass. The deferred constraint
trigger that refuses to commit an entry no checkpoint covers stays row-level (PostgreSQL has no
statement-level constraint triggers); it is one index lookup per entry, at commit.

A statement that inserts into several tables at once (a writable CTE) is judged on the state it leaves,
which is a state the same rows inserted one statement per table would reach or be refused at.
SQLite keeps its triggers of 0002/0003: nothing changes there.
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0004_statement_guards"
down_revision = "0003_sequencer"
branch_labels = None
depends_on = None

# The tables 0002 guards (the same nine: this migration replaces each one's guard).
GUARDED = importlib.import_module("migrations.versions.0002_insert_guards").GUARDED

# n: the log's size; s: the latest checkpoint's size (rows of entries s..n-1 are being appended).
_SIZES = """
    SELECT coalesce(max(idx) + 1, 0) INTO n FROM log_entries;
    SELECT coalesce(max(size), 0) INTO s FROM checkpoints;
"""


def _refuse(table: str, message: str, *args: str) -> str:
    joined = "".join(f", {a}" for a in args)
    return (
        f"        RAISE EXCEPTION '{table}: {message}'{joined}\n"
        "            USING ERRCODE = 'check_violation';\n"
    )


# table -> the body after _SIZES: each check selects one offending row INTO bad and raises if FOUND.
_BODIES = {
    "log_meta": """
    IF n > 0 THEN
"""
    + _refuse("log_meta", "the log already has % entries; its identity is fixed", "n")
    + """    END IF;
""",
    "log_entries": """
    SELECT min(idx) AS lo, max(idx) AS hi, count(*) AS cnt INTO bad FROM new_rows;
    IF bad.cnt = 0 THEN
        RETURN NULL;
    END IF;
    IF bad.hi - bad.lo + 1 <> bad.cnt
       OR bad.lo <> coalesce((SELECT max(idx) FROM log_entries WHERE idx < bad.lo), -1) + 1 THEN
"""
    + _refuse(
        "log_entries",
        "indexes % to % are not the next ones after %: the log is gapless",
        "bad.lo",
        "bad.hi",
        "coalesce((SELECT max(idx) FROM log_entries WHERE idx < bad.lo), -1)",
    )
    + """    END IF;
    SELECT idx INTO bad FROM new_rows
        WHERE leaf_hash IS DISTINCT FROM sha256('\\x00'::bytea || envelope) LIMIT 1;
    IF FOUND THEN
"""
    + _refuse("log_entries", "the leaf hash of entry % is not the hash of its bytes", "bad.idx")
    + """    END IF;
""",
    "checkpoints": """
    SELECT size INTO bad FROM new_rows WHERE size <> n OR n = 0 LIMIT 1;
    IF FOUND THEN
"""
    + _refuse("checkpoints", "size % is not the log size %", "bad.size", "n")
    + """    END IF;
""",
    "merkle_nodes": """
    SELECT level, node_index INTO bad FROM new_rows WHERE level < 0 OR level > 62 LIMIT 1;
    IF FOUND THEN
"""
    + _refuse("merkle_nodes", "level % is not a tree level", "bad.level")
    + """    END IF;
    SELECT level, node_index, ((node_index + 1) << level::int) - 1 AS last INTO bad FROM new_rows
        WHERE ((node_index + 1) << level::int) - 1 < s OR ((node_index + 1) << level::int) - 1 >= n
        LIMIT 1;
    IF FOUND THEN
"""
    + _refuse(
        "merkle_nodes",
        "subtree (level %, index %) ends at entry %, which is not one being appended (% to %)",
        "bad.level",
        "bad.node_index",
        "bad.last",
        "s",
        "n - 1",
    )
    + """    END IF;
    SELECT r.node_index INTO bad FROM new_rows AS r LEFT JOIN log_entries AS e ON e.idx = r.node_index
        WHERE r.level = 0 AND r.hash IS DISTINCT FROM e.leaf_hash LIMIT 1;
    IF FOUND THEN
"""
    + _refuse("merkle_nodes", "leaf % is not the leaf hash of its entry", "bad.node_index")
    + """    END IF;
    SELECT r.level, r.node_index INTO bad FROM new_rows AS r
        LEFT JOIN merkle_nodes AS a ON a.level = r.level - 1 AND a.node_index = 2 * r.node_index
        LEFT JOIN merkle_nodes AS b ON b.level = r.level - 1 AND b.node_index = 2 * r.node_index + 1
        WHERE r.level > 0
          AND r.hash IS DISTINCT FROM sha256('\\x01'::bytea || a.hash || b.hash) LIMIT 1;
    IF FOUND THEN
"""
    + _refuse(
        "merkle_nodes",
        "subtree (level %, index %) is not the hash of its children",
        "bad.level",
        "bad.node_index",
    )
    + """    END IF;
""",
    "receipt_subjects": """
    SELECT r.receipt_id INTO bad FROM new_rows AS r
        WHERE NOT EXISTS (SELECT 1 FROM receipts WHERE id = r.receipt_id AND log_idx >= s) LIMIT 1;
    IF FOUND THEN
"""
    + _refuse("receipt_subjects", "receipt % is not one being appended", "bad.receipt_id")
    + """    END IF;
""",
}

for _table, _kind in (("receipts", "receipt"), ("approvals", "approval")):
    _BODIES[_table] = (
        f"""
    SELECT r.id, r.log_idx INTO bad FROM new_rows AS r LEFT JOIN log_entries AS e ON e.idx = r.log_idx
        WHERE r.log_idx < s OR r.log_idx >= n OR e.kind IS DISTINCT FROM '{_kind}'
           OR r.id IS DISTINCT FROM encode(sha256(e.envelope), 'hex')
        LIMIT 1;
    IF FOUND THEN
"""
        + _refuse(
            _table, "row % is not entry % being appended (% to %)", "bad.id", "bad.log_idx", "s", "n - 1"
        )
        + """    END IF;
"""
    )

# Key rows: (table, the column naming their entry, its kind, {record field: column}).
_KEY_ROWS = (
    ("signer_keys", "trusted_at_idx", "key-trust",
     {"keyid": "keyid", "publicKey": "public_pem", "note": "note", "algorithm": "algorithm"}),
    ("key_revocations", "revoked_at_idx", "key-revoke", {"keyid": "keyid", "reason": "reason"}),
)  # fmt: skip
for _table, _at, _kind, _fields in _KEY_ROWS:
    _says = "".join(f"\n           OR rec.j->>'{f}' IS DISTINCT FROM r.{c}" for f, c in _fields.items())
    _BODIES[_table] = (
        f"""
    SELECT r.keyid, r.{_at} AS at INTO bad FROM new_rows AS r
        LEFT JOIN log_entries AS e ON e.idx = r.{_at}
        LEFT JOIN LATERAL (SELECT convert_from(e.envelope, 'UTF8')::jsonb AS j) AS rec ON true
        WHERE r.{_at} < s OR r.{_at} >= n OR e.kind IS DISTINCT FROM '{_kind}'{_says}
        LIMIT 1;
    IF FOUND THEN
"""
        + _refuse(_table, f"row for key % is not what {_kind} entry % says", "bad.keyid", "bad.at")
        + """    END IF;
"""
    )


def _function(table: str) -> str:
    return (
        f"CREATE FUNCTION qualify_guard_{table}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "DECLARE\n    n bigint;\n    s bigint;\n    bad record;\nBEGIN"
        f"{_SIZES}{_BODIES[table]}    RETURN NULL;\nEND\n$$"
    )


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite keeps its row triggers (0002, 0003)
    assert set(_BODIES) == set(GUARDED), sorted(set(GUARDED) ^ set(_BODIES))
    for table in GUARDED:
        op.execute(f"DROP TRIGGER {table}_insert_guard ON {table}")
        op.execute(_function(table))
        # The same trigger name as 0002's, so tooling that lists or drops the insert guards still finds them.
        op.execute(
            f"CREATE TRIGGER {table}_insert_guard AFTER INSERT ON {table} "
            "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
            f"EXECUTE FUNCTION qualify_guard_{table}()"
        )
        op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {table}_insert_guard")
    op.execute("DROP FUNCTION qualify_insert_guard()")


def downgrade() -> None:
    raise RuntimeError("the insert guards protect the log; restore from a backup instead of downgrading")
