"""The README's `receipts show` samples come from real runs and stay true: the README holds exactly what
scripts/readme_samples.py wrote, the current code prints exactly that for the saved receipts, and every
check condition the samples name is one qualify/checks still records."""

from __future__ import annotations

import importlib.util
import json
import re
from base64 import b64decode
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "docs" / "samples"


def _script():
    spec = importlib.util.spec_from_file_location("readme_samples", ROOT / "scripts" / "readme_samples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


samples = _script()


def test_the_readme_holds_the_generated_samples() -> None:
    blocks = samples.readme_blocks((ROOT / "README.md").read_text())
    assert set(blocks) == set(samples.RUNS)
    for name in samples.RUNS:
        assert blocks[name] == samples.block(name, (SAMPLES / f"{name}.txt").read_text()), name


def test_the_current_code_prints_the_samples_for_the_saved_receipts(cli, home, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'samples.db'}"
    assert cli("keys", "trust", SAMPLES / "operator.pub", "--db", url).code == 0
    for name in samples.RUNS:  # in run order: the log indices are those of the real runs
        imported = cli("receipts", "import", SAMPLES / f"{name}.dsse.json", "--db", url, "--json")
        assert imported.code == 0, imported.err
        rid = json.loads(imported.out)[0]["id"]
        shown = cli("receipts", "show", rid, "--db", url)
        assert shown.code == 0, shown.err
        assert samples.excerpt(shown.out, name) == (SAMPLES / f"{name}.txt").read_text(), name


def _conditions(envelope: Path) -> set[str]:
    statement = json.loads(b64decode(json.loads(envelope.read_text())["payload"]))
    return {c for check in statement["predicate"]["checks"] for c in (check.get("conditions") or {})}


@pytest.mark.parametrize("name", sorted(samples.RUNS))
def test_every_condition_in_the_samples_is_one_the_checks_still_record(name: str) -> None:
    """A sample naming a condition the code no longer records (peer_ok, say) is stale: run the script."""
    source = "\n".join(p.read_text() for p in (ROOT / "qualify" / "checks").glob("*.py"))
    names = _conditions(SAMPLES / f"{name}.dsse.json")
    assert names
    stale = sorted(n for n in names if not re.search(rf"[\"']{re.escape(n)}[\"']", source))
    assert not stale, f"conditions no longer in qualify/checks: {stale}; rerun scripts/readme_samples.py"
