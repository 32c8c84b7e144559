"""The README's sample outputs, from a real run: two CPU runs of `qualify run` (one that qualifies, one
rejected for a layout it does not register) in a private QUALIFY_HOME, their exact envelopes and the
operator's public key saved under docs/samples/, and `qualify receipts show` of each (an excerpt: the
header, the facts and the layout check) written there and into the README between its sample markers.

    .venv/bin/python scripts/readme_samples.py            # run, save, rewrite the README blocks
    .venv/bin/python scripts/readme_samples.py --rerender # the saved receipts, printed by the current code
    .venv/bin/python scripts/readme_samples.py --check    # README blocks == docs/samples/*.txt (no run)

tests/store/test_readme_samples.py re-renders each saved receipt with the current code and compares it
with the sample, and checks that every condition the sample names still exists in qualify/checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "docs" / "samples"
README = ROOT / "README.md"
# name -> the `qualify run` arguments that make it
RUNS = {
    "qualified": ["--layout", "2304,2304,2304,9216"],
    "rejected": ["--layout", "2304,2304,9216"],
}
# Which checks the excerpt shows in full (the others are folded into "…").
SHOWN_CHECKS = {"qualified": ("layout",), "rejected": ("layout",)}
MARK = "<!-- sample: receipts-show-{name} (scripts/readme_samples.py) -->"
END = "<!-- /sample -->"


def excerpt(full: str, name: str) -> str:
    """The header, the facts and the chosen checks of a `receipts show` text; other checks become "…"."""
    lines = full.rstrip("\n").split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("checks (condition"))
    except StopIteration:
        return full
    # The legend runs from "checks (condition, ..." to the line that ends with "):".
    legend_end = next((i for i in range(start, len(lines)) if lines[i].rstrip().endswith("):")), start)
    head, checks, tail = lines[: legend_end + 1], [], []
    body = lines[legend_end + 1 :]
    end = next((i for i, line in enumerate(body) if not line.strip()), len(body))
    body, tail = body[:end], body[end:]
    keep, folded = False, False
    for line in body:
        if re.match(r"^  \S", line):  # a check's own line
            keep = line.split()[0] in SHOWN_CHECKS[name]
            if not keep and not folded:
                checks.append("  …")
            folded = not keep
        if keep:
            checks.append(line)
    out = head + checks + tail
    return "\n".join(line.rstrip() for line in out) + "\n"


def block(name: str, text: str) -> str:
    indented = "".join(("    " + line).rstrip() + "\n" for line in text.splitlines())
    return f"{MARK.format(name=name)}\n\n{indented}\n{END}"


def readme_blocks(readme: str) -> dict[str, str]:
    """The sample blocks the README holds, by name."""
    out = {}
    for name in RUNS:
        mark = MARK.format(name=name)
        if mark in readme:
            start = readme.index(mark)
            out[name] = readme[start : readme.index(END, start) + len(END)]
    return out


def _qualify(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUALIFY_HOME": str(home), "COLUMNS": "200"}
    env.pop("QUALIFY_DB_URL", None)
    exe = ROOT / ".venv" / "bin" / "qualify"
    done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=900)
    if check and done.returncode not in (0, 1):
        raise SystemExit(f"qualify {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def generate() -> None:
    home = Path(tempfile.mkdtemp(prefix="qualify-readme-samples-"))
    try:
        SAMPLES.mkdir(parents=True, exist_ok=True)
        for name, args in RUNS.items():
            ran = _qualify(home, "run", *args, "--json")
            summary = json.loads(ran.stdout)
            rid = summary["receipt_id"]
            envelope = _qualify(home, "receipts", "show", rid, "--envelope").stdout
            (SAMPLES / f"{name}.dsse.json").write_text(envelope)
            full = _qualify(home, "receipts", "show", rid).stdout
            (SAMPLES / f"{name}.txt").write_text(excerpt(full, name))
            print(f"{name}: receipt {rid} ({summary['verdict']})")
        (SAMPLES / "operator.pub").write_text(_qualify(home, "keys", "export-public").stdout)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rewrite_readme()


def rerender() -> None:
    """The excerpts again from the saved envelopes (no new run), as the current code prints them."""
    home = Path(tempfile.mkdtemp(prefix="qualify-readme-samples-"))
    try:
        url = f"sqlite:///{home / 'samples.db'}"
        _qualify(home, "keys", "trust", str(SAMPLES / "operator.pub"), "--db", url)
        for name in RUNS:
            done = _qualify(
                home, "receipts", "import", str(SAMPLES / f"{name}.dsse.json"), "--db", url, "--json"
            )
            rid = json.loads(done.stdout)[0]["id"]
            full = _qualify(home, "receipts", "show", rid, "--db", url).stdout
            (SAMPLES / f"{name}.txt").write_text(excerpt(full, name))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rewrite_readme()


def rewrite_readme() -> None:
    readme = README.read_text()
    for name, old in readme_blocks(readme).items():
        readme = readme.replace(old, block(name, (SAMPLES / f"{name}.txt").read_text()))
    README.write_text(readme)


def check() -> int:
    readme = README.read_text()
    found = readme_blocks(readme)
    bad = [n for n in RUNS if found.get(n) != block(n, (SAMPLES / f"{n}.txt").read_text())]
    for name in bad:
        print(f"README sample {name!r} differs from docs/samples/{name}.txt: run scripts/readme_samples.py")
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; run nothing")
    parser.add_argument(
        "--rerender", action="store_true", help="re-render the saved receipts with the current code (no run)"
    )
    args = parser.parse_args()
    if args.check:
        sys.exit(check())
    if args.rerender:
        rerender()
        return
    generate()


if __name__ == "__main__":
    main()
