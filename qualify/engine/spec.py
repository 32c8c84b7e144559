"""MTP speculative decoding: draft num_spec tokens, verify 1 + num_spec per request in one step through the
KDA verify path (per-position state slots), accept the longest greedy-matching prefix plus a bonus token.

Rollback is free: verify writes the recurrent state after token j to slot column j, and the next step reads
column num_accepted - 1 (KDA.md §3). The short-conv state rolls back the same way: it is kept per position
too (the KDA layer reads column num_accepted - 1 and writes column j), so nothing is recomputed. Attention
KV of rejected tokens stays in the cache beyond the sequence length, and the next step overwrites it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .runner import Generation, ModeUnavailable


@dataclass
class SpecCounters:
    steps: int = 0  # verify steps
    request_rounds: int = 0  # (request, verify step) pairs: each drafts num_spec tokens
    drafted: int = 0
    accepted: int = 0  # draft tokens accepted (the bonus token is not counted)
    emitted: int = 0  # tokens produced: accepted drafts + one bonus per request-step

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "spec_steps": self.steps,
            "spec_request_rounds": self.request_rounds,
            "spec_drafted": self.drafted,
            "spec_accepted": self.accepted,
            "spec_emitted": self.emitted,
            "spec_acceptance_rate": self.acceptance_rate,
        }


def accept_greedy(draft: Tensor, target: Tensor) -> Tensor:
    """Matched draft count m per request: the longest prefix with draft[:, j] == target[:, j].

    draft [n, S]: proposed tokens; target [n, S + 1]: the target's greedy token after verify token j
    (token 0 is the last accepted token, token j >= 1 is draft j - 1). The request then emits
    target[:, :m + 1] (m accepted drafts and the bonus token) and its num_accepted becomes m + 1.
    """
    n, S = draft.shape
    if target.shape != (n, S + 1):
        raise ValueError(f"target must be [n, num_spec + 1] = {(n, S + 1)}, got {tuple(target.shape)}")
    if S == 0:
        return torch.zeros(n, dtype=torch.long, device=draft.device)
    match = (draft == target[:, :S]).long()
    return match.cumprod(dim=1).sum(dim=1)


Drafter = Callable[[list, Tensor, Tensor, int], Tensor]


@torch.no_grad()
def mtp_draft(model, hidden: Tensor, last: Tensor, num_spec: int) -> Tensor:
    """The MTP layer proposes num_spec tokens autoregressively: (target hidden, last token) -> token 1;
    then its own output hidden and the token it drafted -> the next one. Returns [n, num_spec] token ids."""
    h, tok, out = hidden, last, []
    for _ in range(num_spec):
        h = model.mtp(h, model.embed(tok))
        tok = model.lm_head(h).float().argmax(dim=-1)
        out.append(tok)
    return torch.stack(out, dim=1)


@torch.no_grad()
def verify_step(
    engine, reqs: list, tokens: list[list[int]], accepted: list[int], mode: str = "auto"
) -> tuple[Tensor, Tensor, str]:
    """One verify step: T tokens per request through the KDA verify path (graph replay when one fits).

    Each request reads its entering KDA and conv state from slot column accepted[r] - 1 and writes the
    state after token j to column j. Returns (logits [n*T, vocab], hidden [n*T, hidden], mode used)."""
    runner, graphs = engine.runner, engine.runner.graphs
    n, T = len(reqs), len(tokens[0])
    n_pad = graphs.padded_size(n, T) if graphs is not None and mode != "eager" else None
    if n_pad is None and mode == "graph":
        raise ModeUnavailable(
            "mode 'graph' needs a captured verify graph for this batch (POST /qualify/capture first, "
            "on a CUDA device with cudagraph_mode full); use mode 'auto' or 'eager'"
        )
    used = "graph" if n_pad is not None else "eager"
    n_pad = n_pad or n
    runner.stage_decode(reqs, n_pad, T, tokens)
    # The runner stages plain-decode counts (accepted = 1); verify reads the column after the last accepted
    # token of the previous step instead. Padding rows keep accepted = 1 (fill) with the null slot.
    runner.arena.stage("num_accepted", accepted, fill=1)
    if used == "graph":
        graphs.replay(n_pad, T)
    else:
        runner.forward_decode_static(n_pad, T)
        engine.counters.eager_steps += 1
    rows = n * T
    return runner.static.logits[:rows], runner.static.hidden[:rows], used


def _prefill(runner, reqs: list) -> Tensor:
    """Prefill every prompt (grouped within max_num_batched_tokens); append each first token; return the
    target's hidden state at each prompt's last token [N, hidden] (what the MTP layer drafts from)."""
    hidden, todo = [], list(reqs)
    while todo:
        batch, budget = [], runner.cfg.max_num_batched_tokens
        while todo and len(todo[0].prompt) <= budget:
            budget -= len(todo[0].prompt)
            batch.append(todo.pop(0))
        toks, gaps, seconds = runner.timed_prefill(batch)
        hidden.append(runner.prefill_hidden)
        for r, t, g, t2 in zip(batch, toks, gaps, seconds, strict=True):
            runner._append(r, t, g, t2)
    return torch.cat(hidden)


def given_drafts(
    engine, prompts: list[list[int]], drafts: list[list[int]]
) -> Callable[[int], list[int] | None]:
    """Caller-supplied drafts (the protocol's `drafts`): one prompt, num_spec ids in the vocabulary per verify
    step. Returns step -> that step's drafts (None past the list: the MTP layer drafts)."""
    S, vocab = engine.cfg.num_spec, engine.cfg.shape.vocab
    if len(prompts) != 1:
        raise ValueError("drafts apply to one prompt: send a batch of one")
    for s, row in enumerate(drafts):
        if len(row) != S:
            raise ValueError(
                f"drafts[{s}] has {len(row)} tokens; this engine verifies num_spec = {S} per step"
            )
        if any(not 0 <= t < vocab for t in row):
            raise ValueError(f"drafts[{s}]: token ids must lie in [0, {vocab})")
    return lambda step: list(drafts[step]) if step < len(drafts) else None


@torch.no_grad()
def speculative_generate(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    mode: str = "auto",
    drafter: Drafter | None = None,
    drafts: list[list[int]] | None = None,
) -> tuple[list, str, SpecCounters]:
    """Greedy generation with MTP drafts and one verify step per round; the same tokens as plain greedy
    decoding under the coherence rule. `drafter(reqs, hidden, last, num_spec)` replaces the MTP layer
    (tests use it to force partial acceptance); `drafts` (one prompt) are verified at the first steps
    instead of any drafter's (the harness's proof of acceptance). Each generation reports the drafts it
    accepted per verify step. Returns (generations, mode used, this call's counters)."""
    cfg, runner = engine.cfg, engine.runner
    S = cfg.num_spec
    if S == 0:
        raise ModeUnavailable("speculative decoding needs an engine started with num_spec > 0")
    forced = given_drafts(engine, prompts, drafts) if drafts is not None else lambda _step: None
    if drafter is None:

        def drafter(_reqs, hidden, last, k):
            return mtp_draft(engine.model, hidden, last, k)

    engine.counters.requests += 1  # like Engine.generate
    stats = SpecCounters()
    # A verify step writes up to num_spec tokens past the last one kept: reserve room for them.
    runner.check_admission(prompts, max_tokens + S)
    reqs = [runner.admit(p, max_tokens + S) for p in prompts]
    for r in reqs:
        r.max_tokens = max_tokens
        r.accepted_steps = []
    modes: set[str] = set()
    try:
        hidden = _prefill(runner, reqs)
        live = [i for i, r in enumerate(reqs) if not r.done]
        running = [reqs[i] for i in live]
        hidden = hidden[live]
        accepted = [1] * len(running)  # prefill leaves each request's state in slot column 0
        while running:
            n = len(running)
            last = torch.tensor([r.output[-1] for r in running], device=engine.device)
            given = forced(stats.steps)
            if given is not None:
                proposed = torch.tensor([given], dtype=torch.long, device=engine.device)
            else:
                proposed = drafter(running, hidden, last, S).to(torch.long)
            draft_rows = proposed.tolist()
            tokens = [[r.output[-1], *d] for r, d in zip(running, draft_rows, strict=True)]
            logits, h, used = verify_step(engine, running, tokens, accepted, mode)
            modes.add(used)
            toks, gaps, seconds = runner.pick_top2(logits)
            target = torch.tensor(toks, device=proposed.device).view(n, S + 1)
            matched = accept_greedy(proposed, target).tolist()
            keep_rows, next_accepted = [], []
            for i, (r, m) in enumerate(zip(running, matched, strict=True)):
                for j in range(m + 1):  # m accepted drafts, then the bonus token
                    k = i * (S + 1) + j
                    runner._append(r, toks[k], gaps[k], seconds[k])
                    stats.emitted += 1
                    if r.done:
                        break
                r.accepted_steps.append(m)
                stats.request_rounds += 1
                stats.drafted += S
                stats.accepted += m
                if r.done:
                    runner.release(r)
                else:
                    keep_rows.append(i * (S + 1) + m)  # the target's hidden at the last kept token
                    next_accepted.append(m + 1)
            stats.steps += 1
            running = [r for r in running if not r.done]
            hidden = h[torch.tensor(keep_rows, dtype=torch.long, device=h.device)]
            accepted = next_accepted
    finally:
        for r in reqs:
            runner.release(r)
    engine.counters.spec_drafted += stats.drafted
    engine.counters.spec_accepted += stats.accepted
    used = "mixed" if len(modes) > 1 else (modes.pop() if modes else "eager")
    gens = [Generation.of(r) for r in reqs]
    return gens, used, stats
