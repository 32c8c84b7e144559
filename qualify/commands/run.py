"""`qualify run`: boot an engine build, prove it behaves as qualified, sign and store the receipt.

Exit 0 qualified, 1 rejected or aborted (the receipt is stored), 2 bad input (nothing written).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qualify import settings
from qualify.errors import UsageError
from qualify.run.request import (
    KDA_BACKENDS,
    LAUNCHERS,
    PRESETS,
    RunRequest,
    parse_dcp,
    parse_gpus,
    parse_layout,
    parse_mem_limit,
    parse_spec,
    parse_timeout,
)

DEFAULT_TIMEOUT_S = 600.0
STATUS_STYLE = {"pass": "green", "fail": "red", "error": "red", "skip": "yellow"}
VERDICT_STYLE = {"qualified": "bold green", "rejected": "bold red", "aborted": "bold yellow"}


def host_has_cuda_gpu() -> bool:
    """`nvidia-smi -L` lists a GPU (never torch: the harness does not import it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


class RichReporter:
    """One line per check: a spinner while it runs, then its status and seconds."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._status = None

    def check_started(self, name: str) -> None:
        self._status = self.console.status(f"[bold]{name}[/] …", spinner="dots")
        self._status.start()

    def check_finished(self, name: str, status: str, seconds: float, reason: str | None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        style = STATUS_STYLE.get(status, "white")
        tail = f"  [dim]{escape(reason)}[/]" if reason and status != "pass" else ""
        self.console.print(f"  {name:<11}[{style}]{status:<6}[/]{seconds:7.2f} s{tail}", highlight=False)

    def note(self, message: str) -> None:
        self.console.print(message, highlight=False)


def build_request(
    layout: str | None,
    kda_backend: str,
    spec: str,
    preset: str | None,
    launcher: str,
    image: str | None,
    gpus: str | None,
    mem_limit: str | None,
    db: str | None,
    key: str | None,
    timeout: float | None,
    as_json: bool,
    dcp: int | None = None,
) -> RunRequest:
    """Validate every option; UsageError (exit 2) before anything is booted or written."""
    num_spec = parse_spec(spec)
    gpus_v = parse_gpus(gpus)
    timeout_v = parse_timeout(timeout)
    mem_v = parse_mem_limit(mem_limit)
    if preset is None:
        gpu_visible = launcher == "local" or gpus_v is not None
        preset = "proxy" if gpu_visible and host_has_cuda_gpu() else "tiny"
    layout_v = parse_layout(layout, preset)
    dcp_v = parse_dcp(dcp)
    if launcher == "docker" and not image:
        raise UsageError(
            "--launcher docker needs --image REF; build a CPU image with docker/build-cpu-image.sh"
        )
    if key and not Path(key).is_file():
        raise UsageError(f"key file {key} does not exist; create one with: qualify keys generate")
    if key:
        _check_key_file(key)
    if launcher == "local" and (image or mem_v):
        raise UsageError("--image and --mem-limit apply to --launcher docker only")
    return RunRequest(
        layout=layout_v,
        kda_backend=kda_backend,
        spec="none" if num_spec == 0 else f"mtp:{num_spec}",
        num_spec=num_spec,
        preset=preset,
        launcher=launcher,
        image=image,
        gpus=gpus_v,
        timeout_s=timeout_v or DEFAULT_TIMEOUT_S,
        mem_limit=mem_v,
        db_url=db or settings.default_db_url(),
        key_path=key or "",
        json_output=as_json,
        dcp=dcp_v,
    )


def _check_key_file(path: str) -> None:
    """A key file that cannot be used is bad input: found before the store is opened (and so created)."""
    from receipts import keys
    from receipts.errors import ReceiptsError

    try:
        keys.SigningKey.load(Path(path))
    except ReceiptsError as exc:
        raise UsageError(exc.diagnostics()) from exc


@click.command("run")
@click.option(
    "--layout", default=None, metavar="SPANS", help="Comma-separated KV spans the engine must register."
)
@click.option("--kda-backend", type=click.Choice(KDA_BACKENDS), default="auto", show_default=True)
@click.option(
    "--dcp",
    type=int,
    default=None,
    metavar="N",
    help="Run the DCP shards as N engine ranks (torch.distributed); default: folded in one process.",
)
@click.option("--spec", default="none", show_default=True, metavar="none|mtp:N", help="Speculative decoding.")
@click.option(
    "--preset", type=click.Choice(PRESETS), default=None, help="Default: proxy with a CUDA GPU, else tiny."
)
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="local", show_default=True)
@click.option("--image", default=None, metavar="REF", help="Engine image (docker launcher).")
@click.option(
    "--gpus", default=None, metavar="all|0,1", help="GPUs the engine may use (docker: device requests)."
)
@click.option("--mem-limit", default=None, metavar="SIZE", help="Container memory limit, e.g. 2g (docker).")
@click.option(
    "--db",
    default=None,
    metavar="URL",
    help="Store URL (default: $QUALIFY_DB_URL, else the SQLite file in the data dir).",
)
@click.option(
    "--key", default=None, metavar="PATH", help="Operator signing key (default: created on first use)."
)
@click.option(
    "--timeout", type=float, default=None, metavar="S", help=f"Whole-run limit [{DEFAULT_TIMEOUT_S:g} s]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the receipt summary as JSON.")
@click.pass_context
def run(ctx: click.Context, **opts: object) -> None:
    """Boot the engine, run the checks, sign and store the receipt; exit 0 only if qualified."""
    req = build_request(**opts)  # type: ignore[arg-type]
    console = Console(stderr=req.json_output, highlight=False, soft_wrap=True)
    t0 = time.monotonic()

    from qualify.run.operator import load_key, open_store
    from qualify.run.pipeline import Pipeline

    if req.launcher == "docker":  # an unreachable daemon or a missing image is bad input: nothing written
        from qualify.launch.docker import check_image

        check_image(req.image or "")
    store = open_store(req.db_url)
    try:
        key = load_key(store, req.key_path or None)
        if key.created:
            console.print(
                f"created signing key {key.path} (keyid {key.key.keyid[:16]}) and trusted it in the store"
            )
        elif key.newly_trusted:
            console.print(f"trusted signing key {key.path} (keyid {key.key.keyid[:16]}) in the store")
        console.print(
            f"qualify run: {req.launcher} launcher, preset {req.preset}, backend {req.kda_backend}, "
            f"spec {req.spec}, layout {','.join(map(str, req.layout)) if req.layout else 'any'}"
        )
        result = Pipeline(req, store, key, RichReporter(console)).run()
    finally:
        store.close()
    elapsed = time.monotonic() - t0
    if req.json_output:
        click.echo(json.dumps({**result.summary(), "wall_seconds": round(elapsed, 3)}, indent=2))
    else:
        _print_table(console, result, elapsed)
    ctx.exit(0 if result.verdict == "qualified" else 1)


def _print_table(console: Console, result, elapsed: float) -> None:  # type: ignore[no-untyped-def]
    table = Table(title=None, show_edge=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("seconds", justify="right")
    table.add_column("reason", overflow="fold")
    for c in result.checks:
        style = STATUS_STYLE.get(c["status"], "white")
        table.add_row(
            c["name"], f"[{style}]{c['status']}[/]", f"{c['seconds']:.2f}", escape(c["reason"] or "")
        )
    console.print(table)
    style = VERDICT_STYLE.get(result.verdict, "bold")
    console.print(
        f"verdict [{style}]{result.verdict}[/] (target {result.target}) in {elapsed:.1f} s — "
        f"receipt {result.receipt_id} (log index {result.log_idx})"
    )
    for r in result.reasons:
        console.print(f"  [dim]{escape(r)}[/]")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
