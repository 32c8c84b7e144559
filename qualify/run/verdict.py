"""Verdict policy as data: which skips a target may carry, which conditions a target must have observed
itself, and how check outcomes and the run's faults become a verdict."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# target -> {check name: why skipping it still qualifies that target}. Anything not listed must pass.
ACCEPTABLE_SKIPS: dict[str, dict[str, str]] = {
    "cpu": {
        "capture": "CUDA graphs need a CUDA device; a CPU target runs eager only",
        "monitor": "no CUDA activity to monitor on a CPU target",
    },
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
    "monitor",
    "generation",
    "faults",
)


# The layout check's intervention (qualify/checks/intervene.py): the evidence that the engine computes with
# the memory it exports, laid out as asked. Required on every target, each by name, so that dropping one
# cannot pass by absence.
INTERVENTION: tuple[str, ...] = (
    "layout.intervention_ran",
    "layout.intervention_memory_holds_caches",
    "layout.intervention_swap_exchanges_outputs",
    "layout.intervention_attention_pages_owned",
    "layout.intervention_kda_slots_owned",
    "layout.intervention_others_unchanged",
    "layout.intervention_restore_gives_original",
)

# target -> conditions ("check.condition", shell patterns) that must be present, hold, and be `observed`
# by the harness (not derived, not the engine's word) for the run to qualify. A pattern that matches
# nothing is a failure too: a condition that was dropped cannot pass by absence.
REQUIRED_OBSERVED: dict[str, tuple[str, ...]] = {
    "cpu": INTERVENTION,
    "gpu": (
        *INTERVENTION,
        "layout.spans_equal_request",
        "layout.peer_*",
        "capture.replay_equals_eager",
        "capture.graph_steps_faster_than_eager",
        "reload.other_weights_replay_equals_eager",
        "reload.replay_after_reload_equals_fresh_eager",
        "reload.after_same_reload_equals_a_fresh_engine",
        "reload.restored_equals_a_fresh_engine",
        "generation.tokens_generated",
        "generation.deterministic",
        "generation.replay_vs_eager",
        "generation.before_vs_after_reload",
        "faults.no_restarts",
        "faults.xid_watched",
        "faults.no_fatal_xid",
        "faults.engine_answers",
    ),
}


# target -> conditions that must be present, hold, and come from the harness's CUDA activity monitor inside
# the engine process (`monitored`): FULL capture at every size, the resolved backend's KDA kernels, reloads
# under the captured graphs. The engine's own counters for the same claims stay as `engine` evidence.
REQUIRED_MONITORED: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "gpu": (
        "monitor.monitor_reported_from_the_engine",
        "monitor.capture_*",
        "monitor.backend_*",
        "monitor.reload_*",
    ),
}


# target -> conditions that, where the run has them (speculation exists only with --spec), must hold and be
# observed like the ones above (on a GPU, generation.speculative_all_accepted_takes_fewer_steps: the
# harness's timing of speculation). The engine's own speculation reports are named spec_* and stay outside.
OBSERVED_WHERE_PRESENT: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "gpu": (
        "generation.speculative_*",
        "dcp.dcp_vs_dcp1*",
        "dcp.every_rank_is_a_live_process_of_the_engine",
        "dcp.every_rank_worked_during_generation",
        "dcp.every_rank_on_its_own_gpu",
    ),
}


def observed_shortfalls(
    results: Iterable[dict[str, Any]],
    patterns: Sequence[str],
    *,
    required: bool = True,
    source: str | tuple[str, ...] = "observed",
) -> list[str]:
    """For each pattern, the conditions it names that are missing (when `required`), do not hold, or do not
    come from `source` (observed, or monitored)."""
    flat: dict[str, dict[str, Any]] = {}
    for r in results:
        for cname, c in (r.get("conditions") or {}).items():
            flat[f"{r['name']}.{cname}"] = c
    out: list[str] = []
    for pattern in patterns:
        hits = {k: v for k, v in flat.items() if fnmatch.fnmatchcase(k, pattern)}
        if not hits and required:
            out.append(f"{pattern}: no such condition in the run")
            continue
        for key, c in sorted(hits.items()):
            allowed = (source,) if isinstance(source, str) else source
            if c.get("source") not in allowed:
                out.append(f"{key}: source is {c.get('source')}, {' or '.join(allowed)} required")
            elif not c.get("holds"):
                out.append(f"{key}: does not hold")
    return out


@dataclass(frozen=True)
class Judgement:
    verdict: str  # qualified | rejected | aborted
    reasons: list[str]


def judge(
    results: Sequence[dict[str, Any]],
    target: str,
    interrupted: str | None = None,
    faults: Sequence[str] = (),
    required: Sequence[str] = REQUIRED_CHECKS,
) -> Judgement:
    """`results` are check records ({name, status, conditions}) in run order; `interrupted` says why the run
    stopped early; `faults` are the run's blocking faults in words (Faults.blocking), read after the engine
    stopped, so that a late restart, Xid, OOM or death rejects the run."""
    if interrupted:
        return Judgement("aborted", [interrupted, *(f"fault: {f}" for f in faults)])
    reasons: list[str] = []
    allowed = ACCEPTABLE_SKIPS.get(target, {})
    seen = {r["name"] for r in results}
    for name, status in ((r["name"], r["status"]) for r in results):
        if status == "pass":
            continue
        if status == "skip":
            if name not in allowed:
                reasons.append(f"{name}: skipped, which a {target} target does not allow")
        else:  # fail, error, or a status this policy does not know: never a pass
            reasons.append(f"{name}: {status}")
    missing = [c for c in required if c not in seen]
    if missing:
        reasons.append(f"checks not run: {', '.join(missing)}")
    if not missing:
        shortfalls = observed_shortfalls(results, REQUIRED_OBSERVED.get(target, ()))
        shortfalls += observed_shortfalls(results, OBSERVED_WHERE_PRESENT.get(target, ()), required=False)
        reasons.extend(f"not observed: {s}" for s in shortfalls)
        watched = observed_shortfalls(
            results, REQUIRED_MONITORED.get(target, ()), source=("monitored", "observed")
        )
        reasons.extend(f"not monitored: {s}" for s in watched)
    reasons.extend(f"fault: {f}" for f in faults)
    return Judgement("rejected" if reasons else "qualified", reasons)
