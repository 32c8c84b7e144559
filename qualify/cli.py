"""The `qualify` command line: one root group; each command family lives in qualify/commands/."""

from __future__ import annotations

import importlib
import sys

import click

from qualify import __version__
from qualify.errors import QualifyError

# (module under qualify.commands, attribute): each is a click command or group.
COMMANDS: list[tuple[str, str]] = [
    ("run", "run"),
    ("keys", "keys"),
    ("receipts", "receipts"),
    ("log", "log"),
    ("db", "db"),
    ("approve", "approve"),
    ("serve", "serve"),
    ("audit", "audit"),
    ("gc", "gc"),
    ("offline", "verify_proof"),
    ("offline", "verify_consistency"),
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qualify")
def cli() -> None:
    """Qualify an inference-engine build and keep signed, tamper-evident receipts."""


def _register() -> None:
    for module, attr in COMMANDS:
        try:
            mod = importlib.import_module(f"qualify.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"qualify.commands.{module}":
                continue  # not built yet
            raise
        cli.add_command(getattr(mod, attr))


_register()


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [QualifyError]
    try:
        from receipts.errors import ReceiptsError

        types.append(ReceiptsError)
    except ImportError:
        pass
    return tuple(types)


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
