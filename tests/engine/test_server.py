"""The HTTP API: every endpoint answers in the protocol's shapes; malformed input gets 4xx and a message;
`python -m qualify.engine serve` announces readiness, refuses bad config before binding, honours faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from qualify.protocol import (
    CAPACITY_ERROR,
    CaptureResponse,
    CompletionResponse,
    Describe,
    Health,
    KvDigest,
    KvHandles,
    ProbeResponse,
    ReloadResponse,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client(tiny_engine):
    from qualify.engine.server import create_app

    with TestClient(create_app(tiny_engine)) as c:
        yield c


def test_health_and_describe_answer_in_protocol_shapes(client):
    h = Health.model_validate(client.get("/health").json())
    assert h.ready and h.pid == os.getpid()
    d = Describe.model_validate(client.get("/v1/describe").json())
    assert (
        d.layout.spans == [2304, 2304, 2304, 9216]
        and d.layout.chunk == 9216
        and d.layout.ratios == [4, 4, 4, 1]
    )
    assert {g.handle_kind for g in d.layout.groups} == {"shm"}
    assert d.backend.requested == "auto" and d.backend.resolved == "torch" and d.backend.reason
    assert d.dcp_mode == "folded" and d.cudagraph_mode == "none"
    assert d.engine.code_digest.startswith("sha256:") and d.config_digest.startswith("sha256:")
    assert d.engine.weights_path and Path(d.engine.weights_path).is_file()  # the file the harness hashes
    assert d.arenas["state_slots"].capacity == 8 and d.arenas["state_slots"].address > 0
    assert d.capacity.live_slots == 8 and d.device.type == "cpu"


def test_completions_accept_text_and_token_batches(client):
    r = client.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = CompletionResponse.model_validate(r.json())
    assert len(body.choices) == 2 and body.mode_used == "eager"
    assert all(len(c.token_ids) == len(c.top2_gaps) for c in body.choices)
    again = client.post("/v1/completions", json={"prompt": [256, *b"hello"], "max_tokens": 3}).json()
    assert again["choices"][0]["token_ids"] == body.choices[0].token_ids


def test_each_completion_logs_where_its_seconds_went(client, capfd):
    from qualify.engine import REQUEST_LINE

    capfd.readouterr()
    r = client.post("/v1/completions", json={"prompt": ["one", "two", "three"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith(REQUEST_LINE)]
    assert len(lines) == 1
    rec = json.loads(lines[0][len(REQUEST_LINE) :])
    assert rec["n"] == 3 and rec["prompts"] == 3 and rec["mode"] == "eager" and rec["spec"] is False
    assert 0 < rec["prefill_s"] <= rec["verb_s"] <= rec["handler_s"]


@pytest.mark.parametrize(
    "body,status",
    [
        ({"prompt": "x"}, 422),
        ({"prompt": "x", "max_tokens": -1}, 422),
        ({"prompt": {"a": 1}, "max_tokens": 1}, 422),
        ({"prompt": "x", "max_tokens": 1, "n": 2}, 422),
        ({"prompt": [999_999], "max_tokens": 1}, 400),
        ({"prompt": "x", "max_tokens": 1, "mode": "graph"}, 409),
        ({"prompt": "x", "max_tokens": 1, "speculative": True}, 409),
    ],
)
def test_malformed_completions_are_refused_with_a_clear_message(client, body, status):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] and err["message"]


def test_non_json_body_is_refused(client):
    r = client.post("/v1/completions", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "ValidationError"


def test_batch_beyond_live_capacity_is_refused_with_409_and_nothing_moves(client):
    before = client.get("/v1/describe").json()["arenas"]
    refusals = client.get("/v1/describe").json()["counters"]["capacity_refusals"]
    r = client.post("/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 1})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["type"] == CAPACITY_ERROR and "holds 8" in err["message"] and "needs 9" in err["message"]
    assert client.get("/v1/describe").json()["arenas"] == before
    assert f"qualify_engine_capacity_refusals_total {refusals + 1}" in client.get("/metrics").text


def test_unknown_paths_answer_json_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "HTTPError"


def test_qualify_endpoints_answer(client, tiny_engine):
    cap = CaptureResponse.model_validate(client.post("/qualify/capture").json())
    assert not cap.captured and cap.reason == "CUDA graphs need a CUDA device"
    probe = ProbeResponse.model_validate(client.post("/qualify/probe").json())
    assert "kda::torch" in probe.kernel_names and probe.backend == "torch"
    handles = KvHandles.model_validate(client.get("/qualify/kv-handles").json())
    g = handles.groups[0]
    fill = {"group": g.name, "offset": g.probe.offset, "length": 64, "nonce": "nonce-123"}
    filled = KvDigest.model_validate(client.post("/qualify/kv-fill", json=fill).json())
    echo = {"group": g.name, "offset": g.probe.offset, "length": 64}
    assert KvDigest.model_validate(client.post("/qualify/kv-echo", json=echo).json()).sha256 == filled.sha256
    past = client.post("/qualify/kv-echo", json={**echo, "offset": g.nbytes - 8})
    assert past.status_code == 400 and "falls outside" in past.json()["error"]["message"]
    assert client.post("/qualify/peer-verify").status_code == 404  # the engine no longer vouches for itself
    rel = ReloadResponse.model_validate(client.post("/qualify/reload", json={}).json())
    assert rel.census.addresses_unchanged and rel.census.changed == []
    bad = client.post("/qualify/reload", json={"path": "/nonexistent.safetensors"})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    assert client.post("/qualify/reload", json={"seed": "x"}).status_code == 422


def test_metrics_expose_counters_in_prometheus_text(client):
    text = client.get("/metrics").text
    for name in (
        "requests",
        "tokens_generated",
        "cuda_oom",
        "capacity_refusals",
        "graph_replays",
        "eager_steps",
    ):
        assert f"# TYPE qualify_engine_{name}_total counter" in text
    assert "qualify_engine_cuda_oom_total 0" in text


def test_engine_work_runs_on_one_worker_thread_that_owns_the_device(client, tiny_engine, monkeypatch):
    seen = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            seen.append((threading.get_ident(), threading.current_thread().name))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(tiny_engine, "describe", spy(tiny_engine.describe))
    monkeypatch.setattr(tiny_engine, "generate", spy(tiny_engine.generate))
    for _ in range(3):
        assert client.get("/v1/describe").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0][0] != threading.get_ident()
    assert seen[0][1].startswith("qualify-engine")  # the engine's own worker, not a shared thread pool
    assert client.app.state.engine_worker._max_workers == 1


def test_a_corrupt_weights_file_is_refused_with_400_and_nothing_changes(client, tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"this is not a safetensors file" * 8)
    before = client.get("/v1/describe").json()["engine"]["weights_digest"]
    r = client.post("/qualify/reload", json={"path": str(bad)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "WeightsError" and "not a readable safetensors" in r.text
    assert client.get("/v1/describe").json()["engine"]["weights_digest"] == before


def test_cuda_out_of_memory_answers_507_and_is_counted(client, tiny_engine, monkeypatch):
    def oom(*_a, **_k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    before = tiny_engine.counters.cuda_oom
    monkeypatch.setattr(tiny_engine, "generate", oom)
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 507 and r.json()["error"]["type"] == "CudaOutOfMemory"
    assert r.json()["error"]["message"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert tiny_engine.counters.cuda_oom == before + 1
    assert f"qualify_engine_cuda_oom_total {before + 1}" in client.get("/metrics").text


def test_an_unexpected_engine_error_still_answers_the_protocols_error_shape(tiny_engine, monkeypatch):
    from qualify.engine.server import create_app

    def boom(*_a, **_k):
        raise KeyError("slot table corrupted")

    monkeypatch.setattr(tiny_engine, "probe", boom)
    with TestClient(create_app(tiny_engine), raise_server_exceptions=False) as c:
        r = c.post("/qualify/probe")
    assert r.status_code == 500
    assert r.json()["error"] == {"type": "KeyError", "message": "'slot table corrupted'"}


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": "x", "max_tokens": 10_000}, "max_model_len"),
        ({"prompt": [[256, 1]] * 3 + [[256, 300]], "max_tokens": 1}, "got 300"),
    ],
)
def test_requests_the_engine_cannot_serve_are_refused_before_any_work(client, tiny_engine, body, needle):
    before = tiny_engine.counters.tokens_generated
    r = client.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500 and needle in r.json()["error"]["message"]
    assert tiny_engine.counters.tokens_generated == before
    assert len(tiny_engine.runner.pool.groups) == tiny_engine.cfg.max_num_seqs


# ---------------------------------------------------------------- the real process


def _serve(tmp_path, *args, env_extra=None):
    env = dict(os.environ, QUALIFY_HOME=os.environ["QUALIFY_HOME"], PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "qualify.engine", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def _wait_ready(proc) -> str:
    line = proc.stdout.readline()
    assert line.startswith("QUALIFY_ENGINE_READY "), (
        line,
        proc.stderr.read() if proc.poll() is not None else "",
    )
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert int(fields["pid"]) == proc.pid
    return fields["url"]


def test_serve_announces_readiness_and_answers(tmp_path):
    ready = tmp_path / "ready.json"
    proc = _serve(tmp_path, "--device", "cpu", "--ready-file", str(ready))
    try:
        url = _wait_ready(proc)
        assert json.loads(ready.read_text())["url"] == url
        assert httpx.get(url + "/health", timeout=10).json()["ready"] is True
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _shm_files(pid: int) -> set[str]:
    from qualify.engine.layout import SHM_PREFIX, _shm_dir

    return {n for n in os.listdir(_shm_dir()) if n.startswith(f"{SHM_PREFIX}{pid}-")}


@pytest.mark.serial
def test_a_stopped_engine_leaves_no_shm_and_a_killed_ones_is_swept_by_the_next(tmp_path):
    from qualify.engine.layout import sweep_stale_shm

    proc = _serve(tmp_path, "--device", "cpu")
    try:
        _wait_ready(proc)
        assert len(_shm_files(proc.pid)) == 4
    finally:
        proc.terminate()  # SIGTERM: what launchers send first
        assert proc.wait(timeout=30) == -signal.SIGTERM  # still dies of the signal, after cleaning up
    assert _shm_files(proc.pid) == set()

    proc = _serve(tmp_path, "--device", "cpu")
    try:
        _wait_ready(proc)
        held = _shm_files(proc.pid)
        assert len(held) == 4 and not set(sweep_stale_shm()) & held  # a live engine's files stay
    finally:
        proc.kill()  # SIGKILL: no cleanup can run in the engine itself
        proc.wait(timeout=30)
    assert _shm_files(proc.pid) == held
    assert held <= set(sweep_stale_shm())  # what every new engine does before allocating
    assert _shm_files(proc.pid) == set()


def test_serve_refuses_missing_weights_before_binding(tmp_path):
    proc = _serve(tmp_path, "--device", "cpu", "--weights", str(tmp_path / "none.safetensors"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "QUALIFY_ENGINE_READY" not in out
    assert err.strip().count("\n") == 0 and "does not exist" in err
    assert _shm_files(proc.pid) == set()


def test_serve_refuses_an_unknown_backend_before_binding(tmp_path):
    proc = _serve(tmp_path, "--device", "cpu", "--kda-backend", "bogus")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "QUALIFY_ENGINE_READY" not in out
    assert err.strip().count("\n") == 0 and "unknown kda_decode_backend 'bogus'" in err


def test_crash_fault_kills_the_engine_on_its_endpoint(tmp_path):
    proc = _serve(tmp_path, "--device", "cpu", env_extra={"QUALIFY_ENGINE_FAULT": "crash-on:/v1/describe"})
    try:
        url = _wait_ready(proc)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/v1/describe", timeout=10)
        assert proc.wait(timeout=10) == 3
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fault_specs_are_validated():
    from qualify.engine.faults import parse_faults

    plan = parse_faults(["crash-on:/health,hang-on:v1/completions", "crash-after-boot:2.5"])
    assert (
        plan.crash_on == {"/health"} and plan.hang_on == {"/v1/completions"} and plan.crash_after_boot == 2.5
    )
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults(["explode:/health"])
