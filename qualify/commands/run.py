"""`qualify run`: boot an engine build, prove it behaves as qualified, sign and store the receipt.

Exit 0 qualified, 1 rejected or aborted (the receipt is stored), 2 bad input (nothing written).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from qualify import settings
from qualify.errors import UsageError
from qualify.run.request import (
    KDA_BACKENDS,
    LAUNCHERS,
    PRESETS,
    RunRequest,
    backend_refusal,
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


# What a check is doing while it runs, for the live view (the long ones say so).
STEP_NOTES = {
    "boot": "starting the engine and waiting for its ready line",
    "backend": "profiling a step; a second engine must refuse a bogus backend",
    "layout": "a peer process imports every KV allocation",
    "capture": "capturing CUDA graphs",
    "reload": "reloading the weights in place and taking the census (minutes for proxy on a CPU)",
    "generation": "greedy generation before and after reload",
}


class LiveReporter:
    """On a terminal: one table that updates in place (the running check with its elapsed seconds and what it
    is doing). Elsewhere (a pipe, a log file): one plain line per finished check, and a plain progress line
    every `plain_every_s` while a check runs that long (a proxy reload census takes minutes on a CPU)."""

    def __init__(self, console: Console, plain_every_s: float = 30.0) -> None:
        self.console = console
        self.plain_every_s = plain_every_s
        self.rows: list[tuple[str, str, float, str | None]] = []
        self.current: tuple[str, float] | None = None
        self._live: Live | None = None
        self._ticking: threading.Event | None = None

    def _table(self) -> Table:
        table = Table(show_edge=False)
        table.add_column("check")
        table.add_column("status")
        table.add_column("seconds", justify="right")
        table.add_column("reason", overflow="fold")
        for name, status, seconds, reason in self.rows:
            style = STATUS_STYLE.get(status, "white")
            table.add_row(name, f"[{style}]{status}[/]", f"{seconds:.2f}", escape(reason or ""))
        if self.current is not None:
            name, t0 = self.current
            note = STEP_NOTES.get(name, "")
            table.add_row(
                name, "[cyan]running[/]", f"{time.monotonic() - t0:.1f}", f"[dim]{escape(note)} …[/]"
            )
        return table

    def check_started(self, name: str) -> None:
        self.current = (name, time.monotonic())
        if not self.console.is_terminal:
            self._tick(name)
        elif self._live is None:
            self._live = Live(
                get_renderable=self._table, console=self.console, refresh_per_second=4, transient=False
            )
            self._live.start()

    def _tick(self, name: str) -> None:
        """Plain output: say every `plain_every_s` that the check still runs, and what it is doing."""
        stop = self._ticking = threading.Event()
        t0 = time.monotonic()

        def loop() -> None:
            while not stop.wait(self.plain_every_s):
                note = STEP_NOTES.get(name, "")
                line = f"  {name:<11}still running after {time.monotonic() - t0:.0f} s: {note}"
                self.console.print(line, markup=False, highlight=False)

        threading.Thread(target=loop, name="run-progress", daemon=True).start()

    def _untick(self) -> None:
        if self._ticking is not None:
            self._ticking.set()
            self._ticking = None

    def check_finished(self, name: str, status: str, seconds: float, reason: str | None) -> None:
        self._untick()
        self.current = None
        self.rows.append((name, status, seconds, reason))
        if self._live is not None:
            self._live.refresh()
            return
        tail = f"  {reason}" if reason and status != "pass" else ""
        self.console.print(f"  {name:<11}{status:<6}{seconds:7.2f} s{tail}", markup=False, highlight=False)

    def note(self, message: str) -> None:
        self.console.print(message, highlight=False)

    def close(self) -> None:
        self._untick()
        self.current = None
        if self._live is not None:
            self._live.stop()
            self._live = None


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
    no_sandbox: bool = False,
    engine_env: tuple[str, ...] = (),
    fail_fast: bool = False,
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
    target = _target_before_boot(launcher, gpus_v)
    if launcher == "local" and gpus_v is not None and target == "cpu":
        raise UsageError(
            f"--gpus {gpus_v}: this host has no CUDA GPU the local engine could use (nvidia-smi lists none, "
            "or CUDA_VISIBLE_DEVICES hides them); drop --gpus"
        )
    why = backend_refusal(kda_backend, target, launcher, dict(os.environ))
    if why:
        raise UsageError(why)
    from qualify.launch.sandbox import SandboxUnavailable, find_bwrap, parse_engine_env

    try:
        added = parse_engine_env(list(engine_env))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if launcher == "local" and not no_sandbox:
        try:
            find_bwrap()  # a host that cannot sandbox the engine is refused, unless the operator says so
        except SandboxUnavailable as exc:
            raise UsageError(str(exc)) from exc
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
        sandbox=not no_sandbox,
        engine_env=tuple(sorted(added.items())),
        fail_fast=fail_fast,
    )


def _target_before_boot(launcher: str, gpus: str | None) -> str:
    """The target as the harness knows it before boot (the pipeline decides it again, from NVML too): a
    container sees a GPU only when --gpus asks; a local engine sees the host's unless CUDA_VISIBLE_DEVICES
    hides them all (the local launcher applies --gpus as CUDA_VISIBLE_DEVICES)."""
    if launcher == "docker":
        return "gpu" if gpus else "cpu"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return "gpu" if not hidden and host_has_cuda_gpu() else "cpu"


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
@click.option(
    "--engine-env",
    multiple=True,
    metavar="K=V",
    help="Add a variable to the engine's environment (repeatable; recorded in the receipt).",
)
@click.option(
    "--no-sandbox",
    is_flag=True,
    help="Run a local engine as your own process, unsandboxed (recorded; fleet policies deny it).",
)
@click.option(
    "--fail-fast",
    is_flag=True,
    help="Stop at the first check that does not pass; the rest are not run (recorded; never qualified).",
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
        _close_leftovers(console, req, store, key)
        console.print(
            f"qualify run: {req.launcher} launcher, preset {req.preset}, backend {req.kda_backend}, "
            f"spec {req.spec}, layout {','.join(map(str, req.layout)) if req.layout else 'any'}"
        )
        reporter = LiveReporter(console)
        try:
            result = Pipeline(req, store, key, reporter).run()
        finally:
            reporter.close()
    finally:
        store.close()
    elapsed = time.monotonic() - t0
    if req.json_output:
        click.echo(json.dumps({**result.summary(), "wall_seconds": round(elapsed, 3)}, indent=2))
    else:
        _print_verdict(console, result, elapsed)
    ctx.exit(0 if result.verdict == "qualified" else 1)


def _close_leftovers(console: Console, req: RunRequest, store, key) -> None:  # type: ignore[no-untyped-def]
    """What an earlier harness killed by SIGKILL left: its run gets an aborted receipt, its containers go."""
    from qualify.run.recover import close_abandoned, reconcile_kept

    for r in close_abandoned(store, key.key, req.db_url):
        console.print(
            f"closed run {r.run_dir} whose harness was killed: aborted receipt {r.receipt_id} "
            f"(log index {r.log_idx})"
        )
    for k in reconcile_kept(store, req.db_url):  # receipts an earlier run kept because the store refused
        if k.log_idx is not None:
            console.print(f"stored receipt {k.receipt_id} kept in {k.run_dir} (log index {k.log_idx})")
        else:
            console.print(
                f"receipt {k.receipt_id} kept in {k.run_dir} is not in the store ({k.problem}); "
                f"append it with: {k.command}"
            )
    if req.launcher == "docker":
        from qualify.launch.docker import reap_orphans

        for name in reap_orphans():
            console.print(f"removed container {name}: its harness is gone")


def _print_verdict(console: Console, result, elapsed: float) -> None:  # type: ignore[no-untyped-def]
    """The checks are already on screen (the live table, or a line each): the verdict and its reasons."""
    style = VERDICT_STYLE.get(result.verdict, "bold")
    console.print(
        f"verdict [{style}]{result.verdict}[/] (target {result.target}) in {elapsed:.1f} s — "
        f"receipt {result.receipt_id} (log index {result.log_idx})"
    )
    for r in result.reasons:
        console.print(f"  [dim]{escape(r)}[/]")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
