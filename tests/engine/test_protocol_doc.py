"""docs/engine-openapi.json is the engine protocol as the code serves it: regenerate it with
`python -m qualify.engine openapi --out docs/engine-openapi.json` when the routes or messages change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.engine.server import protocol_openapi

ROOT = Path(__file__).resolve().parents[2]


def test_the_published_openapi_document_is_what_the_engine_serves():
    committed = json.loads((ROOT / "docs" / "engine-openapi.json").read_text())
    assert committed == json.loads(json.dumps(protocol_openapi()))


def test_protocol_md_names_every_endpoint_of_the_contract():
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    for path in protocol_openapi()["paths"]:
        assert f"`{path}`" in text or f" {path}`" in text, path


# ---------------------------------------------------------------- the documents, the openapi and the models

DOCS = "\n".join((ROOT / "docs" / name).read_text() for name in ("PROTOCOL.md", "PEER.md", "generation.md"))


def _backticked_words(text: str) -> set[str]:
    import re

    return {w for span in re.findall(r"`([^`]+)`", text) for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def _fields(model, seen: set | None = None) -> set[str]:
    """Every field name of a pydantic model and of the models its fields hold."""
    import typing

    from pydantic import BaseModel

    seen = set() if seen is None else seen
    if model in seen:
        return set()
    seen.add(model)
    out: set[str] = set()
    for name, f in model.model_fields.items():
        out.add(name)
        stack = [f.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                out |= _fields(t, seen)
            stack.extend(typing.get_args(t))
    return out


def test_every_field_of_every_message_is_named_in_the_documents():
    from qualify import protocol as p

    words = _backticked_words(DOCS)
    models = [p.Describe, p.Health, p.CompletionRequest, p.CompletionResponse, p.ReloadRequest,
              p.ReloadResponse, p.CaptureResponse, p.ProbeResponse, p.KvHandles, p.KvFillRequest,
              p.KvEchoRequest, p.KvDigest, p.ErrorBody, p.EngineManifest, p.LaunchDocument]  # fmt: skip
    missing = {m.__name__: sorted(_fields(m) - words) for m in models}
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}


def test_the_config_keys_boot_compares_and_the_version_are_documented():
    from qualify.protocol import PROTOCOL_VERSION

    words = _backticked_words(DOCS)
    keys = {"preset", "kda_decode_backend", "num_spec", "layer_pattern", "block_size", "dcp_size",
            "dcp_ranks", "max_num_seqs", "max_model_len", "seed", "capture_sizes"}  # fmt: skip
    assert keys <= words
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    assert f"protocol version **{PROTOCOL_VERSION}**" in text
    assert protocol_openapi()["info"]["version"] == PROTOCOL_VERSION


def test_errors_are_one_shape_in_the_openapi_and_the_code():
    """422 is {"error": ...} like every other error (never FastAPI's {"detail": [...]}), in the document and
    in what the reference engine answers; /metrics is Prometheus text in both."""
    from fastapi.testclient import TestClient

    from qualify.engine.server import METRICS_CONTENT_TYPE

    committed = json.loads((ROOT / "docs" / "engine-openapi.json").read_text())
    assert "HTTPValidationError" not in committed["components"]["schemas"]
    for path, ops in committed["paths"].items():
        for op in ops.values():
            for status, r in op["responses"].items():
                if status == "422" or status == "default":
                    ref = r["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/ErrorBody", (path, status)
    metrics = committed["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [METRICS_CONTENT_TYPE]
    assert f"`{METRICS_CONTENT_TYPE}`" in (ROOT / "docs" / "PROTOCOL.md").read_text()
    from types import SimpleNamespace

    import torch

    from qualify.engine.server import create_app

    app = create_app(SimpleNamespace(device=torch.device("cpu")))  # type: ignore[arg-type]
    try:
        r = TestClient(app).post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "bogus": 1})
        assert r.status_code == 422 and set(r.json()) == {"error"}
        assert r.json()["error"]["type"] == "ValidationError"
    finally:
        app.state.engine_worker.shutdown(wait=False)


@pytest.mark.parametrize("dims", ["reference", "second"])
@pytest.mark.parametrize(("dcp", "ranks"), [(4, 1), (2, 2), (1, 1)])
@pytest.mark.parametrize("num_spec", [0, 2])
def test_the_launch_documents_groups_are_the_peers(dims, dcp, ranks, num_spec):
    """What the harness sends (qualify/run/launch.py) is what its own peer expects (qualify/engine/peer.py,
    which must stand alone in a container), whatever the engine's model dimensions."""
    from qualify.engine import peer
    from qualify.protocol import LaunchCapacity, LaunchGeometry, ModelDims
    from qualify.run import launch

    m = ModelDims(kda_heads=2, kda_head_dim=16, conv_width=4, attn_kv_heads=1, attn_head_dim=16, vocab=260)
    if dims == "second":
        m = ModelDims(kda_heads=3, kda_head_dim=8, conv_width=3, attn_kv_heads=2, attn_head_dim=8, vocab=260)
    g = LaunchGeometry(layer_pattern="KKKAKKKA", group_size=2, block_size=2304, dcp_size=dcp, dcp_ranks=ranks,
                       kv_dtype="float32")  # fmt: skip
    cap = LaunchCapacity(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=4096, num_spec=num_spec)
    sent = launch.kv_groups(g, cap, m)
    flat = {**g.model_dump(), **cap.model_dump(), **m.model_dump(), "dtype": g.kv_dtype}
    want = peer.derive_groups(flat)
    assert [(s.name, s.kind, s.layers) for s in sent] == [(w["name"], w["kind"], w["layers"]) for w in want]
    for s, w in zip(sent, want, strict=True):
        views, probe, nbytes = peer.expected_views(w["kind"], w["layers"], flat)
        assert [v.model_dump() for v in s.views] == views
        assert (s.probe.offset, s.nbytes, s.span) == (probe, nbytes, peer.span_of(w["kind"], flat))


def test_the_reference_engine_refuses_a_launch_document_it_cannot_honour(tmp_path):
    """Model dims that are not its preset's, or another protocol version: exit 2, one line, before boot."""
    import subprocess
    import sys

    from qualify.engine.__main__ import manifest
    from qualify.protocol import EngineManifest
    from qualify.run import launch
    from qualify.run.request import RunRequest

    req = RunRequest(layout=None, kda_backend="auto", spec="none", num_spec=0, preset="tiny",
                     launcher="local", image=None, gpus=None, timeout_s=60, mem_limit=None,
                     db_url="sqlite://", key_path="", json_output=True)  # fmt: skip
    m = EngineManifest.model_validate(manifest())
    other = m.model_copy(update={"presets": {"tiny": m.presets["tiny"].model_copy(update={"conv_width": 3})}})
    for man, version, says in ((other, "2", "is not preset tiny's"), (m, "9", "speaks protocol 9")):
        doc = launch.build(
            req, man, "cpu", weights_path=str(tmp_path / "w.safetensors"), scratch_dir=str(tmp_path)
        )
        path = tmp_path / "launch.json"
        path.write_text(doc.model_copy(update={"protocol_version": version}).model_dump_json())
        r = subprocess.run([sys.executable, "-m", "qualify.engine", "serve", "--launch", str(path)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr


def test_a_launch_documents_weights_wait_is_written_only_where_the_harness_asks_for_one():
    """An engine that reads its launch document strictly against the schema before weights.wait_s sees the
    same document as before unless the harness starts it beside the seeding of its weights."""
    from qualify.protocol import LaunchWeights

    assert json.loads(LaunchWeights(path="/w").model_dump_json()) == {"path": "/w", "seed": 0, "create": True}
    asked = json.loads(LaunchWeights(path="/w", create=False, wait_s=600).model_dump_json())
    assert asked["wait_s"] == 600 and LaunchWeights.model_validate(asked).wait_s == 600
    with pytest.raises(ValueError):
        LaunchWeights(path="/w", wait_s=-1)
