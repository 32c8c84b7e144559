"""Reconciliation of receipts kept on disk (qualify.run.recover.reconcile_kept): a finished run's signed
receipt that the store lacks is appended; one the store holds, one of a run still holding its lock, and one
that belongs in another store are left alone; one the store refuses is listed with the command."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.run import rundir
from qualify.run.recover import reconcile_kept
from receipts import dsse, keys
from receipts.checkpoint import NoteSigner
from receipts.store import Store
from receipts.testing import synthetic_envelope


def _run_dir(runs: Path, name: str, store: str, envelope: dict) -> Path:
    d = runs / name
    d.mkdir(parents=True)
    (d / rundir.REQUEST).write_text(json.dumps({"request": {}, "store": store, "started_at": "x"}))
    (d / rundir.RECEIPT).write_bytes(dsse.envelope_bytes(envelope))
    return d


def test_kept_receipts_the_store_lacks_are_appended_and_the_rest_left_alone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    operator, stranger = keys.generate(), keys.generate()
    runs = tmp_path / "runs"
    with Store.open(url, log_signer=NoteSigner("qualify.test/log", Ed25519PrivateKey.generate())) as store:
        store.trust_key(operator.public_key())
        held = store.append_receipt(synthetic_envelope(operator, 1))
        label = rundir.store_label(url)
        _run_dir(runs, "a-held", label, synthetic_envelope(operator, 1))
        lost = _run_dir(runs, "b-lost", label, synthetic_envelope(operator, 2))
        live = _run_dir(runs, "c-live", label, synthetic_envelope(operator, 3))
        _run_dir(runs, "d-other", "sqlite:///elsewhere.db", synthetic_envelope(operator, 4))
        refused = _run_dir(runs, "e-refused", label, synthetic_envelope(stranger, 5))
        fd = os.open(live / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # its harness still runs: it appends its own receipt
        try:
            out = reconcile_kept(store, url, runs)
        finally:
            os.close(fd)
        by_dir = {Path(r.run_dir).name: r for r in out}
        assert set(by_dir) == {"b-lost", "e-refused"}
        assert by_dir["b-lost"].log_idx == 2 and store.get_receipt(by_dir["b-lost"].receipt_id)
        assert by_dir["e-refused"].log_idx is None and "not by a trusted key" in (
            by_dir["e-refused"].problem or ""
        )
        assert (
            by_dir["e-refused"].command == f"qualify receipts import {refused / rundir.RECEIPT} --db {label}"
        )
        assert lost.exists() and held.log_idx == 1
        # Once appended, a kept receipt is not appended again.
        assert [Path(r.run_dir).name for r in reconcile_kept(store, url, runs)] == ["c-live", "e-refused"]
