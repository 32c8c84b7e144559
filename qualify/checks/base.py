"""What every check gets (the run context) and returns (an outcome); shared prompts and the epsilon."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qualify.checks.probes import Probes
from qualify.client import EngineClient
from qualify.launch.base import Launcher
from qualify.protocol import Choice, CompletionRequest, CompletionResponse, Describe, compare_greedy
from qualify.run.request import RunRequest
from qualify.watch.procs import ProcessWatch

# Coherence rule epsilon (logit units): a first difference where both runs report the same two top tokens,
# swapped, with top-2 gaps below this is a near tie (confirmed by teacher forcing), not a disagreement. The
# receipt records it with the rule and marks each comparison identical, near_tie or differs.
EPSILON = 0.05
PROMPTS = ["The hybrid engine", "Receipts are evidence:", "KDA keeps a recurrent state per head."]
GEN_TOKENS = 12


OBSERVED, DERIVED, ENGINE = "observed", "derived", "engine"

# Teacher forcing after a near tie: (the prompt's token ids + the reference's tokens through the divergence,
# how many tokens to generate) -> what the candidate's configuration generates (None: no usable answer).
Reask = Callable[[list[int], int], "list[int] | None"]


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
    # pid -> {GPU index: device memory bytes (None: not reported)}, as NVML lists them; None: no NVML here
    gpu_memory: Callable[[], dict[int, dict[int, int | None]] | None] = lambda: None
    # GPU index -> (free bytes, total bytes), NVML's; None where it does not run
    gpu_free: Callable[[], dict[int, tuple[int, int]] | None] = lambda: None
    deadline: float = float("inf")  # monotonic: the current check's budget, within the run's
    # The launched process tree as /proc shows it, sampled during the run (None: not a host process)
    procs: ProcessWatch | None = None
    clock: Callable[[], float] = time.perf_counter  # the harness's clock for what it times (checks/timing.py)
    # A client for another engine the harness boots (a fresh reference): (url, timeout_s) -> client
    # Another engine's client: (its url, timeout, its network namespace: a callable, as Launcher.netns)
    client_for: Callable[[str, float, Any], EngineClient] = lambda url, t, ns: EngineClient(
        url, timeout_s=t, netns=ns
    )
    # The run's prompts, drawn from a seed the engine never sees (checks/probes.py)
    probes: Probes = field(default_factory=Probes)
    # What a check's `prepare` started early, by check name; the check takes it, the pipeline closes the rest
    prepared: dict[str, Any] = field(default_factory=dict)
    # Called by boot once the engine answers, before boot's own requests: the `prepare` of checks marked
    # prepare_at_ready (the pipeline sets it; a --fail-fast run leaves it a no-op)
    engine_up: Callable[[], None] = lambda: None
    # Called by the launcher (on a thread of its own) once the engine's first process exists, before it
    # answers: the `prepare` of checks marked prepare_at_spawn (the pipeline sets it, as engine_up)
    engine_spawned: Callable[[], None] = lambda: None
    last_batch: CompletionResponse | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def generate(
        self,
        prompt: Any = None,
        *,
        mode: str = "auto",
        speculative: bool = False,
        max_tokens: int = GEN_TOKENS,
        drafts: list[list[int]] | None = None,
    ) -> CompletionResponse:
        return self.client.complete(
            CompletionRequest(
                prompt=PROMPTS if prompt is None else prompt,
                max_tokens=max_tokens,
                mode=mode,
                speculative=speculative,
                drafts=drafts,
            )
        )

    def capacity(self, mode: str = "auto") -> int:
        """The most prompts one request may carry (the engine's live slots; with graph mode, its largest
        graph batch too)."""
        if self.describe is None:
            return 4
        c = self.describe.capacity
        return max(1, min(c.max_num_seqs, c.graph_max_batch) if mode == "graph" else c.max_num_seqs)

    def fresh(self, n: int = len(PROMPTS)) -> list[Any]:
        """n prompts the engine has not been sent before in this run."""
        self._learn()
        return self.probes.fresh(n)

    def _learn(self) -> None:
        """The engine's tokenization, once, from a first request of fresh text (checks/probes.py)."""
        if self.probes.learned:
            return
        n = self.probes.rng.randint(2, min(4, self.capacity("eager")))
        texts = [self.probes.text() for _ in range(n)]
        resp = self.generate(texts, mode="eager")
        self.probes.learn(texts, resp)

    def ask(
        self,
        prompts: list[Any],
        *,
        mode: str = "auto",
        speculative: bool = False,
        max_tokens: int = GEN_TOKENS,
    ) -> CompletionResponse:
        """`prompts` sent among fillers in a batch of random size and order (a request the engine has not
        seen, shaped like every other); the answer keeps only their choices, in their order."""
        self._learn()
        texts = [isinstance(p, str) for p in prompts]
        if any(texts) and not all(texts):  # a batch is all text or all token ids: send them alone
            resp = self.generate(prompts, mode=mode, speculative=speculative, max_tokens=max_tokens)
            self.last_batch = resp
            return resp
        batch, where = self.probes.batch(prompts, self.capacity(mode))
        if any(isinstance(p, str) for p in batch) and not all(isinstance(p, str) for p in batch):
            batch, where = list(prompts), list(range(len(prompts)))
        resp = self.generate(batch, mode=mode, speculative=speculative, max_tokens=max_tokens)
        self.last_batch = resp  # the whole answer, fillers included (what the engine's counters count)
        by_index = {c.index: c for c in resp.choices}
        picked = []
        for i, pos in enumerate(where):
            c = by_index.get(pos)
            if c is not None:
                picked.append(c.model_copy(update={"index": i}))
        for pos, c in by_index.items():
            if pos not in where:
                self.probes.remember(batch[pos], c)
        return resp.model_copy(update={"choices": picked})

    def reask(self, *, mode: str = "auto", speculative: bool = False) -> Reask:
        """Teacher forcing in the candidate's configuration (mode, speculative): call it before anything
        changes the engine (a reload), since it must see the engine the candidate saw. The forcing request
        is an ordinary one: token ids among fillers and decoys, the usual number of tokens (cut here)."""

        def ask(prompt_ids: list[int], max_tokens: int) -> list[int] | None:
            self.probes.forcing_requests += 1
            if self.probes.prefix is None:  # text prompts: a token-id batch of one is all that works
                resp = self.generate([prompt_ids], mode=mode, speculative=speculative, max_tokens=max_tokens)
                return tokens(resp)[0] if well_formed(resp, 1) else None
            n = max(GEN_TOKENS, max_tokens)
            resp = self.ask([prompt_ids], mode=mode, speculative=speculative, max_tokens=n)
            return tokens(resp)[0][:max_tokens] if well_formed(resp, 1) else None

        return ask


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], Outcome]
    timeout_s: float  # per-check budget, bounded further by the run's --timeout
    needs_engine: bool = True  # False: still runs when the engine stopped answering (faults)
    # Called once boot passed, with the run's time left: start work that may overlap the checks before
    # this one, kept in ctx.prepared[name] (it must have close()).
    prepare: Callable[[Context, float], None] | None = None
    # True: `prepare` also runs as soon as the engine answers (Context.engine_up), beside boot's own
    # requests, for work that needs only a running engine (the layout check's peers import torch then).
    prepare_at_ready: bool = False
    # True: `prepare` runs even earlier, as soon as the engine's first process exists (Context.
    # engine_spawned, where the launcher can say so), for work that needs only that process's namespaces.
    prepare_at_spawn: bool = False
    # True: the check times the engine's steps, so nothing the harness started beside the engine (a warm
    # step compiling, launch/kernels.py) may share the GPU with it: the pipeline waits for that first.
    times_engine: bool = False


