"""What every check gets (the run context) and returns (an outcome); shared prompts and the epsilon."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qualify.client import EngineClient
from qualify.launch.base import Launcher
from qualify.protocol import CompletionRequest, CompletionResponse, Describe, compare_greedy
from qualify.run.request import RunRequest

# Coherence rule epsilon (logit units): a first difference where the reference's top-2 gap is below this
# is a near tie, not a disagreement. The receipt records it with the rule.
EPSILON = 0.05
PROMPTS = ["The hybrid engine", "Receipts are evidence:", "KDA keeps a recurrent state per head."]
GEN_TOKENS = 12


OBSERVED, DERIVED, ENGINE = "observed", "derived", "engine"


@dataclass(frozen=True)
class Cond:
    """One condition of a check: whether it holds, where that knowledge comes from, and what was seen.

    observed: measured by the harness, or by a process it launched that is not the engine (the peer, the
    refusal probe, the supervisor, NVML, the kernel log, docker inspect, tokens the harness compared);
    derived: computed by the harness from observed values; engine: the engine's own report."""

    holds: bool
    source: str
    detail: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"holds": bool(self.holds), "source": self.source, "detail": self.detail}


def observed(holds: bool, detail: str | None = None) -> Cond:
    return Cond(bool(holds), OBSERVED, detail)


def derived(holds: bool, detail: str | None = None) -> Cond:
    return Cond(bool(holds), DERIVED, detail)


def engine_says(holds: bool, detail: str | None = None) -> Cond:
    return Cond(bool(holds), ENGINE, detail)


@dataclass
class Outcome:
    status: str  # pass | fail | skip | error
    evidence: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    conditions: dict[str, Cond] = field(default_factory=dict)


@dataclass
class Context:
    """State shared along the run: what the engine said, and facts one check leaves for a later one."""

    request: RunRequest
    launcher: Launcher
    client: EngineClient
    describe: Describe | None = None
    url: str | None = None
    target: str = "cpu"
    captured: bool = False
    facts: dict[str, Any] = field(default_factory=dict)
    xid_events: Callable[[], list[Any]] = list
    # The Xid watch as the run sees it: {"state": active | not_applicable | unavailable, "reason": ...}
    xid_watch: Callable[[], dict[str, Any]] = lambda: {"state": "unavailable", "reason": "no watcher"}
    # pid -> GPU indices with compute work, as NVML lists them (the harness's view); None: no NVML here
    gpu_pids: Callable[[], dict[int, list[int]] | None] = lambda: None
    deadline: float = float("inf")  # monotonic: the current check's budget, within the run's

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def generate(
        self,
        prompt: Any = None,
        *,
        mode: str = "auto",
        speculative: bool = False,
        max_tokens: int = GEN_TOKENS,
    ) -> CompletionResponse:
        return self.client.complete(
            CompletionRequest(
                prompt=PROMPTS if prompt is None else prompt,
                max_tokens=max_tokens,
                mode=mode,
                speculative=speculative,
            )
        )


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], Outcome]
    timeout_s: float  # per-check budget, bounded further by the run's --timeout
    needs_engine: bool = True  # False: still runs when the engine stopped answering (faults)


def fail_unless(conditions: dict[str, Cond], evidence: dict[str, Any]) -> Outcome:
    """Pass when every named condition holds; else fail naming the ones that did not (with what differed)."""
    for name, c in conditions.items():
        if not isinstance(c, Cond):  # every condition must say where its observation comes from
            raise TypeError(f"condition {name} has no source: use observed(), derived() or engine_says()")
    bad = [name + (f" ({c.detail})" if c.detail else "") for name, c in conditions.items() if not c.holds]
    if bad:
        return Outcome("fail", evidence, "not satisfied: " + "; ".join(bad), conditions)
    return Outcome("pass", evidence, None, conditions)


def tokens(resp: CompletionResponse) -> list[list[int]]:
    return [c.token_ids for c in sorted(resp.choices, key=lambda c: c.index)]


def gaps(resp: CompletionResponse) -> list[list[float]]:
    return [c.top2_gaps for c in sorted(resp.choices, key=lambda c: c.index)]


def well_formed(resp: CompletionResponse, prompts: int) -> bool:
    """One choice per prompt, indexed 0..n-1, each with tokens and one top-2 gap per token: the shape the
    coherence rule needs. An empty answer must never agree with another empty answer."""
    ordered = sorted(resp.choices, key=lambda c: c.index)
    return (
        len(ordered) == prompts > 0
        and [c.index for c in ordered] == list(range(prompts))
        and all(c.token_ids and len(c.top2_gaps) == len(c.token_ids) for c in ordered)
    )


def _coherence_summary(formed: bool, reports: list[dict[str, Any]], identical: bool) -> str:
    """One line: identical, agreeing through near ties, or where the first disagreement is."""
    if not formed:
        return "an answer was not well formed (missing prompts, tokens or gaps)"
    if identical:
        return "identical"
    for i, r in enumerate(reports):
        if not r["agrees"]:
            return f"prompt {i} differs at token {r['first_divergence']} (gap {r['gap']})"
    ties = [
        f"prompt {i} token {r['first_divergence']}"
        for i, r in enumerate(reports)
        if r["first_divergence"] is not None
    ]
    return "near tie at " + ", ".join(ties)


def coherence(
    reference: CompletionResponse, candidate: CompletionResponse, prompts: int = len(PROMPTS)
) -> dict[str, Any]:
    """The coherence rule applied prompt by prompt; `agrees` only when both answers are well formed for
    `prompts` prompts and every prompt agrees."""
    reports = []
    for ref_t, ref_g, cand_t in zip(tokens(reference), gaps(reference), tokens(candidate), strict=False):
        reports.append(compare_greedy(ref_t, ref_g, cand_t, EPSILON).model_dump(mode="json"))
    formed = well_formed(reference, prompts) and well_formed(candidate, prompts)
    return {
        "summary": _coherence_summary(formed, reports, tokens(reference) == tokens(candidate)),
        "agrees": formed and all(r["agrees"] for r in reports),
        "identical": formed and tokens(reference) == tokens(candidate),
        "well_formed": formed,
        "rule": reports[0]["rule"] if reports else None,
        "epsilon": EPSILON,
        "per_prompt": [{k: r[k] for k in ("agrees", "first_divergence", "gap")} for r in reports],
    }
