"""Probes an engine cannot tell from traffic (docs/generation.md, "Probes").

Every prompt the harness compares on is drawn fresh in each run from a random seed the engine never sees
(the receipt records it only after the engine stopped), so an engine cannot know the harness's prompts in
advance, and no answer it gave before can be replayed as the answer to a comparison: each comparison's two
requests differ in batch composition, order and size, each prompt of interest sitting among filler prompts
drawn for that request alone. Teacher-forcing requests are shaped like every other request: a batch of token
ids with the run's usual number of tokens to generate, mixed with fillers, among which are decoys built
exactly as a forcing request is (an earlier prompt, extended by the tokens answered for it up to its most
tie-like position, then the runner-up it reported there), so a request that extends an earlier answer by
its runner-up is no sign of forcing.

Prompts are sent as token ids. The harness learns the engine's tokenization once, from a first request of
fresh text: when every prompt came back as a common prefix (its specials) followed by the text's UTF-8
bytes, the harness encodes further text itself; an engine whose tokenizer is not byte-level gets text
prompts (forcing requests then stand out as token ids, and the evidence says so).
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field
from typing import Any

from qualify.protocol import CompletionResponse

WORDS = (
    "amber", "arc", "basin", "beacon", "birch", "cable", "canyon", "cedar", "cinder", "cobalt",
    "comet", "coral", "crane", "delta", "dune", "ember", "fable", "falcon", "fern", "flint", "forge",
    "garnet", "glacier", "harbor", "hazel", "heron", "indigo", "iris", "jasper", "juniper", "kelp",
    "kestrel", "lagoon", "lantern", "larch", "lichen", "linen", "lotus", "lumen", "maple", "marble",
    "meadow", "mesa", "mica", "mist", "nectar", "nimbus", "oak", "onyx", "orbit", "otter", "pebble",
    "pine", "plume", "prism", "quartz", "quill", "raven", "reef", "ridge", "river", "saffron", "sage",
    "shale", "sierra", "slate", "sparrow", "spruce", "summit", "tallow", "thistle", "thorn", "tide",
    "timber", "topaz", "tundra", "umber", "valley", "vapor", "velvet", "willow", "wren", "yarrow",
    "zephyr", "zinc",
)  # fmt: skip
PUNCT = ("", "", "", ",", ".", ":", ";")
MAX_FILLERS = 2  # prompts beside the wanted ones, at most (each costs the engine a sequence)
MAX_DECOYS = 64  # earlier answers kept as material for decoys


@dataclass
class Probes:
    """The run's prompt source. `seed` stays in the harness until the run ends (Pipeline reveals it)."""

    seed: int = field(default_factory=lambda: secrets.randbits(63))
    prefix: list[int] | None = None  # the engine's specials before a prompt's bytes; None: not byte-level
    learned: bool = False
    drawn: int = 0
    requests: int = 0
    forcing_requests: int = 0
    decoys_sent: int = 0
    _seen: set[tuple[int, ...]] = field(default_factory=set)
    _texts: set[str] = field(default_factory=set)
    _answers: list[tuple[list[int], list[int], list[list[int]], list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # ------------------------------------------------------------ drawing
    def text(self) -> str:
        """A fresh sentence of 2 to 9 words, never drawn before in this run."""
        while True:
            n = self.rng.randint(2, 9)
            words = [self.rng.choice(WORDS) + self.rng.choice(PUNCT) for _ in range(n)]
            words[0] = words[0].capitalize()
            t = " ".join(words)
            if t not in self._texts:
                self._texts.add(t)
                self.drawn += 1
                return t

    def encode(self, text: str) -> list[int] | str:
        return text if self.prefix is None else [*self.prefix, *text.encode()]

    def fresh(self, n: int) -> list[Any]:
        """n prompts the engine has not been sent in this run (token ids once the tokenization is learned)."""
        out: list[Any] = []
        while len(out) < n:
            p = self.encode(self.text())
            key = tuple(p) if isinstance(p, list) else (p,)
            if key not in self._seen:
                self._seen.add(key)
                out.append(p)
        return out

    def learn(self, texts: list[str], resp: CompletionResponse) -> None:
        """From the engine's answer to a batch of `texts`: is its tokenization a common prefix + bytes?"""
        self.learned = True
        ids = [c.prompt_token_ids for c in sorted(resp.choices, key=lambda c: c.index)]
        if len(ids) != len(texts) or any(not i for i in ids):
            return
        prefixes = set()
        for t, got in zip(texts, ids, strict=True):
            b = list(t.encode())
            if len(got) < len(b) or got[len(got) - len(b) :] != b:  # type: ignore[index]
                return
            prefixes.add(tuple(got[: len(got) - len(b)]))  # type: ignore[index]
        if len(prefixes) == 1:
            self.prefix = list(prefixes.pop())
            for t in texts:
                self._seen.add(tuple(self.encode(t)))  # type: ignore[arg-type]

    # ------------------------------------------------------------ decoys
    def remember(self, prompt: Any, resp_choice: Any) -> None:
        """An answer the engine gave, as material for decoys shaped like a forcing request."""
        if not isinstance(prompt, list) or not resp_choice.token_ids or len(self._answers) >= MAX_DECOYS:
            return
        c = resp_choice
        self._answers.append((list(prompt), list(c.token_ids), list(c.top2_ids), list(c.top2_gaps)))

    def decoy(self) -> list[int] | None:
        """An earlier prompt + its answer up to the most tie-like position + the runner-up reported there."""
        if not self._answers:
            return None
        prompt, toks, top2, gaps = self._answers[self.rng.randrange(len(self._answers))]
        if len(gaps) == len(toks) and gaps:
            low = min(gaps[:-1] or gaps)
            ks = [k for k, g in enumerate(gaps[:-1] or gaps) if g == low]
        else:
            ks = list(range(max(1, len(toks) - 1)))
        k = self.rng.choice(ks)
        runner = top2[k][1] if k < len(top2) and len(top2[k]) == 2 else (toks[k] + 1) % 256
        out = [*prompt, *toks[:k], runner]
        if tuple(out) in self._seen:
            return None
        self._seen.add(tuple(out))
        self.decoys_sent += 1
        return out

    # ------------------------------------------------------------ batches
    def batch(
        self, wanted: list[Any], capacity: int, *, at_least_one: bool = True
    ) -> tuple[list[Any], list[int]]:
        """`wanted` prompts at random places among fillers (fresh prompts and decoys) up to a random batch
        size within `capacity`; returns the batch and where each wanted prompt sits."""
        room = max(0, min(capacity, len(wanted) + MAX_FILLERS) - len(wanted))
        fill = self.rng.randint(1 if at_least_one and room else 0, room) if room else 0
        fillers: list[Any] = []
        for _ in range(fill):
            d = self.decoy() if self.prefix is not None and self.rng.random() < 0.5 else None
            fillers.extend([d] if d is not None else self.fresh(1))
        batch = [*wanted, *fillers]
        order = list(range(len(batch)))
        self.rng.shuffle(order)
        shuffled = [batch[i] for i in order]
        where = [order.index(i) for i in range(len(wanted))]
        self.requests += 1
        return shuffled, where

    def evidence(self) -> dict[str, Any]:
        return {
            "seed": f"{self.seed:016x}",  # hex: a 63-bit integer does not survive every JSON reader
            "tokenization": "byte-level: prompts sent as token ids" if self.prefix is not None else (
                "not byte-level: prompts sent as text, forcing requests as token ids"
            ),
            "prompts_drawn": self.drawn,
            "requests": self.requests,
            "forcing_requests": self.forcing_requests,
            "decoys": self.decoys_sent,
        }  # fmt: skip
