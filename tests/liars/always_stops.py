"""A lying engine that makes no drafted step predictable: every generation ends with a stop token as its
second token, in every mode and path alike (plain, speculative, forced), so every comparison of its outputs
agrees. The harness can then never say how many drafts a step must accept: it tries three fresh prompts
(checks/speculation.py) and, finding no predictable step for some j on any of them, credits no
acceptance length it did not see (`spec_accepts_exactly_j` fails)."""

from __future__ import annotations

from qualify.engine.__main__ import main
from qualify.engine.runner import Runner
from qualify.engine.tokenizer import EOS

_append = Runner._append


def stopping_append(self, req, token, gap, second=-1):
    if len(req.output) == 1:
        token = EOS
    _append(self, req, token, gap, second)


Runner._append = stopping_append

if __name__ == "__main__":
    main()
