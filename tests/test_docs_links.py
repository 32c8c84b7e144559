"""Every tracked document stands alone in a clone: its links and the paths it names in backquotes point
at files inside the repository that exist, never at `../shared` or anything else outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# [text](target) links, and `path/like/this.md` names in backquotes (how the docs cite a file).
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
QUOTED_DOC = re.compile(r"`([^`\s]*\.md)`")


def tracked_docs() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines() if line]


def outside_or_missing(doc: Path, text: str) -> list[str]:
    """Each local link or quoted .md path in `text` that leaves the repository or names no file."""
    bad = []
    targets = LINK.findall(text) + QUOTED_DOC.findall(text)
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... are not files
            continue
        # A quoted path is relative to the repository root or to the document, as the docs use both.
        candidates = [(doc.parent / target).resolve(), (ROOT / target).resolve()]
        inside = [c for c in candidates if c.is_relative_to(ROOT)]
        if not inside or not any(c.exists() for c in inside):
            bad.append(f"{doc.relative_to(ROOT)}: {target}")
    return bad


def test_no_tracked_doc_links_outside_the_repository() -> None:
    docs = tracked_docs()
    assert ROOT / "docs" / "ARCHITECTURE.md" in docs and ROOT / "README.md" in docs
    bad = [b for doc in docs for b in outside_or_missing(doc, doc.read_text(encoding="utf-8"))]
    assert bad == []
    assert not [d for d in docs if "../shared" in d.read_text(encoding="utf-8")]


def test_the_check_catches_a_link_outside_and_a_missing_file() -> None:
    doc = ROOT / "docs" / "ARCHITECTURE.md"
    text = "See [the design](../shared/DESIGN.md), `../shared/KDA.md` and [gone](NOPE.md); [ok](KDA.md)."
    assert outside_or_missing(doc, text) == [
        "docs/ARCHITECTURE.md: ../shared/DESIGN.md",
        "docs/ARCHITECTURE.md: NOPE.md",
        "docs/ARCHITECTURE.md: ../shared/KDA.md",
    ]
