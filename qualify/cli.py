"""The `qualify` command line: one root group; each command family lives in qualify/commands/."""

from __future__ import annotations

import importlib
import sys

import click

from qualify import __version__
from qualify.errors import QualifyError

# name -> (module under qualify.commands, attribute, the short help `qualify --help` lists). A command's
# module is imported only when that command runs (or its own --help is asked for): importing all of them
# (SQLAlchemy, pydantic, the API) took about a second before any command could start. The short help is
# written here (tests/store/test_lazy_commands.py checks that every name resolves to its command).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("run", "run", "Boot the engine, run the checks, sign and store the receipt."),
    "keys": ("keys", "keys", "Signing keys: generate, list, export, trust, revoke."),
    "receipts": ("receipts", "receipts", "Stored receipts: list, show, verify, prove, bundle, export, …"),
    "log": ("log", "log", "The Merkle log: checkpoints and whole-log verification."),
    "db": ("db", "db", "The store's database schema (Alembic migrations)."),
    "approve": ("approve", "approve", "Approve or deny the rollout of a build from its receipts."),
    "serve": ("serve", "serve", "Serve receipts, proofs, checkpoints and approvals over HTTP."),
    "audit": ("audit", "audit", "Reports for auditors."),
    "gc": ("gc", "gc", "Close runs whose harness was killed; remove their leftovers."),
    "verify-proof": ("offline", "verify_proof", "Verify a receipt offline from its proof and envelope."),
    "verify-consistency": ("offline", "verify_consistency", "Verify offline that the log only grew."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use; `--help` lists them from COMMANDS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        command = getattr(importlib.import_module(f"qualify.commands.{module}"), attr)
        self.add_command(command, name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx) if name in COMMANDS]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qualify")
def cli() -> None:
    """Qualify an inference-engine build and keep signed, tamper-evident receipts.

    Exit codes: 0 done (qualified, approved, verified), 1 a completed run that does not qualify, a denial,
    or a verification that found a problem, 2 bad input or a decision that could not be made (nothing
    written)."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    from receipts.errors import ReceiptsError  # small: no third-party imports

    return (QualifyError, ReceiptsError)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        rv = cli.main(args=argv, prog_name="qualify", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2 if exc.exit_code == 2 or isinstance(exc, click.UsageError) else exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _user_error_types() as exc:
        msg = exc.diagnostics() if hasattr(exc, "diagnostics") else str(exc)
        click.echo(f"error: {msg}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    else:
        # With standalone_mode=False click returns a ctx.exit(code) as the return value.
        sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