def fail_unless(conditions: dict[str, Cond], evidence: dict[str, Any]) -> Outcome:
    """Pass when every named condition holds; else fail naming the ones that did not (with what differed)."""
    for name, c in conditions.items():
        if not isinstance(c, Cond):  # every condition must say where its observation comes from
            raise TypeError(f"condition {name} has no source: use observed(), derived() or engine_says()")
    bad = [name + (f" ({c.detail})" if c.detail else "") for name, c in conditions.items() if not c.holds]
    if bad:
        return Outcome("fail", evidence, "not satisfied: " + "; ".join(bad), conditions)
    return Outcome("pass", evidence, None, conditions)


def choices(resp: CompletionResponse) -> list[Choice]:
    return sorted(resp.choices, key=lambda c: c.index)


def tokens(resp: CompletionResponse) -> list[list[int]]:
    return [c.token_ids for c in choices(resp)]


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


def compare_choices(
    ref: Choice, cand: Choice, reask: Reask | None = None, max_tokens: int | None = None
) -> dict[str, Any]:
    """The coherence rule for one prompt; after a near tie, teacher forcing through `reask` (when given and
    both runs reported the same prompt token ids). `max_tokens` truncates the reference (a longer run)."""
    rt, rg, r2 = ref.token_ids, ref.top2_gaps, ref.top2_ids
    if max_tokens is not None:
        rt, rg, r2 = rt[:max_tokens], rg[:max_tokens], r2[:max_tokens]
    kw = {
        "reference_top2": r2 or None,
        "candidate_gaps": cand.top2_gaps,
        "candidate_top2": cand.top2_ids or None,
    }
    report = compare_greedy(rt, rg, cand.token_ids, EPSILON, **kw)
    same_prompt = cand.prompt_token_ids and cand.prompt_token_ids == ref.prompt_token_ids
    if report.forcing == "missing" and reask is not None and same_prompt:
        d = report.first_divergence or 0
        forced = reask([*cand.prompt_token_ids, *rt[: d + 1]], len(rt) - d - 1)
        report = compare_greedy(rt, rg, cand.token_ids, EPSILON, forced_continuation=forced, **kw)
    return report.model_dump(mode="json")


