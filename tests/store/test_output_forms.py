"""One spelling across outputs: `log_index`, `root_hash`, RFC 3339 times with `Z`; and the RFC 9162 rule
that a consistency proof between equal sizes is empty and verifies."""

from __future__ import annotations

import json
import re

from receipts import merkle
from receipts.keys import SigningKey
from receipts.testing import synthetic_envelope

RFC3339_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_json_outputs_spell_log_index_root_hash_and_utc_times(cli, home, tmp_path) -> None:
    assert cli("keys", "generate").code == 0
    key = SigningKey.load(home / "keys" / "operator.key")
    path = tmp_path / "in.json"
    path.write_text(json.dumps(synthetic_envelope(key, 1)))
    imported = json.loads(cli("receipts", "import", path, "--json").out)
    rid = imported[0]["id"]
    outputs = {
        "import": imported,
        "list": json.loads(cli("receipts", "list", "--json").out),
        "show": json.loads(cli("receipts", "show", rid, "--json").out),
        "verify": json.loads(cli("receipts", "verify", rid, "--json").out),
        "checkpoint": json.loads(cli("log", "checkpoint", "--json").out),
        "log verify": json.loads(cli("log", "verify", "--json").out),
    }
    for name, value in outputs.items():
        keys = _keys(value if name != "show" else {k: v for k, v in value.items() if k != "predicate"})
        assert not keys & {"log_idx", "idx", "root"}, (name, keys)
    assert outputs["show"]["log_index"] == 1 and outputs["list"]["items"][0]["log_index"] == 1
    assert outputs["verify"][0]["log_index"] == 1
    assert len(outputs["checkpoint"]["root_hash"]) == 64 and len(outputs["log verify"]["root_hash"]) == 64
    for field in ("started_at", "finished_at"):
        assert RFC3339_Z.match(outputs["show"][field]), outputs["show"][field]
    human = cli("receipts", "show", rid).out
    assert re.search(r"\d\d:\d\d:\d\d(\.\d+)?Z → \d{4}-", human), human


def test_a_consistency_proof_between_equal_sizes_is_empty_and_verifies() -> None:
    # transparency-dev/merkle's vector "sizes-are-equal-one-and-proof-is-empty".
    root = merkle.root_hash([merkle.leaf_hash(b"")])
    assert merkle.consistency_proof([merkle.leaf_hash(b"")], 1) == []
    merkle.verify_consistency(1, 1, [], root, root)
