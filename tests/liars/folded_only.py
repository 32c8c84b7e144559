"""tests/second_engine with a manifest that declares no distributed DCP (`dcp_distributed: false`): the
harness refuses `qualify run --dcp N` for it before boot, with one line.

Installed beside the second engine as a foreign engine is (tests/harness/test_second_engine.py,
`_installed`)."""

from __future__ import annotations

from second_engine import __main__ as second_main
from second_engine import engine as second_engine

_honest = second_engine.manifest


def _manifest() -> dict:
    return {**_honest(), "dcp_distributed": False}


second_engine.manifest = _manifest

if __name__ == "__main__":
    second_main.main()
