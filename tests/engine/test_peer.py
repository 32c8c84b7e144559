"""The KV-transfer peer the harness launches, against a real tiny engine on CPU: it derives groups, spans
and byte layouts from the geometry alone, reads the engine's pattern, writes its own that the engine echoes,
and names what differs when the allocations are laid out for another geometry."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qualify.engine import kv_export
from qualify.engine.peer import pattern_bytes as peer_pattern
from qualify.engine.peer import run as run_peer
from qualify.protocol import KV_PROBE_BYTES, pattern_bytes
from qualify.run.geometry import GEOMETRY

from .conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]
HALF = KV_PROBE_BYTES // 2


def _sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _spec(engine, geometry: dict | None = None) -> dict:
    """What the layout check hands the peer: the geometry it asked for, the exported handles, and nonces
    (the engine has already filled each probe page's first half with the read nonce's pattern)."""
    handles = kv_export.kv_handles(engine)
    for h in handles["groups"]:
        kv_export.kv_fill(engine, h["name"], h["probe"]["offset"], HALF, f"read-nonce:{h['name']}")
    return {
        "geometry": geometry or GEOMETRY["tiny"].for_peer(0, "cpu"),
        "handles": handles,
        "read_nonce": "read-nonce",
        "write_nonce": "write-nonce",
    }


def test_the_harness_geometry_is_the_engine_preset_it_asks_for():
    from qualify.engine.config import PRESETS, EngineConfig

    for preset, geo in GEOMETRY.items():
        cfg = EngineConfig(preset=preset, device="cpu")
        shape = PRESETS[preset]
        assert (geo.layer_pattern, geo.group_size, geo.max_num_seqs, geo.max_model_len) == (
            cfg.layer_pattern, cfg.group_size, cfg.max_num_seqs, cfg.max_model_len,
        )  # fmt: skip
        assert (geo.kda_heads, geo.kda_head_dim, geo.conv_width, geo.attn_kv_heads, geo.attn_head_dim) == (
            shape.kda_heads, shape.kda_head_dim, shape.conv_width, shape.attn_kv_heads, shape.attn_head_dim,
        )  # fmt: skip
    assert peer_pattern("n", 100) == pattern_bytes("n", 100)


def test_handles_carry_no_span_for_the_peer_to_trust(tiny_engine):
    for g in kv_export.kv_handles(tiny_engine)["groups"]:
        assert "span" not in g and "spans" not in json.dumps(g)


def peer_process(engine, geometry: dict | None = None) -> dict:
    """The peer's report from `python -m qualify.engine.peer` run as a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "report.json"
        spec.write_text(json.dumps(_spec(engine, geometry)))
        subprocess.run(
            [sys.executable, "-m", "qualify.engine.peer", "--spec", str(spec), "--out", str(out)],
            check=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        return json.loads(out.read_text())


def test_the_peer_process_verifies_every_allocation_and_the_engine_echoes_what_it_wrote(tiny_engine):
    report = peer_process(tiny_engine)
    assert report["error"] is None and report["unexpected"] == []
    assert report["spans"] == [2304, 2304, 2304, 9216]
    assert [g["name"] for g in report["groups"]] == ["kda0", "kda1", "kda2", "attention0"]
    for g in report["groups"]:
        assert g["size_ok"] and g["views_differ"] is None and g["probe_match"] and g["layers_match"]
        assert g["alignment_ok"] and g["device_ok"] and g["out_of_bounds_refused"]
        assert g["engine_pattern_ok"]
        w, s = g["written"], g["sample"]
        assert w["sha256"] == _sha(pattern_bytes(f"write-nonce:{g['name']}", HALF))
        assert kv_export.kv_echo(tiny_engine, g["name"], w["offset"], w["length"])["sha256"] == w["sha256"]
        assert kv_export.kv_echo(tiny_engine, g["name"], s["offset"], s["length"])["sha256"] == s["sha256"]


def test_the_peer_does_not_see_a_pattern_the_engine_did_not_write(tiny_engine):
    spec = _spec(tiny_engine)
    spec["read_nonce"] = "another-nonce"
    assert not any(g["engine_pattern_ok"] for g in run_peer(spec)["groups"])


def test_allocations_laid_out_for_another_dcp_size_are_named(tmp_path):
    e = make_engine(dcp_size=2, max_model_len=64)  # the engine's own layout; the peer asked for dcp 4
    try:
        geo = {**GEOMETRY["tiny"].for_peer(0, "cpu"), "max_model_len": 64}
        report = run_peer(_spec(e, geo))
    finally:
        e.close()
    assert report["spans"] == [2304, 2304, 2304, 9216]  # from the geometry, not from the engine
    att = report["groups"][-1]
    assert att["name"] == "attention0" and not att["size_ok"]
    assert att["nbytes_measured"] < att["nbytes_expected"]
    assert "shape" in att["views_differ"] and "[9, 2, 2304" in att["views_differ"]
    assert all(g["size_ok"] for g in report["groups"][:-1])


def test_a_handle_pointing_past_a_short_file_is_measured_not_trusted(tiny_engine, tmp_path):
    spec = _spec(tiny_engine)
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 1024)
    g0 = spec["handles"]["groups"][0]
    g0["handle"] = {**g0["handle"], "path": str(short)}
    res = run_peer(spec)["groups"][0]
    assert res["nbytes_measured"] == 1024 and not res["size_ok"]
    assert "probe page" in res["error"]


def test_echo_and_fill_refuse_ranges_outside_their_bounds(tiny_engine):
    a = tiny_engine.allocations[0]
    with pytest.raises(ValueError, match="falls outside"):
        kv_export.kv_echo(tiny_engine, a.group.name, a.nbytes - 16, 64)
    with pytest.raises(ValueError, match="probe page"):
        kv_export.kv_fill(tiny_engine, a.group.name, 0, 64, "nonce-xyz")
    with pytest.raises(ValueError, match="no KV group"):
        kv_export.kv_echo(tiny_engine, "nope", 0, 1)
