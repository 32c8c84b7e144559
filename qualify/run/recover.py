"""Close runs whose harness was killed (SIGKILL, a lost machine): sign an `aborted: harness killed` receipt
from what their run directory holds, so no run is lost. `qualify run` and `qualify gc` close them."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qualify import settings
from qualify.run import receipt as rc
from qualify.run import rundir
from receipts.keys import SigningKey
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
