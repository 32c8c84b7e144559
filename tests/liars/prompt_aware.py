"""Liar: deterministic only on the harness's prompts. The prompts a harness used to send every run (the
same three texts) are answered honestly; on any other prompt (real traffic) one token of the answer varies
from request to request, as an engine whose output depends on unseeded state or on the rest of the batch
would. A harness that compares only on prompts it always sends never sees it."""

from __future__ import annotations

import random

from qualify.engine import engine as engine_module
from qualify.engine.__main__ import main
from qualify.engine.tokenizer import ByteTokenizer

Engine = engine_module.Engine
_generate = Engine.generate
KNOWN = (
    "The hybrid engine",
    "Receipts are evidence:",
    "KDA keeps a recurrent state per head.",
    "Still alive?",
)
_known = {tuple(ByteTokenizer().encode(t)) for t in KNOWN}
_noise = random.Random()  # seeded from the OS: another value every run and every request
VARIES_AT = 3


def lying_generate(self, prompts, max_tokens, mode="auto"):
    gens, used = _generate(self, prompts, max_tokens, mode)
    for p, g in zip(prompts, gens, strict=True):
        if tuple(p) not in _known and len(g.token_ids) > VARIES_AT:
            g.token_ids[VARIES_AT] = _noise.randrange(256)
    return gens, used


Engine.generate = lying_generate

if __name__ == "__main__":
    main()
