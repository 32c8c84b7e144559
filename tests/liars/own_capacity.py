"""Liar: it ignores the capacity the launch document sent and serves with its own (4 sequences, not 8),
reporting that honestly in describe; it also skips the honest engine's refusal of a document whose cache
layout it would not follow. Caught by boot's `described_config_agrees_with_sent`."""

from __future__ import annotations

from qualify.engine import __main__ as engine_main

_fields = engine_main._config_fields


def _own_capacity(args):  # noqa: ANN001
    return {**_fields(args), "max_num_seqs": 4}


engine_main._config_fields = _own_capacity  # serve() looks both up when it runs
engine_main._launch_layout_differs = lambda engine, path: None

if __name__ == "__main__":
    engine_main.main()
