"""Shared CLI pieces: the --db and --json options, opening the store (with the log's checkpoint key for
appends), reading input files, and printing results for people or as JSON."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import re
import socket
import stat
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from rich.console import Console

from qualify import params, settings
from qualify.errors import UsageError
from qualify.limits import MAX_IMPORT_BYTES, read_text_limited
from receipts.canonical import loads
from receipts.checkpoint import NoteSigner, NoteVerifier
from receipts.errors import KeyFileError, ReceiptsError, StoreError, TamperError

if TYPE_CHECKING:
    from receipts.store import Store

# SQLAlchemy, pydantic and the store are imported where a command first needs them, not here: every
# command module imports this one, and `qualify <group> --help` should not wait for a database library.

F = TypeVar("F", bound=Callable[..., Any])

console = Console(highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------- options


def db_option(fn: F) -> F:
    return click.option(
        "--db",
        "db_url",
        default=None,
        metavar="URL",
        help="Store URL (default: $QUALIFY_DB_URL, else the SQLite file in the data dir).",
    )(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(fn)


def vkey_option(fn: F) -> F:
    return click.option(
        "--vkey", metavar="VKEY|FILE", help="The log's verifier key (default: the local log key)."
    )(fn)


def resolve_db(value: str | None) -> str:
    return value or settings.default_db_url()


def store_errors(fn: F) -> F:
    """Database errors that escape the store (a lost connection, a locked file) become one line, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            # Only a loaded SQLAlchemy can have raised one of its errors.
            sa_exc = sys.modules.get("sqlalchemy.exc")
            if sa_exc is None or not isinstance(error, sa_exc.SQLAlchemyError):
                raise
            cause = getattr(error, "orig", None) or error
            line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise StoreError(f"database error: {line}; check --db / QUALIFY_DB_URL") from error

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------- output


def emit(as_json: bool, data: Any, human: Callable[[], None]) -> None:
    """JSON on stdout for machines, or whatever `human` prints for people."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    else:
        human()


def write_or_echo(text: str, out: str | None, wrote: str) -> None:
    """`text` into the file `out` (then say `wrote`), or verbatim on stdout when there is no --out."""
    if out:
        write_file(out, text)
        console.print(wrote)
    else:
        click.echo(text, nl=False)


def write_file(path: str, data: str | bytes) -> None:
    """Write an output file the user named; UsageError (one line) when it cannot be written."""
    try:
        if isinstance(data, bytes):
            Path(path).write_bytes(data)
        else:
            Path(path).write_text(data)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}; choose another --out") from None


def short(hex_id: str, n: int = 16) -> str:
    return hex_id[:n]


# ---------------------------------------------------------------------------- the log's checkpoint key


def default_origin() -> str:
    """The log's name on its checkpoints when a data dir starts a new log: qualify.local/<hostname>."""
    host = re.sub(r"[\s+]", "-", socket.gethostname() or "log")
    return f"qualify.local/{host}"


def _skey(signer: NoteSigner) -> str:
    """`PRIVATE+KEY+<name>+<hash>+<base64(0x01 || seed)>` (golang.org/x/mod/sumdb/note signer key)."""
    seed = signer.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    blob = base64.b64encode(bytes([1]) + seed).decode()
    return f"PRIVATE+KEY+{signer.name}+{signer.key_hash.hex()}+{blob}"


