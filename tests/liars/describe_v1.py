"""Liar: its manifest speaks protocol 2 (so the harness launches it) but describe answers in version 1, as
an engine half-upgraded would. Caught by boot's `protocol_version_spoken`: the harness reads nothing else
right from another version."""

from __future__ import annotations

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main

_describe = engine_module.Engine.describe


def _describe_v1(self):  # noqa: ANN001
    return {**_describe(self), "protocol_version": "1"}


engine_module.Engine.describe = _describe_v1

if __name__ == "__main__":
    main()
