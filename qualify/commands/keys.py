"""`qualify keys`: make signing keys, and trust or revoke them in the log (both are log entries)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from qualify import settings
from qualify.commands._common import (
    console,
    db_option,
    emit,
    json_option,
    open_append,
    open_read,
    opened,
    short,
    store_errors,
    warn_served,
    write_file,
)
from qualify.errors import UsageError
from receipts import keys as keylib
from receipts.errors import KeyFileError
from receipts.keys import SigningKey, VerifyingKey
from receipts.records import KeyInfo


def _key_json(info: KeyInfo) -> dict:
    return info.to_json()


def _print_key(verb: str, info: KeyInfo) -> None:
    console.print(
        f"{verb} {info.algorithm} key {info.keyid} at log index {info.revoked_at or info.trusted_at}"
    )


@click.group("keys")
def keys() -> None:
    """Signing keys: generate, list, export, trust, revoke."""


@keys.command("generate")
@click.option("--algorithm", type=click.Choice(keylib.ALGORITHMS), default="ed25519", show_default=True)
@click.option("--out", "out", type=click.Path(dir_okay=False), help="Key file (default: the operator key).")
@click.option("--trust/--no-trust", default=True, show_default=True, help="Trust the new key in the log.")
@click.option("--note", default="", help="A note stored with the trust entry.")
@db_option
@json_option
@store_errors
def generate(
    algorithm: str, out: str | None, trust: bool, note: str, db_url: str | None, as_json: bool
) -> None:
    """Create a private key (mode 0600) and, by default, trust its public half in the log."""
    path = Path(out) if out else settings.default_key_path()
    if path.exists():
        raise KeyFileError(f"key file {path} already exists; refusing to overwrite it (choose --out)")
    key = keylib.generate(algorithm)
    # Open the store before writing the key: an unreachable database leaves nothing behind.
    store = open_append(db_url) if trust else None
    try:
        key.save(path)
        info = store.trust_key(key.public_key(), note or f"generated as {path}") if store else None
    finally:
        if store is not None:
            store.close()
    data = {
        "keyid": key.keyid,
        "algorithm": key.algorithm,
        "path": str(path),
        "public_pem": key.public_key().public_pem().decode(),
        "trusted_at": info.trusted_at if info else None,
    }

    def human() -> None:
        console.print(f"wrote {algorithm} private key {path} (mode 0600), keyid {key.keyid}")
        if info:
            console.print(f"trusted it in the log at index {info.trusted_at}")

    emit(as_json, data, human)


@keys.command("list")
@db_option
@json_option
@store_errors
def list_(db_url: str | None, as_json: bool) -> None:
    """Every key the log has trusted, with its revocation if any."""
    with opened(open_read(db_url)) as store:
        infos = store.signer_keys()
        warn_served(store)

    def human() -> None:
        # A pipe (a script that feeds `keys revoke`) gets whole key ids on unfolded rows; a terminal gets
        # a 16-digit prefix (which `keys revoke` accepts), never folded.
        piped = not console.is_terminal
        table = Table("keyid", "algorithm", "status", "trusted at", "revoked at", "note")
        table.columns[0].no_wrap = True
        for info in infos:
            revoked = "" if info.revoked_at is None else f"{info.revoked_at} ({info.reason})"
            keyid = info.keyid if piped else short(info.keyid)
            table.add_row(keyid, info.algorithm, info.status, str(info.trusted_at), revoked, info.note)
        out = Console(highlight=False, width=max(console.width, 200)) if piped else console
        out.print(table if infos else "no keys in the log yet; add one with: qualify keys generate")

    emit(as_json, [_key_json(i) for i in infos], human)


@keys.command("export-public")
@click.argument("keyid", required=False)
@click.option("--key", "key_path", type=click.Path(dir_okay=False), help="A private key file to export from.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the PEM here instead of stdout.")
@db_option
@store_errors
def export_public(keyid: str | None, key_path: str | None, out: str | None, db_url: str | None) -> None:
    """Print a public key (PEM): a key in the log by KEYID, or the public half of --key (default: the
    operator key)."""
    if keyid and key_path:
        raise UsageError("give either KEYID or --key, not both")
    if keyid:
        with opened(open_read(db_url)) as store:
            pem = store.key(keyid).public_pem.encode()
    else:
        pem = (
            SigningKey.load(Path(key_path) if key_path else settings.default_key_path())
            .public_key()
            .public_pem()
        )
    if out:
        write_file(out, pem)
        console.print(f"wrote {out}")
    else:
        click.echo(pem.decode(), nl=False)


@keys.command("trust")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--note", default="", help="A note stored with the trust entry.")
@db_option
@json_option
@store_errors
def trust(file: str, note: str, db_url: str | None, as_json: bool) -> None:
    """Trust a public key (PEM) to sign receipts from the next log entry on."""
    key = VerifyingKey.load(file)
    with opened(open_append(db_url)) as store:
        info = store.trust_key(key, note or f"trusted from {file}")
    emit(as_json, _key_json(info), lambda: _print_key("trusted", info))


@keys.command("revoke")
@click.argument("keyid")
@click.option("--reason", default="", help="Why (stored in the log).")
@db_option
@json_option
@store_errors
def revoke(keyid: str, reason: str, db_url: str | None, as_json: bool) -> None:
    """Revoke a key: receipts it signed before stay valid, later ones are refused."""
    with opened(open_append(db_url, create=False)) as store:
        info = store.revoke_key(keyid, reason)
    emit(as_json, _key_json(info), lambda: _print_key("revoked", info))
