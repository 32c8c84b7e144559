"""What the benchmarks share: timing contenders in interleaved rounds, and printing the JSON result
and writing the same text to --out."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable


def interleaved_medians(
    contenders: dict[str, Callable[[], dict[str, list[float]]]], rounds: int
) -> dict[str, dict[str, float]]:
    """Run each contender's measurement once per round, the order rotating every round, so that clock
    ramps and a neighbour's cache state fall on every contender alike rather than on whoever runs first.
    A measurement returns samples per measure name; the result is each measure's median over all rounds."""
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in contenders}
    labels = list(contenders)
    for r in range(rounds):
        shift = r % len(labels)
        for k in labels[shift:] + labels[:shift]:
            for measure, xs in contenders[k]().items():
                samples[k].setdefault(measure, []).extend(xs)
    return {k: {m: statistics.median(xs) for m, xs in ms.items()} for k, ms in samples.items()}


def write_result(result: dict, out: str | None, *, indent: int = 2) -> None:
    """Print `result` as JSON; with `out`, write the same text there (its folder made if missing)."""
    text = json.dumps(result, indent=indent, default=str)
    print(text)
    if out:
        folder = os.path.dirname(out)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