def read_private_text(path: Path, what: str) -> str:
    """A private key file's text, refusing one that group or others can read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as error:
        raise KeyFileError(f"{what} {path} does not exist") from error
    except OSError as error:
        raise KeyFileError(f"cannot read {what} {path}: {error.strerror}") from error
    with os.fdopen(fd, "rb") as fh:
        mode = stat.S_IMODE(os.fstat(fh.fileno()).st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"{what} {path} is readable by group/others (mode {mode:04o}); run: chmod 600 {path}"
            )
        try:
            return fh.read().decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise KeyFileError(f"cannot read {what} {path}: {error}") from error


def load_log_signer(*, create: bool) -> NoteSigner | None:
    """The log's checkpoint key at settings.log_key_path(); created (0600) on first use when `create`.
    A key made here is named for the new log it starts (`qualify.local/<host>/<random id>`, its origin);
    which name a log signs under is the log's own (see Store.set_log_signer)."""
    path = settings.log_key_path()
    if not path.exists():
        if not create:
            return None
        from receipts.store import new_log_origin

        # A key made for a new log is named for the log's origin (C2SP: key name = origin).
        signer = NoteSigner(new_log_origin(default_origin()), Ed25519PrivateKey.generate())
        # Written whole under a private name, then linked into place: a concurrent first use either makes
        # the key or reads the whole key another process made, never a half-written file.
        temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(_skey(signer) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.link(temp, path)
        except FileExistsError:
            return load_log_signer(create=False)  # another process made it meanwhile
        except OSError as error:
            raise KeyFileError(f"cannot create the log key {path}: {error.strerror}") from error
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
        return signer
    text = read_private_text(path, "log key file")
    try:
        return NoteSigner.from_skey(text)
    except ReceiptsError as error:
        raise KeyFileError(f"log key file {path} is not a note signer key: {error}") from error


def _is_default_store(store: Store) -> bool:
    from receipts.db import parse_url

    try:
        default = parse_url(settings.default_db_url())
    except StoreError:
        return False
    return store.engine.url.render_as_string(hide_password=False) == default.render_as_string(
        hide_password=False
    )


def local_log_signer(store: Store) -> NoteSigner | None:
    """The local log key, named as this store's log signs, when it is this store's log key; else None.

    It is taken to be this log's key when the store is this data dir's own (default) store, when the log
    was started with it (the store's origin is the key's name, or, for logs made before key name =
    origin, starts with it), or when the store records its public key. Otherwise the local key belongs to
    another log: trusting it would report every checkpoint of this one as forged."""
    from receipts.store import recorded_key_name, signer_named

    signer = load_log_signer(create=False)
    if signer is None:
        return None
    meta = store.meta()
    if meta is None:
        return signer
    origin, vkey = meta
    named = signer_named(signer, recorded_key_name(vkey))
    if (
        _is_default_store(store)
        or origin == signer.name
        or origin.startswith(signer.name + "/")
        or named.vkey() == vkey
    ):
        return named
    return None


def parse_vkey(value: str) -> NoteVerifier:
    """A --vkey given as the verifier key itself or as a file holding it; one-line errors for both."""
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(
                f"cannot read the --vkey file {path}: {getattr(error, 'strerror', None) or error}"
            ) from None
    else:
        text = value.strip()
    return NoteVerifier.from_vkey(text)


def local_trust(store: Store) -> tuple[NoteVerifier, str] | None:
    """The log key this machine holds for `store`'s log, as a verifier, and where it came from: the local
    log key (named as this log signs), else a fleet host's copy of the verifier key (keys/log.vkey,
    $QUALIFY_LOG_VKEY); None when it holds neither. Both kept here (a fleet host that also has a log of its
    own): the one this log records; if neither is, the fleet's (the explicit one), against which the
    difference is reported."""
    signer = local_log_signer(store)
    held = host_log_verifier()
    candidates: list[tuple[NoteVerifier, str]] = []
    if signer is not None:
        candidates.append((signer.verifier(), f"the local log key {settings.log_key_path()}"))
    if held is not None:
        candidates.append((held[0], f"the log's verifier key from {held[1]}"))
    if not candidates:
        return None
    meta = store.meta()
    recorded = meta[1] if meta else None
    return next((c for c in candidates if c[0].vkey() == recorded), candidates[-1])


def log_verifiers(store: Store, vkey: str | None = None) -> tuple[list[NoteVerifier], str]:
    """Trusted checkpoint keys and where they came from: --vkey (text or a file holding it), else the
    key this machine holds for the log (local_trust), else (weakest) the key recorded in the store."""
    if vkey:
        return [parse_vkey(vkey)], "--vkey"
    local = local_trust(store)
    if local is not None:
        return [local[0]], local[1]
    return [store.log_verifier()], "the log key recorded in the store (pass --vkey to trust your own copy)"


# ---------------------------------------------------------------------------- opening the store


def open_read(url: str | None) -> Store:
    """An existing store for reading; StoreError when there is none (nothing is created). Its read paths
    trust the local log key where there is one (not the key the database records)."""
    from receipts.store import Store

    store = Store.open(resolve_db(url), create=False)
    try:
        trust_local_log_key(store)
    except BaseException:
        store.close()
        raise
    return store


def trust_local_log_key(store: Store) -> None:
    """Make the log key this machine holds (the local log key, or on a fleet host the log's verifier key
    in keys/log.vkey or $QUALIFY_LOG_VKEY: see local_trust) the key the store's read paths verify with."""
    local = local_trust(store)
    if local is not None:
        store.set_trusted_log_key(*local)


def open_read_or_none(url: str | None) -> Store | None:
    """Like open_read, but None when the default store (the data dir's, no --db and no $QUALIFY_DB_URL)
    does not exist yet: a listing before the first run has nothing to list. A store named by --db or
    $QUALIFY_DB_URL that does not exist is a StoreError ("no store at …", exit 2), as for every other
    command: a mistyped URL must not read as an empty store."""
    from receipts.db import MissingStore

    try:
        return open_read(url)
    except MissingStore:
        if url or os.environ.get("QUALIFY_DB_URL"):
            raise
        return None


def tamper_exits_1(fn: F) -> F:
    """A read that finds the store tampered with (TamperError) exits 1, as the verifiers do, with one
    line: it found a problem with the log, not with the user's input."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TamperError as error:
            click.echo(f"error: {error.diagnostics()}", err=True)
            raise click.exceptions.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def host_log_verifier() -> tuple[NoteVerifier, str] | None:
    """A fleet host's copy of the log's verifier key: $QUALIFY_LOG_VKEY, else keys/log.vkey; None when
    neither is set (then this machine is its own log's sequencer, the embedded default)."""
    text = os.environ.get(settings.LOG_VKEY_ENV, "").strip()
    source = f"${settings.LOG_VKEY_ENV}"
    path = settings.log_vkey_path()
    if not text and path.is_file():
        try:
            text, source = path.read_text(encoding="ascii").strip(), str(path)
        except (OSError, UnicodeDecodeError) as error:
            raise KeyFileError(f"cannot read the log's verifier key {path}: {error}") from None
    if not text:
        return None
    try:
        return NoteVerifier.from_vkey(text), source
    except ReceiptsError as error:
        raise KeyFileError(f"the log's verifier key in {source} is not one: {error}") from None


def open_append(url: str | None, *, create: bool = True) -> Store:
    """The store for appending, created on first use (unless `create` is off).

    Roles (docs/RELIABILITY.md, "A fleet"): where this machine holds the log key (keys/log.key; made on
    first use for a new log, the embedded default), it appends and signs checkpoints itself. A fleet
    host holds only the log's verifier key (keys/log.vkey or $QUALIFY_LOG_VKEY): it submits entries to
    the sequencer's queue and checks each proof with that key."""
    from receipts.store import Store, new_log_origin

    store = Store.open(resolve_db(url), create=create)
    try:
        meta = store.meta()
        held = host_log_verifier()
        signer = None if meta is None else local_log_signer(store)
        if held is not None:
            verifier, _ = held
            if signer is None or signer.vkey() != verifier.vkey():
                store.set_host(verifier)  # refused when the log is empty or records another key
                return store
        if meta is not None and signer is None:
            raise KeyFileError(
                f"this log's checkpoints are signed by {meta[1]}, and there is no log key at "
                f"{settings.log_key_path()} for it: on a host of a fleet log, save the log's verifier key "
                f"(`qualify log vkey` where the log key is) to {settings.log_vkey_path()} or set "
                f"${settings.LOG_VKEY_ENV}, and run its sequencer there (qualify log sequence); "
                "never copy the log key itself"
            )
        if meta is None:
            # A log key is made only for a log that has none yet: a machine without the key of an
            # existing log must not leave behind a stray key (which later reads would trust).
            existed = settings.log_key_path().exists()
            signer = load_log_signer(create=True)
            assert signer is not None
            # A new log gets an origin of its own (qualify.local/<host>/<random id>), and its
            # checkpoints the key name equal to it; a key made just now is already named for it. Both
            # are recorded by the first append, under the writer lock: a concurrent first use that
            # commits first wins, and this one goes on with its origin and key name.
            store.set_log_signer(
                signer, new_origin=signer.name if not existed else new_log_origin(default_origin())
            )
        else:
            assert signer is not None
            store.set_log_signer(signer)
    except BaseException:
        store.close()
        raise
    return store


def warn_served(store: Store) -> None:
    """On stderr, when the store holds rows beyond the last checkpoint that verifies with the trusted log
    key: what is shown comes from that checkpoint, and nothing beyond it."""
    notice = store.good_head().notice()
    if notice is not None:
        click.echo(f"warning: {notice}", err=True)


@contextlib.contextmanager
def opened(store: Store) -> Iterator[Store]:
    try:
        yield store
    finally:
        store.close()


# ---------------------------------------------------------------------------- input


def read_json_documents(path: str) -> list[Any]:
    """One JSON document, or JSON Lines (one per non-empty line); UsageError for anything else, for a file
    over MAX_IMPORT_BYTES (at most that much is read), and for NaN, long integers or deep nesting."""
    text = read_text_limited(path, MAX_IMPORT_BYTES, "file")
    try:
        return [loads(text)]
    except json.JSONDecodeError:
        pass  # perhaps JSON Lines
    except ValueError as error:  # valid JSON, but NaN, a long integer or too deep
        raise UsageError(f"{path} is not an acceptable envelope: {error}") from None
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            documents.append(loads(line))
        except ValueError as error:
            why = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
            raise UsageError(f"{path} line {number} is not JSON ({why}); expected a DSSE envelope") from None
    if not documents:
        raise UsageError(f"{path} is empty; expected a DSSE envelope (JSON) or JSON Lines of them")
    return documents


def parse_since(value: str | None) -> datetime | None:
    """`7d`, `24h`, `30m` (ago), or an ISO 8601 date/time (UTC unless it says otherwise): the grammar the
    HTTP API shares (qualify.params)."""
    if value is None:
        return None
    try:
        return params.parse_since(value)
    except params.ParamError as error:
        raise UsageError(f"--{error}") from None


def parse_subject_option(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return params.parse_subject(value)
    except params.ParamError as error:
        raise UsageError(f"--{error}") from None


def parse_host_option(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return params.parse_host(value)
    except params.ParamError as error:
        raise UsageError(f"--{error}") from None
