"""The harness's drafted runs (checks/speculation.py) when a prompt's plain reference stops early: the steps
after the stop are unpredictable, so another fresh prompt is tried (at most SPEC_DRAFT_PROMPTS) until every
j has a step the harness can predict. On the H200 (2026-12-03) an honest engine was rejected this way: a
near tie at the second token left j = 2 and 3 without a predictable step.

The engine here is a scripted stand-in behind a duck-typed context: greedy tokens are a fixed function of
the sequence, and verify steps accept the longest prefix of the drafts that matches them (as an honest
engine does); `stop` names which drafted prompts (1 = the first) reach a stop token at their second token."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from qualify.checks import speculation
from qualify.protocol import Choice, CompletionResponse, Counters, Usage

N, EOS = 3, 2


class Stand:
    def __init__(self, stop: set[int], liar: bool = False) -> None:
        self.stop, self.liar = stop, liar
        self.request = SimpleNamespace(num_spec=N)
        self.target = "cpu"
        self.clock = time.perf_counter
        self.counters = Counters()
        self.client = SimpleNamespace(describe=lambda: SimpleNamespace(counters=self.counters.model_copy()))
        self.last_batch: CompletionResponse | None = None
        self.drawn = 0
        self.stoppers: set[tuple[int, ...]] = set()

    # ---------------------------------------------------------------- the engine
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and (not out or out[-1] != EOS):
            if tuple(prompt) in self.stoppers and len(out) == 1:
                out.append(EOS)
            else:
                seq = prompt + out
                out.append((sum(seq) * 31 + len(seq) * 7) % 200 + 3)
        return out

    def run(self, prompt: list[int], n: int, spec: bool, drafts: list[list[int]] | None) -> Choice:
        g = self.greedy(prompt, n + N + 1)
        if not spec:
            out, per = g[:n], None
        else:
            out, per, s = g[:1], [], 0
            while len(out) < n and out[-1] != EOS:
                row = drafts[s] if drafts is not None and s < len(drafts) else [0] * N
                truth = g[len(out) : len(out) + N + 1]
                m = 0
                while m < N and m < len(truth) - 1 and row[m] == truth[m]:
                    m += 1
                new = row[:m] + [truth[m]] if m < len(truth) else row[:m]
                if EOS in new:
                    new = new[: new.index(EOS) + 1]
                out += new
                out = out[:n]
                claimed = N if self.liar else m
                per.append(claimed)
                self.counters.spec_drafted += N
                self.counters.spec_accepted += claimed
                s += 1
        return Choice(
            index=0, token_ids=out, text="", top2_gaps=[1.0] * len(out),
            finish_reason="stop" if out[-1] == EOS else "length",
            top2_ids=[[t, (t + 1) % 256] for t in out], prompt_token_ids=prompt, accepted_per_step=per,
        )  # fmt: skip

    def answer(self, prompts: list[list[int]], n: int, spec: bool, drafts=None) -> CompletionResponse:
        chs = [self.run(p, n, spec, drafts).model_copy(update={"index": i}) for i, p in enumerate(prompts)]
        usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        return CompletionResponse(choices=chs, mode_used="eager", usage=usage)

    # ---------------------------------------------------------------- the context's verbs
    def fresh(self, n: int) -> list[Any]:
        self.drawn += 1
        prompt = [1, 60 + self.drawn, 61 + self.drawn * 3]
        if self.drawn in self.stop:  # the first draw is drafted prompt 1 (the plain prompts are given)
            self.stoppers.add(tuple(prompt))
        return [prompt]

    def ask(self, prompts, *, speculative=False, max_tokens=12, mode="auto") -> CompletionResponse:
        self.last_batch = self.answer(prompts, max_tokens, speculative)
        return self.last_batch

    def generate(self, prompts, *, speculative=False, max_tokens=12, drafts=None, mode="auto"):
        return self.answer(prompts, max_tokens, speculative, drafts)

    def reask(self, *, speculative=False, mode="auto"):
        return lambda prompt_ids, n: self.greedy(prompt_ids, n)


def _prove(stand: Stand) -> tuple[dict, dict]:
    prompts = [[1, 40, 41], [1, 50, 51]]
    plain = stand.answer(prompts, 12, False)
    conditions, evidence = speculation.prove(stand, plain, prompts)  # type: ignore[arg-type]
    return {k: (c.holds, c.detail) for k, c in conditions.items()}, evidence


def test_a_drafted_prompt_whose_reference_stops_early_is_set_aside_for_another() -> None:
    conds, ev = _prove(Stand(stop={1}))
    assert all(holds for holds, _ in conds.values()), conds
    (aside,) = ev["speculative_drafts_set_aside"]
    assert all(w is None for d in aside for w in d["expected_per_step"])  # nothing predictable after the stop
    assert [d["j"] for d in ev["speculative_drafts"]] == [0, 1, 2, 3]
    for d in ev["speculative_drafts"]:
        assert d["expected_per_step"][0] == d["j"] and d["counts_as_expected"]
    assert all(ev["acceptance_histogram"][str(k)] > 0 for k in range(N + 1))
    assert conds["speculative_drafts_reproduce_plain"][1].startswith("prompt 1: j=0: identical")


def test_the_prompts_tried_are_bounded_and_an_engine_with_no_predictable_prompt_is_not_credited() -> None:
    stand = Stand(stop={1, 2, 3, 4})
    conds, ev = _prove(stand)
    assert len(ev["speculative_drafts_set_aside"]) == speculation.SPEC_DRAFT_PROMPTS - 1
    assert stand.drawn == speculation.SPEC_DRAFT_PROMPTS
    assert conds["spec_accepts_exactly_j"][0] is False
    assert "acceptance histogram" in conds["spec_accepts_exactly_j"][1]


def test_a_first_prompt_that_covers_every_j_is_the_only_one_tried() -> None:
    stand = Stand(stop=set())
    conds, ev = _prove(stand)
    assert stand.drawn == 1 and ev["speculative_drafts_set_aside"] == []
    assert all(holds for holds, _ in conds.values()), conds


def test_claims_on_a_set_aside_prompt_are_judged_too() -> None:
    # An engine that claims every draft accepted: its claims fail on every prompt tried, the set-aside
    # ones included.
    conds, ev = _prove(Stand(stop={1}, liar=True))
    assert conds["spec_claims_match_output"][0] is False
    assert "prompt 1: j=0" in conds["spec_claims_match_output"][1]
