"""Close runs whose harness was killed (SIGKILL, a lost machine): sign an `aborted: harness killed` receipt
from what their run directory holds, so no run is lost; and reconcile signed receipts that a run kept on
disk because the store did not take them (a held lock, a lost connection). `qualify run` and `qualify gc`
do both."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qualify import settings
from qualify.run import receipt as rc
from qualify.run import rundir
from receipts.db import LockTimeout
from receipts.keys import SigningKey
from receipts.models import ReceiptRow
from receipts.statement import config_digest
from receipts.store import Store

KILLED = "aborted: harness killed"


@dataclass(frozen=True)
class Recovered:
    run_dir: str
    receipt_id: str
    log_idx: int


def _fallback_engine(request: dict[str, Any]) -> dict[str, Any]:
    config = {
        "preset": request.get("preset"),
        "kda_decode_backend": request.get("kda_backend"),
        "num_spec": 0 if request.get("spec") in (None, "none") else int(str(request["spec"]).split(":")[1]),
        "described": False,
    }
    return {
        "name": "qualify-engine",
        "version": None,
        "image_digest": None,
        "code_digest": rc.engine_code_digest_on_disk(),
        "config_digest": config_digest(config),
        "config": config,
    }


def _predicate(run_dir: Path, saved: dict[str, Any], progress: dict[str, Any]) -> tuple[Any, list[Any]]:
    request = saved["request"]
    started = datetime.fromisoformat(saved["started_at"])
    # The last sign of life: the progress file's time (never before the start).
    mtimes = [p.stat().st_mtime for p in (run_dir / rundir.PROGRESS, run_dir / rundir.REQUEST) if p.exists()]
    finished = max(started, datetime.fromtimestamp(max(mtimes), UTC))
    checks = [dict(c) for c in progress.get("checks", [])]
    current = progress.get("current")
    who = saved.get("harness", {})
    killed = f"{KILLED} (pid {who.get('pid', '?')} on {who.get('host', '?')}); closed by pid {os.getpid()}"
    # The kill is recorded on the check it interrupted; killed between two checks, on an entry of its own.
    if current and all(c["name"] != current for c in checks):
        where = current
    else:
        where = "harness" if checks else "boot"
    checks.append({"name": where, "status": "error", "evidence": {}, "seconds": 0.0, "reason": killed})
    engine = progress.get("engine") or _fallback_engine(request)
    faults = {
        "restart_count": int(progress.get("restart_count", 0)),
        "xid_events": [],
        "xid_watch": "unavailable",
        "xid_watch_reason": f"{KILLED}: its watchers ended with it",
        "engine_dead": False,
    }
    versions = {"harness": str(saved.get("qualify_version", "unknown"))}
    predicate = rc.build_predicate(
        request=request,
        engine=engine,
        backend=progress.get("backend"),
        layout=progress.get("layout"),
        checks=checks,
        faults=faults,
        verdict="aborted",
        target=progress.get("target") or "cpu",
        gpu=[],
        driver=None,
        versions=versions,
        started_at=started,
        finished_at=finished,
    )
    subjects = rc.subjects(engine, progress.get("identity") or {}, progress.get("weights_digest"))
    return predicate, subjects


def close_abandoned(
    store: Store, key: SigningKey, store_url: str, runs: Path | None = None
) -> list[Recovered]:
    """Sign and append an aborted receipt for every abandoned run directory that belongs to this store."""
    runs = runs or settings.data_dir() / "runs"
    label = rundir.store_label(store_url)
    done: list[Recovered] = []
    for d in rundir.abandoned(runs):
        fd = rundir.take(d)
        if fd is None:
            continue  # its harness still runs (or another process is closing it)
        try:
            saved, progress = rundir.read(d)
            if saved.get("store") != label:
                continue  # its receipt belongs in another store: `qualify gc --db` that store
            predicate, subjects = _predicate(d, saved, progress)
            record, _ = rc.sign_and_append(store, key, predicate, subjects, save_to=d / rundir.RECEIPT)
            done.append(Recovered(str(d), record.id, record.log_idx))
        except (OSError, ValueError, KeyError) as exc:  # unreadable evidence: say so, keep the directory
            (d / "recover-error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return done


# A kept receipt is a few kilobytes; anything larger is not one the harness wrote.
MAX_KEPT_RECEIPT_BYTES = 4 << 20
RECONCILE_LOCK_WAIT_S = 2.0


@dataclass(frozen=True)
class Reconciled:
    """A signed receipt kept in a run dir that the store did not hold: appended now (`log_idx`), or not,
    with why and the exact command that appends it."""

    run_dir: str
    receipt_id: str
    log_idx: int | None = None
    problem: str | None = None
    command: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "receipt_id": self.receipt_id,
            "log_index": self.log_idx,
            "problem": self.problem,
            "command": self.command,
        }


def _finished(run_dir: Path) -> bool:
    """No harness holds the run's lock any more (a run still going appends its own receipt)."""
    try:
        fd = os.open(run_dir / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _stored(store: Store, ids: list[str]) -> set[str]:
    import sqlalchemy as sa

    found: set[str] = set()
    with store.engine.connect() as conn:
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            found.update(conn.execute(sa.select(ReceiptRow.id).where(ReceiptRow.id.in_(chunk))).scalars())
    return found


def reconcile_kept(store: Store, store_url: str, runs: Path | None = None) -> list[Reconciled]:
    """Append every signed receipt kept in a finished run dir of this store (`receipt.dsse.json`) that the
    store does not hold; one that cannot be appended (or belongs in another store) is listed with the
    exact command that appends it. Receipts the store holds already are left alone."""
    runs = runs or settings.data_dir() / "runs"
    label = rundir.store_label(store_url)
    kept: list[tuple[Path, bytes, str, str]] = []  # (dir, bytes, id, store label)
    with contextlib.suppress(OSError):
        for d in sorted(runs.iterdir()):
            path = d / rundir.RECEIPT
            if not path.is_file() or not _finished(d):
                continue
            try:
                data = path.read_bytes()[: MAX_KEPT_RECEIPT_BYTES + 1]
                saved = rundir.read(d)[0] if (d / rundir.REQUEST).is_file() else {}
            except (OSError, ValueError):
                continue
            if len(data) > MAX_KEPT_RECEIPT_BYTES:
                continue
            kept.append((d, data, hashlib.sha256(data).hexdigest(), str(saved.get("store") or label)))
    if not kept:
        return []
    held = _stored(store, [rid for _, _, rid, _ in kept])
    out: list[Reconciled] = []
    # A writer holding the lock must not stall the run or gc for each kept receipt: a short wait, and after
    # one that timed out the rest are only listed.
    saved_wait, store.lock_timeout_s = store.lock_timeout_s, RECONCILE_LOCK_WAIT_S
    try:
        out = _append_kept(store, label, kept, held)
    finally:
        store.lock_timeout_s = saved_wait
    return out


def _append_kept(
    store: Store, label: str, kept: list[tuple[Path, bytes, str, str]], held: set[str]
) -> list[Reconciled]:
    out: list[Reconciled] = []
    blocked: str | None = None
    for d, data, rid, belongs in kept:
        if rid in held:
            continue
        if belongs != label:
            continue  # another store's receipt: `qualify gc --db` that store reconciles it
        command = f"qualify receipts import {shlex.quote(str(d / rundir.RECEIPT))}"
        if label != rundir.store_label(settings.default_db_url()):
            command += f" --db {shlex.quote(label)}"
        if blocked is not None:
            out.append(Reconciled(str(d), rid, None, blocked, command))
            continue
        try:
            record = store.append_receipt(data)
        except Exception as exc:  # ReceiptsError or a driver's: the receipt stays on disk, named
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if isinstance(exc, LockTimeout):
                blocked = line
            out.append(Reconciled(str(d), rid, None, line, command))
            continue
        out.append(Reconciled(str(d), record.id, record.log_idx))
    return out
