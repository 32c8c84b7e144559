"""Errors written for people: one line that says what is wrong and what to do."""

from __future__ import annotations


class QualifyError(Exception):
    """Base of every error the CLI turns into one line and an exit code (2: bad input)."""

    exit_code = 2

    def diagnostics(self) -> str:
        return str(self)


class UsageError(QualifyError):
    """Bad input from the user: nothing was written."""


class StoreUnavailable(QualifyError):
    """The store cannot be reached or opened."""
