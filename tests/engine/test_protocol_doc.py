"""docs/engine-openapi.json is the engine protocol as the code serves it: regenerate it with
`python -m qualify.engine openapi --out docs/engine-openapi.json` when the routes or messages change."""

from __future__ import annotations

import json
from pathlib import Path

from qualify.engine.server import protocol_openapi

ROOT = Path(__file__).resolve().parents[2]


def test_the_published_openapi_document_is_what_the_engine_serves():
    committed = json.loads((ROOT / "docs" / "engine-openapi.json").read_text())
    assert committed == json.loads(json.dumps(protocol_openapi()))


def test_protocol_md_names_every_endpoint_of_the_contract():
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    for path in protocol_openapi()["paths"]:
        assert f"`{path}`" in text or f" {path}`" in text, path
