"""What the benchmarks share: printing the JSON result and writing the same text to --out."""

from __future__ import annotations

import json
import os


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
