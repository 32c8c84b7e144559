"""Verdict policy as data: which skips a target may carry, and how check outcomes become a verdict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# target -> {check name: why skipping it still qualifies that target}. Anything not listed must pass.
ACCEPTABLE_SKIPS: dict[str, dict[str, str]] = {
    "cpu": {"capture": "CUDA graphs need a CUDA device; a CPU target runs eager only"},
    "gpu": {},
}

# The checks a complete run has; a run that stops short of them cannot qualify.
REQUIRED_CHECKS: tuple[str, ...] = (
    "boot",
    "backend",
    "layout",
    "arenas",
    "capture",
    "reload",
    "generation",
    "faults",
)


@dataclass(frozen=True)
class Judgement:
    verdict: str  # qualified | rejected | aborted
    reasons: list[str]


def judge(outcomes: Sequence[tuple[str, str]], target: str, interrupted: str | None = None) -> Judgement:
    """`outcomes` are (check name, status) in run order; `interrupted` says why the run stopped early."""
    if interrupted:
        return Judgement("aborted", [interrupted])
    reasons: list[str] = []
    allowed = ACCEPTABLE_SKIPS.get(target, {})
    seen = {name for name, _ in outcomes}
    for name, status in outcomes:
        if status == "pass":
            continue
        if status == "skip":
            if name not in allowed:
                reasons.append(f"{name}: skipped, which a {target} target does not allow")
        else:  # fail, error, or a status this policy does not know: never a pass
            reasons.append(f"{name}: {status}")
    missing = [c for c in REQUIRED_CHECKS if c not in seen]
    if missing:
        reasons.append(f"checks not run: {', '.join(missing)}")
    return Judgement("rejected" if reasons else "qualified", reasons)