def _coherence_summary(formed: bool, reports: list[dict[str, Any]], outcome: str) -> str:
    """One line, starting with the outcome: identical, near_tie (where), or differs (where and why)."""
    if not formed:
        return "differs: an answer was not well formed (missing prompts, tokens or gaps)"
    if outcome == "identical":
        return "identical"
    for i, r in enumerate(reports):
        if not r["agrees"]:
            where = r.get("reason") or f"token {r['first_divergence']}"
            return f"differs: prompt {i}: {where}"
    ties = [
        f"prompt {i} token {r['first_divergence']}"
        for i, r in enumerate(reports)
        if r["outcome"] == "near_tie"
    ]
    return (
        "near_tie at " + ", ".join(ties) + " (both runs report the swapped pair; teacher forcing identical)"
    )


def coherence(
    reference: CompletionResponse,
    candidate: CompletionResponse,
    prompts: int = len(PROMPTS),
    reask: Reask | None = None,
) -> dict[str, Any]:
    """The coherence rule applied prompt by prompt; `agrees` only when both answers are well formed for
    `prompts` prompts and every prompt agrees. `outcome` is identical, near_tie or differs; a near tie
    needs `reask` (teacher forcing) unless it is at the last token."""
    pairs = zip(choices(reference), choices(candidate), strict=False)
    reports = [compare_choices(a, b, reask) for a, b in pairs]
    formed = well_formed(reference, prompts) and well_formed(candidate, prompts)
    agrees = formed and all(r["agrees"] for r in reports)
    identical = formed and tokens(reference) == tokens(candidate)
    outcome = "identical" if identical else "near_tie" if agrees else "differs"
    return {
        "outcome": outcome,
        "summary": _coherence_summary(formed, reports, outcome),
        "agrees": agrees,
        "identical": identical,
        "well_formed": formed,
        "rule": reports[0]["rule"] if reports else None,
        "epsilon": EPSILON,
        "per_prompt": [
            {k: r.get(k) for k in ("outcome", "agrees", "first_divergence", "gap", "candidate_gap", "reason")}
            for r in reports
        ],
    }
