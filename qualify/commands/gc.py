"""`qualify gc`: clean up after harnesses that were killed: aborted receipts for their runs, signed receipts
kept on disk that the store did not take appended, their containers removed, shared-memory files of dead
engines swept."""

from __future__ import annotations

import click

from qualify.commands._common import console, db_option, emit, json_option, resolve_db, store_errors


@click.command("gc")
@db_option
@click.option("--key", default=None, metavar="PATH", help="Operator signing key (default: the run default).")
@click.option("--no-docker", is_flag=True, help="Do not look for containers (no Docker daemon is asked).")
@json_option
@store_errors
def gc(db_url: str | None, key: str | None, no_docker: bool, as_json: bool) -> None:
    """Close runs whose harness was killed, store receipts kept on disk that the store lacks, remove dead
    harnesses' containers, sweep dead engines' shm files."""
    from qualify.errors import QualifyError
    from qualify.run.operator import load_key, open_store
    from qualify.run.recover import close_abandoned, reconcile_kept
    from qualify.shm import sweep_stale_shm

    url = resolve_db(db_url)
    store = open_store(url)
    try:
        closed = close_abandoned(store, load_key(store, key).key, url)
        reconciled = reconcile_kept(store, url)
    finally:
        store.close()
    containers: list[str] = []
    docker_note = "not asked (--no-docker)"
    if not no_docker:
        from qualify.launch.docker import reap_orphans

        try:
            containers = reap_orphans()
            docker_note = "asked"
        except QualifyError as exc:  # no daemon here: nothing of ours can run there either
            docker_note = f"not reachable ({str(exc).split(' (')[0]})"
    swept = sweep_stale_shm()
    data = {
        "closed_runs": [
            {"run_dir": r.run_dir, "receipt_id": r.receipt_id, "log_index": r.log_idx} for r in closed
        ],
        "reconciled_receipts": [r.to_json() for r in reconciled],
        "removed_containers": containers,
        "docker": docker_note,
        "removed_shm_files": swept,
    }

    def human() -> None:
        for r in closed:
            console.print(f"closed {r.run_dir}: aborted receipt {r.receipt_id} (log index {r.log_idx})")
        for r in reconciled:
            if r.log_idx is not None:
                console.print(f"stored receipt {r.receipt_id} kept in {r.run_dir} (log index {r.log_idx})")
            else:
                console.print(
                    f"receipt {r.receipt_id} kept in {r.run_dir} is not in the store ({r.problem}); "
                    f"append it with: {r.command}"
                )
        for name in containers:
            console.print(f"removed container {name}: its harness is gone")
        console.print(
            f"{len(closed)} runs closed, {len(containers)} containers removed (docker {docker_note}), "
            f"{len(swept)} shared-memory files removed"
        )

    emit(as_json, data, human)
