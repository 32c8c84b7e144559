"""Liar: a foreign engine (tests/second_engine) that reports the reference engine's code digest as its own.
Before protocol 2 the harness compared every local engine's claim with the reference's digest, so this
claim passed boot and the receipt named the reference's code; now the claim must be the digest of the
module the harness launched (its own tree), and it is rejected naming both digests.

Installed as a foreign engine is (the test copies this file and the second engine, as the top-level package
`second_engine`, into a folder named by QUALIFY_ENGINE_PATH): its sandbox holds only that folder and the
Python environment, so the digest it claims comes in through `--engine-env LIAR_CLAIM=...`."""

from __future__ import annotations

import os

from second_engine import __main__ as second_main
from second_engine import engine as second_engine

CLAIM = os.environ["LIAR_CLAIM"]
second_engine.code_digest = lambda: CLAIM

if __name__ == "__main__":
    second_main.main()
