"""A lying engine that accepts speculative=true and decodes plainly: no drafts, no verify steps, no draft
counters."""

from __future__ import annotations

from qualify.engine import spec
from qualify.engine.__main__ import main


def plain_instead(engine, prompts, max_tokens, mode="auto", drafter=None, drafts=None):
    gens, used = engine.generate(prompts, max_tokens, mode)
    return gens, used, spec.SpecCounters()


spec.speculative_generate = plain_instead

if __name__ == "__main__":
    main()
