"""`qualify serve`: the read API over the store (see qualify.api); POST /v1/decisions needs a bearer token."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import click

from qualify.commands._common import (
    db_option,
    log_verifiers,
    open_append,
    open_read,
    opened,
    store_errors,
    vkey_option,
)
from qualify.errors import UsageError

TOKEN_ENV = "QUALIFY_API_TOKEN"
MIN_TOKEN_LENGTH = 16
MAX_TOKEN_FILE_BYTES = 4096
# On SIGTERM, requests in flight get this long to finish (a decision's evaluation budget is 20 s).
SHUTDOWN_GRACE_S = 5


def _check_private(path: Path) -> None:
    """Refuse a token file that others can read or write, as ssh does with private keys."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # reading it says why
    if stat.S_IMODE(mode) & 0o077:
        raise UsageError(
            f"token file {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"anyone on this host could write to the log with it: chmod 600 {path}"
        )


def read_token(token_file: str | None) -> str | None:
    """The API token from --token-file, else $QUALIFY_API_TOKEN, else None (decisions disabled)."""
    if token_file:
        _check_private(Path(token_file))
        try:
            with open(token_file, "rb") as handle:
                token = handle.read(MAX_TOKEN_FILE_BYTES + 1).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read the token file {token_file}: {exc}") from None
        source = f"token file {token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
        source = f"${TOKEN_ENV}"
    # A short token can be guessed; the route it guards writes to the log.
    if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_FILE_BYTES or any(c.isspace() for c in token):
        raise UsageError(
            f"the API token from {source} must be at least {MIN_TOKEN_LENGTH} characters "
            f"(at most {MAX_TOKEN_FILE_BYTES}) without spaces; make one with: openssl rand -hex 32"
        )
    return token


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Port.")
@db_option
@click.option(
    "--token-file",
    default=None,
    metavar="FILE",
    help=f"Bearer token for POST /v1/decisions (or ${TOKEN_ENV}).",
)
@click.option("--key", "key_path", default=None, metavar="PATH", help="Key that signs recorded decisions.")
@vkey_option
@click.option(
    "--sequencer",
    is_flag=True,
    help="Also run the log's sequencer here (this machine must hold the log key): see qualify log sequence.",
)
@store_errors
def serve(
    host: str,
    port: int,
    db_url: str | None,
    token_file: str | None,
    key_path: str | None,
    vkey: str | None,
    sequencer: bool,
) -> None:
    """Serve receipts, proofs, checkpoints and approvals over HTTP (OpenAPI at /docs, /redoc and
    /openapi.json; the docs pages need no network). The --token-file must be private (chmod 600).

    Exit codes: 0 stopped by a signal, 2 bad input (a busy or unusable --host/--port, no store, a bad
    token file)."""
    import uvicorn

    from qualify.api import create_app
    from qualify.commands.approve import load_signing_key

    token = read_token(token_file)
    # Read-only unless decisions are enabled; then the log key is needed to append them.
    store = open_append(db_url, create=False) if token is not None else open_read(db_url)
    with opened(store):
        key = load_signing_key(store, key_path) if token is not None else None
        # POST /v1/decisions verifies with the trust `qualify approve` uses: --vkey, else the local log key.
        verifiers, source = log_verifiers(store, vkey)
        # Bind here, before uvicorn starts: a busy port is one line and exit 2 (bad input), not uvicorn's
        # log lines and its exit 3. The bound socket is the one uvicorn serves on (no window between).
        listening = listen(host, port)
        if token is None:
            click.echo(f"decisions disabled: no --token-file or ${TOKEN_ENV}; serving read-only", err=True)
        else:
            click.echo(f"decisions verify checkpoints with {source}", err=True)
        config = uvicorn.Config(
            create_app(store, token=token, signing_key=key, verifiers=verifiers),
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        with listening:
            if sequencer:
                import threading

                from qualify.commands.log import run_sequencer

                # Its own store and connections; a batch cut short when the server exits is rolled back.
                threading.Thread(target=run_sequencer, args=(db_url,), name="sequencer", daemon=True).start()
            uvicorn.Server(config).run(sockets=[listening])


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; UsageError (exit 2) when the address is in use or not ours."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=2048)
    except OSError as error:
        why = os.strerror(error.errno) if error.errno else str(error)
        raise UsageError(
            f"cannot listen on {host}:{port}: {why}; choose another --port or stop what holds it"
        ) from None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return socket.AF_INET  # binding says why
