"""Liar: a foreign engine (tests/second_engine) that reports the reference engine's code digest as its own.
Before protocol 2 the harness compared every local engine's claim with the reference's digest, so this
claim passed boot and the receipt named the reference's code; now the claim must be the digest of the
module the harness launched (its own tree), and it is rejected naming both digests."""

from __future__ import annotations

from qualify.run.receipt import engine_code_digest_on_disk
from tests.second_engine import __main__ as second_main
from tests.second_engine import engine as second_engine

second_engine.code_digest = engine_code_digest_on_disk

if __name__ == "__main__":
    second_main.main()
