"""An engine of another protocol version (tests/second_engine, its manifest saying version 1): the harness
refuses to launch it, with one line naming both versions, before it boots.

Installed beside the second engine as a foreign engine is (tests/harness/test_second_engine.py,
`_installed`)."""

from __future__ import annotations

from second_engine import __main__ as second_main
from second_engine import engine as second_engine

_honest = second_engine.manifest


def _manifest() -> dict:
    return {**_honest(), "protocol_versions": ["1"]}


second_engine.manifest = _manifest

if __name__ == "__main__":
    second_main.main()
