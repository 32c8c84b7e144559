"""Roles of a fleet log: hosts submit with only their operator key, the one sequencer integrates the queue
in batches under one signed checkpoint per batch, and a host gets its index and a proof it checks with
the log's verifier key. A failed (killed) batch leaves nothing half-written and loses nothing."""

from __future__ import annotations

import pytest

from receipts import dsse, keys, sequencer
from receipts.store import Store
from receipts.testing import synthetic_envelope
from receipts.verify import verify_log


def _bytes(key: keys.SigningKey, n: int) -> bytes:
    return dsse.envelope_bytes(synthetic_envelope(key, n))


def test_hosts_submit_and_one_sequencer_signs_one_checkpoint_per_batch(
    store, operator, log_signer, db_url
) -> None:
    with Store.open(db_url) as host:  # no log key at all
        with pytest.raises(Exception, match="checkpoint key"):
            host.append_receipt(synthetic_envelope(operator, 0))
        submitted = [sequencer.submit(host, "receipt", _bytes(operator, n)) for n in range(300)]
        stranger = sequencer.submit(host, "receipt", _bytes(keys.generate(), 1000))
        checkpoints_before = store.counts()["checkpoints"]
        first = sequencer.integrate(store, batch=256)
        second = sequencer.integrate(store, batch=256)
        assert (first.integrated, first.refused, first.size) == (256, 0, 257)
        assert (second.integrated, second.refused, second.size) == (44, 1, 301)
        assert store.counts()["checkpoints"] == checkpoints_before + 2
        assert sequencer.queued(store) == 0
        # Gapless, in submission order; each host learns its index and checks its proof itself.
        assert [sequencer.wait_sequenced(host, s, 1) for s in submitted] == list(range(1, 301))
        report = sequencer.proven(host, submitted[7].digest, log_signer.verifier())
        assert report.ok and report.checkpoint_size == 301
        with pytest.raises(sequencer.Refused, match="not by a trusted key"):
            sequencer.wait_sequenced(host, stranger, 1)
    assert verify_log(store, verifiers=[log_signer.verifier()]).size == 301


def test_a_host_waits_a_bounded_time_and_its_entry_stays_queued(store, operator, db_url) -> None:
    with Store.open(db_url) as host:
        waiting = sequencer.submit(host, "receipt", _bytes(operator, 1))
        with pytest.raises(sequencer.NotSequenced, match="was not sequenced within 0.2s; it stays queued"):
            sequencer.wait_sequenced(host, waiting, 0.2)
    sequencer.integrate(store)
    assert sequencer.wait_sequenced(store, waiting, 1) == 1


def test_a_batch_that_dies_midway_leaves_nothing_and_loses_nothing(
    store, operator, log_signer, db_url, monkeypatch
) -> None:
    with Store.open(db_url) as host:
        submitted = [sequencer.submit(host, "receipt", _bytes(operator, n)) for n in range(20)]
    before = store.counts()
    real = store._append

    def dies(pending, **kwargs):  # the sequencer is killed after writing the batch, before its commit
        def after(conn, refused):
            kwargs_after(conn, refused)
            raise KeyboardInterrupt

        kwargs_after = kwargs["after"]
        return real(pending, **{**kwargs, "after": after})

    monkeypatch.setattr(store, "_append", dies)
    with pytest.raises(KeyboardInterrupt):
        sequencer.integrate(store)
    assert store.counts() == before and sequencer.queued(store) == 20
    monkeypatch.setattr(store, "_append", real)
    assert sequencer.integrate(store).integrated == 20
    assert [sequencer.wait_sequenced(store, s, 1) for s in submitted] == list(range(1, 21))
    verify_log(store, verifiers=[log_signer.verifier()])


def test_a_duplicate_submission_is_refused_and_the_first_stands(store, operator, db_url) -> None:
    data = _bytes(operator, 3)
    with Store.open(db_url) as host:
        a, b = sequencer.submit(host, "receipt", data), sequencer.submit(host, "receipt", data)
    assert sequencer.integrate(store).integrated == 1
    assert sequencer.wait_sequenced(store, a, 1) == sequencer.wait_sequenced(store, b, 1) == 1


def test_a_host_never_trusts_its_own_key_and_cannot_trust_any(
    store, log_signer, db_url, tmp_path, monkeypatch
):
    """On a fleet host (no log key) the first run's operator key is not trusted by the run itself, and
    trusting or revoking keys is refused there: it is the administrator's act, where the log key is."""
    from qualify.errors import UsageError
    from qualify.run.operator import load_key

    monkeypatch.setenv("QUALIFY_HOME", str(tmp_path / "host"))
    with Store.open(db_url) as host:
        host.set_host(log_signer.verifier())
        before = host.size()
        with pytest.raises(UsageError, match="not trusted by this fleet log; an administrator trusts it"):
            load_key(host, None)
        with pytest.raises(Exception, match="an administrator's act"):
            host.trust_key(keys.generate().public_key())
        assert host.size() == before
        # Once the administrator trusted it, the same key appends through the sequencer.
        key = keys.SigningKey.load(tmp_path / "host" / "keys" / "operator.key")
        store.trust_key(key.public_key(), "host")
        assert load_key(host, None).newly_trusted is False
        host.lock_timeout_s = 0.1  # no sequencer runs: the host gives up after its bound
        with pytest.raises(sequencer.NotSequenced, match="stays queued"):
            host.append_receipt(synthetic_envelope(key, 1))
        sequencer.integrate(store)  # the sequencer comes back: the queued receipt is placed
        assert sequencer.queued(store) == 0 and store.size() == before + 2
        assert host.find_receipts()[0][0].keyid == key.keyid


def test_a_host_refuses_a_store_whose_log_key_is_not_the_one_it_holds(store, db_url) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from receipts.checkpoint import NoteSigner
    from receipts.errors import StoreError

    other = NoteSigner(store.origin, Ed25519PrivateKey.generate())
    with Store.open(db_url) as host, pytest.raises(StoreError, match="is not this store's"):
        host.set_host(other.verifier())
