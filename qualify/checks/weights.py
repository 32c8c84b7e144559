"""The weights subject, bound to what the engine runs: the engine was handed one file, hashed by the harness
and mounted read-only (qualify/launch/local.py). After boot the harness has it reload that same file and
requires unchanged output on prompts drawn fresh for this run: an engine that booted other weights than
the file it names changes its output when it finally loads the named one."""

from __future__ import annotations

import secrets
from typing import Any

from qualify.checks.base import Cond, Context, observed, tokens, well_formed
from qualify.protocol import ReloadRequest

FRESH_PROMPTS = 3
FRESH_TOKENS = 8
_ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;ACGTXYZ0123456789"


def fresh_prompts(n: int = FRESH_PROMPTS, length: int = 24) -> list[str]:
    """Prompts no engine can have seen before this run (drawn from the OS's random source)."""
    return ["".join(secrets.choice(_ALPHABET) for _ in range(length)) for _ in range(n)]


def handed_reload_keeps_output(ctx: Context, engine_path: str) -> tuple[Cond, dict[str, Any]]:
    """Generate on fresh prompts, reload `engine_path` (the harness's file), generate again: identical."""
    prompts = fresh_prompts()
    before = ctx.generate(prompts, mode="eager", max_tokens=FRESH_TOKENS)
    rel = ctx.client.reload(ReloadRequest(path=engine_path), timeout_s=ctx.remaining())
    after = ctx.generate(prompts, mode="eager", max_tokens=FRESH_TOKENS)
    formed = well_formed(before, len(prompts)) and well_formed(after, len(prompts))
    same = formed and tokens(before) == tokens(after)
    evidence = {
        "prompts": prompts,
        "before": tokens(before) if formed else None,
        "after": tokens(after) if formed else None,
        "reloaded_path": rel.weights_path,
    }
    detail = None if same else "output changed when the engine reloaded the file it was handed"
    if not formed:
        detail = "the engine's completions were not well formed"
    return observed(same, detail), evidence
