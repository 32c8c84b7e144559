"""`qualify log repair` can only cut what is provably bad: another key than the log's is refused (both
named), a cut below a checkpoint the log key signed (or to nothing) needs the owner to confirm the size,
and every repair is recorded in a note signed by the log key outside the database, so that deleting its
`log_repairs` row is found by `log verify`."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.commands._common import load_log_signer
from receipts.checkpoint import NoteSigner
from receipts.errors import StoreError, TamperError
from receipts.repair import repair
from receipts.store import Store
from receipts.testing import append_synthetic
from receipts.verify import verify_log
from tests.store.test_insert_guards import _forged_append


def _url(store: Store) -> str:
    return store.engine.url.render_as_string(hide_password=False)


def test_a_repair_with_another_key_is_refused_naming_both_and_removes_nothing(
    store: Store, operator, raw, log_signer, tmp_path
) -> None:
    append_synthetic(store, operator, 3)
    before = raw.counts()
    other = NoteSigner(log_signer.name, Ed25519PrivateKey.generate())
    with pytest.raises(StoreError, match="is not this log's key") as caught:
        repair(_url(store), other, tmp_path / "e.jsonl", "typo", notes_dir=tmp_path / "notes")
    assert other.vkey() in str(caught.value) and log_signer.vkey() in str(caught.value)
    assert raw.counts() == before and not (tmp_path / "e.jsonl").exists()
    assert verify_log(store).ok and store.size() == 4


def _damage_nodes(raw, where: str) -> None:
    """What a superuser can do: lift the triggers and rewrite stored subtrees, so that the stored tree no
    longer matches the checkpoints the log key signed over it."""
    raw.drop_triggers()
    raw.execute(f"UPDATE merkle_nodes SET hash = :h WHERE {where}", h=bytes(32))


def test_a_repair_that_would_cut_below_a_signed_checkpoint_needs_the_size_confirmed(
    store: Store, operator, raw, log_signer, tmp_path
) -> None:
    append_synthetic(store, operator, 2)  # 3 entries; subtree (1, 0) is in the roots of sizes 2 and 3
    _damage_nodes(raw, "level = 1 AND node_index = 0")
    before = raw.counts()
    notes = tmp_path / "notes"
    with pytest.raises(StoreError, match="signed a checkpoint of size 3.*--keep-size 1"):
        repair(_url(store), log_signer, tmp_path / "e.jsonl", "x", notes_dir=notes)
    with pytest.raises(StoreError, match="--keep-size 2 is not what the repair would keep"):
        repair(_url(store), log_signer, tmp_path / "e.jsonl", "x", notes_dir=notes, keep_size=2)
    assert raw.counts() == before and not notes.exists()
    report = repair(_url(store), log_signer, tmp_path / "e.jsonl", "x", notes_dir=notes, keep_size=1)
    assert report is not None and report.kept_size == 1 and report.note.exists()


def test_a_repair_that_would_keep_nothing_is_refused(
    store: Store, operator, raw, log_signer, tmp_path
) -> None:
    append_synthetic(store, operator, 2)
    _damage_nodes(raw, "level >= 0")
    before = raw.counts()
    with pytest.raises(StoreError, match="keep only 0 of 3 entries"):
        repair(_url(store), log_signer, tmp_path / "e.jsonl", "x", notes_dir=tmp_path / "n")
    assert raw.counts() == before


def test_deleting_the_record_of_a_repair_is_found_by_log_verify(
    store: Store, operator, raw, log_signer, tmp_path
) -> None:
    append_synthetic(store, operator, 2)
    _forged_append(raw, 3)
    notes = tmp_path / "notes"
    report = repair(_url(store), log_signer, tmp_path / "e.jsonl", "junk", notes_dir=notes)
    assert report is not None and report.kept_size == 3
    assert verify_log(store, log_signer=log_signer, notes_dir=notes).ok
    raw.drop_triggers()
    raw.execute("DELETE FROM log_repairs")
    with pytest.raises(TamperError, match="has no log_repairs row: the record of a repair was deleted"):
        verify_log(store, log_signer=log_signer, notes_dir=notes)
    # ... and a log_repairs row without its signed note, after a signed repair and where the log key is,
    # is no repair of its owner (a row older than the first signed note is one made before notes existed).
    raw.execute(
        "INSERT INTO log_repairs (id, repaired_at, kept_size, removed_entries, removed_rows, "
        "evidence_sha256, by_role, reason) VALUES (1, :t, 3, :e, :r, :d, 'r', 'junk')",
        t=store.entry(0).created_at,
        e=report.removed_entries,
        r=report.removed_rows,
        d=report.evidence_sha256,
    )
    assert verify_log(store, log_signer=log_signer, notes_dir=notes).ok
    raw.execute(
        "INSERT INTO log_repairs (id, repaired_at, kept_size, removed_entries, removed_rows, "
        "evidence_sha256, by_role, reason) VALUES (2, :t, 3, 0, 0, 'sha256:x', 'r', 'x')",
        t=store.entry(0).created_at,
    )
    with pytest.raises(TamperError, match="repair 2 has no note signed by the log key"):
        verify_log(store, log_signer=log_signer, notes_dir=notes)


def test_log_repair_through_the_cli_refuses_another_vkey_and_verify_needs_its_note(
    cli, home, sqlite_url, raw_sqlite, tmp_path
) -> None:
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    other = NoteSigner("qualify.test/other", Ed25519PrivateKey.generate()).vkey()
    refused = cli(
        "log", "repair", "--db", sqlite_url, "--evidence", tmp_path / "e", "--reason", "x", "--vkey", other
    )
    assert refused.code == 2 and other in refused.err and "nothing removed" in refused.err
    _forged_append(raw_sqlite, 1)
    assert cli("log", "verify", "--db", sqlite_url).code == 1
    done = cli(
        "log", "repair", "--db", sqlite_url, "--evidence", tmp_path / "e", "--reason", "junk", "--json"
    )
    assert done.code == 0, done.err
    note = json.loads(done.out)["note"]
    assert note.startswith(str(home / "log-repairs"))
    assert cli("log", "verify", "--db", sqlite_url).code == 0
    raw_sqlite.drop_triggers()
    raw_sqlite.execute("DELETE FROM log_repairs")
    gone = cli("log", "verify", "--db", sqlite_url)
    assert gone.code == 1 and "the record of a repair was deleted" in gone.err
    assert load_log_signer(create=False) is not None


def test_receipts_verify_exits_1_for_an_edited_query_row(cli, home, sqlite_url, raw_sqlite) -> None:
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    from receipts import keys

    with Store.open(sqlite_url, log_signer=load_log_signer(create=False)) as store:
        rid = append_synthetic(store, keys.SigningKey.load(home / "keys" / "operator.key"), 1)[0]
    assert cli("receipts", "verify", rid, "--db", sqlite_url).code == 0
    raw_sqlite.drop_triggers()
    with raw_sqlite.engine.begin() as conn:
        conn.execute(sa.text("UPDATE receipts SET verdict = 'rejected' WHERE id = :i"), {"i": rid})
    result = cli("receipts", "verify", rid, "--db", sqlite_url, "--json")
    assert result.code == 1
    assert json.loads(result.out)[0]["checks"]["query_row"] is False
