"""Where qualify keeps its files: data dir, default SQLite store, default signing key."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    """`$QUALIFY_HOME`, else the user data dir (e.g. ~/.local/share/qualify)."""
    env = os.environ.get("QUALIFY_HOME")
    return Path(env) if env else Path(platformdirs.user_data_dir("qualify", appauthor=False))


def default_db_url() -> str:
    env = os.environ.get("QUALIFY_DB_URL")
    if env:
        return env
    return f"sqlite:///{data_dir() / 'qualify.db'}"


def keys_dir() -> Path:
    return data_dir() / "keys"


def default_key_path() -> Path:
    """The operator's signing key, created on first use by `qualify run`."""
    return keys_dir() / "operator.key"


def log_key_path() -> Path:
    """The log's Ed25519 key that signs checkpoints."""
    return keys_dir() / "log.key"


LOG_VKEY_ENV = "QUALIFY_LOG_VKEY"


def log_vkey_path() -> Path:
    """A fleet host's copy of the log's verifier key (what `qualify log vkey` prints on the sequencer)."""
    return keys_dir() / "log.vkey"


def repair_notes_dir() -> Path:
    """Where `qualify log repair` keeps the notes it signs with the log key (`log verify` requires them)."""
    return data_dir() / "log-repairs"
