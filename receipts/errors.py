"""Every error the receipts library raises derives from ReceiptsError; each says what to do."""

from __future__ import annotations


class ReceiptsError(Exception):
    """Base class. `diagnostics()` is one line for a person; the CLI exits 2 on these."""

    exit_code = 2

    def diagnostics(self) -> str:
        return str(self)


class ProofError(ReceiptsError):
    """A Merkle inclusion or consistency proof does not verify."""


class VerificationError(ReceiptsError):
    """A signature, envelope, checkpoint or receipt does not verify."""


class KeyFileError(ReceiptsError):
    """A key file is missing, unreadable, malformed or too permissive."""


class StoreError(ReceiptsError):
    """The store cannot be reached, or a request against it cannot be satisfied."""


class NotFound(ReceiptsError):
    """An id (receipt, key, checkpoint) that the store does not hold."""


class TamperError(ReceiptsError):
    """The log's contents disagree with its own hashes, signatures or checkpoints."""
