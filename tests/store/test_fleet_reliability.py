"""Where issue 23's fleet roles meet issue 27's trusted reads and bounded repair: a host that holds only
the log's verifier key (keys/log.vkey) reads with that key as its trust and may not repair the log (the
repair is signed by the log key: the sequencer's act); a log's origin and its checkpoint key name (equal
to it for new logs) are chosen under the writer lock, so concurrent first uses agree on both."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.commands._common import load_log_signer
from receipts.checkpoint import NoteSigner, open_checkpoint
from receipts.keys import SigningKey
from receipts.store import Store
from receipts.testing import append_synthetic, synthetic_envelope
from tests.store.test_insert_guards import _forged_append


def _become_host(home, vkey: str) -> None:
    """This machine keeps only the log's verifier key, as a fleet host does."""
    (home / "keys" / "log.key").unlink()
    (home / "keys" / "log.vkey").write_text(vkey + "\n")


def test_a_host_with_only_the_verifier_key_reads_with_it_and_may_not_repair(
    cli, home, sqlite_url, raw_sqlite, tmp_path
) -> None:
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    with Store.open(sqlite_url, log_signer=load_log_signer(create=False)) as store:
        rid = append_synthetic(store, SigningKey.load(home / "keys" / "operator.key"), 2)[0]
        size = store.size()
    vkey = cli("log", "vkey", "--db", sqlite_url).out.strip()
    _become_host(home, vkey)
    assert cli("receipts", "verify", rid, "--db", sqlite_url).code == 0
    assert cli("receipts", "verify", "--all", "--db", sqlite_url).code == 0
    _forged_append(raw_sqlite, size)
    before = raw_sqlite.counts()
    refused = cli("log", "repair", "--db", sqlite_url, "--evidence", tmp_path / "e", "--reason", "junk")
    assert refused.code == 2, refused.err
    assert len(refused.err.strip().splitlines()) == 1
    assert "only the log's verifier key" in refused.err and "sequencer" in refused.err
    assert raw_sqlite.counts() == before and not (tmp_path / "e").exists()
    # The forged row is not served: the reads go on from the last good checkpoint and say so.
    listed = cli("receipts", "verify", "--all", "--db", sqlite_url)
    assert "beyond the last checkpoint" in listed.err


def test_a_host_whose_verifier_key_is_another_logs_serves_nothing(cli, home, sqlite_url) -> None:
    """The verifier key the host holds is the trust, not the key the database records."""
    assert cli("keys", "generate", "--db", sqlite_url).code == 0
    with Store.open(sqlite_url, log_signer=load_log_signer(create=False)) as store:
        rid = append_synthetic(store, SigningKey.load(home / "keys" / "operator.key"), 1)[0]
    origin = store.origin
    assert origin is not None
    other = NoteSigner(origin, Ed25519PrivateKey.generate()).vkey()
    _become_host(home, other)
    result = cli("receipts", "verify", rid, "--db", sqlite_url)
    assert result.code == 1
    shown = cli("receipts", "show", rid, "--db", sqlite_url)
    assert shown.code == 1 and "no stored checkpoint verifies" in shown.err


def test_concurrent_first_uses_agree_on_the_origin_and_the_key_name(sqlite_url, operator) -> None:
    key = Ed25519PrivateKey.generate()
    first = Store.open(sqlite_url)
    second = Store.open(sqlite_url)
    try:
        # Both open the empty store before either appends, each with an origin of its own in mind.
        first.set_log_signer(NoteSigner("qualify.local/a", key), new_origin="qualify.local/a/1111")
        second.set_log_signer(NoteSigner("qualify.local/a", key), new_origin="qualify.local/a/2222")
        first.trust_key(operator.public_key(), "operator")
        second.append_receipt(synthetic_envelope(operator, 0))
        assert first.origin == second.origin == "qualify.local/a/1111"
        assert second.log_signer is not None and second.log_signer.name == "qualify.local/a/1111"
        note = second.latest_checkpoint()
        meta = second.meta(refresh=True)
        assert meta is not None and meta[1].split("+")[0] == meta[0] == "qualify.local/a/1111"
        assert open_checkpoint(note, [second.log_signer.verifier()], meta[0]).size == 2
        assert second.good_head().size == 2
    finally:
        first.close()
        second.close()
