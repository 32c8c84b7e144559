"""The operator's side of a run: open the store for appends (with the log's checkpoint key) and load the
signing key, creating and trusting it on first use. Both happen before the engine boots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualify import settings
from qualify.errors import StoreUnavailable, UsageError
from receipts import keys
from receipts.errors import ReceiptsError, StoreError
from receipts.store import Store


def open_store(url: str) -> Store:
    """Open (creating on first use) the store for appends, with the log's checkpoint key (shared with the
    other commands); StoreUnavailable (one line, exit 2) when it cannot be reached or used."""
    from qualify.commands._common import open_append

    try:
        return open_append(url)
    except ReceiptsError as exc:
        line = exc.diagnostics()
        hint = "" if "check --db / QUALIFY_DB_URL" in line else "; check --db / QUALIFY_DB_URL"
        raise StoreUnavailable(f"cannot open the store: {line}{hint}") from exc
    except Exception as exc:  # a driver error that the store did not wrap: still one line
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise StoreUnavailable(f"cannot open the store {url}: {line}; check --db / QUALIFY_DB_URL") from exc


@dataclass
class OperatorKey:
    key: keys.SigningKey
    path: Path
    created: bool
    newly_trusted: bool


def load_key(store: Store, path: str | None) -> OperatorKey:
    """Load the signing key (the default one is created on first use) and make sure the store trusts it."""
    default = settings.default_key_path()
    p = Path(path) if path else default
    created = False
    if not p.exists():
        if path and p != default:
            raise UsageError(f"key file {p} does not exist; create it with: qualify keys generate --out {p}")
        key = keys.generate()
        key.save(p)
        created = True
    else:
        key = keys.SigningKey.load(p)
    trusted = store.trusted_keys()
    newly = False
    if key.keyid not in trusted and store.log_signer is None:
        # A fleet host: trusting a new operator key is the administrator's act, never a side effect of
        # a host's first run.
        public = p.with_suffix(".pub")
        raise UsageError(
            f"operator key {key.keyid[:16]} ({p}) is not trusted by this fleet log; an administrator "
            f"trusts it where the log key is: qualify keys export-public --key {p} --out {public} here, "
            f"then there: qualify keys trust {public.name} --db URL"
        )
    if key.keyid not in trusted:
        # Trust on first use only where this machine holds the log key (the embedded default): the same
        # machine that signs the log's checkpoints vouches for its own operator key.
        try:
            store.trust_key(key.public_key(), note=f"operator key {p}")
        except StoreError as exc:  # revoked: do not sign with it
            raise UsageError(f"the store will not take receipts signed by {p}: {exc}") from exc
        newly = True
    return OperatorKey(key, p, created, newly)
