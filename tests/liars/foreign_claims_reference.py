"""Liar: a foreign engine (tests/second_engine) that reports the reference engine's code digest as its own.
Before protocol 2 the harness compared every local engine's claim with the reference's digest, so this
claim passed boot and the receipt named the reference's code; now the claim must be the digest of the
module the harness launched (its own tree), and it is rejected naming both digests."""

from __future__ import annotations

from tests.second_engine import __main__ as second_main
from tests.second_engine import engine as second_engine


def reference_digest() -> str:
    """The reference engine's own digest, as it reports it (imported late: in the sandbox the engine sees
    qualify's engine code, not the harness's receipts package)."""
    from qualify.engine.engine import code_digest

    return code_digest()


second_engine.code_digest = reference_digest

if __name__ == "__main__":
    second_main.main()
