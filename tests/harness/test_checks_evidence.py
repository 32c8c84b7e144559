"""Checks pass only on evidence: an engine that serves the protocol but lies (claims graphs it did not
capture, answers with nothing, runs eagerly when asked to replay, came up on the wrong device) fails them.

The engine here is the protocol itself answered from a dict (httpx.MockTransport): each test breaks one
thing an honest engine would do and shows which condition catches it.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from qualify import settings
from qualify.checks import backend, boot, capture, faults, generation, reload
from qualify.checks.base import PROMPTS, Context
from qualify.client import EngineClient
from qualify.launch.base import Launcher, LaunchStatus, RefusalOutcome
from qualify.run.geometry import GEOMETRY
from qualify.run.receipt import engine_code_digest_on_disk, file_digest
from qualify.run.request import RunRequest
from qualify.watch.xid import classify
from receipts.statement import config_digest

W0 = "sha256:" + "0" * 64
W1 = "sha256:" + "1" * 64


class Engine:
    """Protocol answers from state; `lie` names the one thing it gets wrong."""

    def __init__(self, device: str = "cuda", lie: str | None = None) -> None:
        self.device, self.lie = device, lie
        self.captures = self.replays = 0
        self.weights = W0
        self.captured = False
        self.now = 0.0  # the harness's clock in these tests: each answer advances it by its steps' time
        preset = "tiny" if lie == "config" else "proxy"
        g = GEOMETRY["proxy"]  # the KV geometry the harness sends as flags, echoed in the described config
        self.config: dict[str, Any] = {
            "preset": preset, "seed": 0, "kda_decode_backend": "auto", "capture_sizes": [1, 2, 4, 8],
            "layer_pattern": g.layer_pattern, "block_size": g.block_size, "dcp_size": g.dcp_size,
            "dcp_ranks": g.dcp_ranks, "max_num_seqs": g.max_num_seqs, "max_model_len": g.max_model_len,
        }  # fmt: skip

    def describe(self) -> dict[str, Any]:
        code = "sha256:" + "c" * 64 if self.lie == "code" else engine_code_digest_on_disk()
        return {
            "protocol_version": "1" if self.lie == "protocol" else "2",
            "engine": {
                "name": "e",
                "version": "1",
                "code_digest": code,
                "weights_digest": self.weights,
                "weights_path": "/etc/hostname" if self.lie == "weights-outside" else str(weights_file()),
            },  # fmt: skip
            "config": self.config,
            "config_digest": config_digest(self.config),
            "backend": {"requested": "auto", "resolved": "triton", "reason": "r", "prefill_path": "p"},
            "layout": {"spans": [2304], "chunk": 2304, "ratios": [1], "groups": []},
            "arenas": {"a": {"address": 4096, "capacity": 8, "shape": [8], "dtype": "int32"}},
            "capacity": {
                "live_slots": 8,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 4096,
                "graph_max_batch": 8,
                "num_spec": 0,
            },  # fmt: skip
            "device": {"type": "cpu" if self.lie == "device" else self.device, "name": "d"},
            "versions": {"python": "3", "torch": "2", "qualify": "0"},
            "counters": {"graph_captures": self.captures, "graph_replays": self.replays},
            "cudagraph_mode": "full",
        }

    def tokens(self, prompt: Any, eager: bool) -> list[int]:
        """A function of the prompt itself (not of its place in the batch), like a real model's output."""
        prompt = zlib.crc32(json.dumps(prompt).encode()) % 97
        seed = 0 if self.weights == W0 else 1
        # Graphs that kept reading some of the old weights: their output changes, but not to the new model's.
        if not eager and self.lie == "stale-graphs" and self.weights == W1:
            seed = 2
        return [(prompt + seed + i) % 7 for i in range(4)]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        eager = body.get("mode", "auto") == "eager" or not self.captured or self.lie == "eager-only"
        if not eager:
            self.replays += 1
        # Time spent: a round trip, then one step per token; a replayed graph step is 5x faster, unless the
        # "graph" steps are eager ones (a claim the timing must refuse).
        step = 1e-3 if eager or self.lie == "eager-speed-graphs" else 2e-4
        self.now += 5e-3 + step * int(body.get("max_tokens", 1))
        toks = [] if self.lie == "empty" else [self.tokens(p, eager) for p in prompts]
        choices = [
            {"index": i, "token_ids": t, "text": "", "top2_gaps": [1.0] * len(t), "finish_reason": "length"}
            for i, t in enumerate(toks)
        ]
        return {"choices": choices, "mode_used": "eager" if eager else "graph",
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip

    def capture(self) -> dict[str, Any]:
        if self.lie != "no-graphs":
            self.captures += 4
        self.captured = True
        sizes = sorted(self.config["capture_sizes"], reverse=True)
        return {"captured": True, "sizes": sizes, "pool_bytes": 1, "seconds": 0.1, "address_digest": W1}

    def reload(self, body: dict[str, Any]) -> dict[str, Any]:
        before = self.weights
        if body.get("seed") is not None:
            self.weights = W1
        elif body.get("path") == "w0":
            self.weights = W0
        census = {
            "params": 1,
            "addresses_unchanged": True,
            "changed": [] if before == self.weights else ["p"],
            "before_digest": before,
            "after_digest": self.weights,
            "arena_addresses_unchanged": True,
        }
        return {"census": census, "seconds": 0.1, "weights_path": "w0"}

    def probe(self) -> dict[str, Any]:
        names = ["kda::triton", "aten::mm"]
        if self.lie == "substring-label":
            names = ["kda::tritonic_fallback", "aten::mm"]
        elif self.lie != "no-device-kernel" and self.device == "cuda":
            names.append("_kda_decode_kernel")
        return {"kernel_names": names, "backend": "triton", "device_type": self.device}

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        routes = {
            "/health": lambda: {"status": "ok", "ready": True, "pid": 1},
            "/v1/describe": self.describe,
            "/v1/completions": lambda: self.complete(body),
            "/qualify/capture": self.capture,
            "/qualify/reload": lambda: self.reload(body),
            "/qualify/probe": self.probe,
            "/metrics": lambda: None,
        }
        if request.url.path not in routes:  # an endpoint this stand-in does not serve, as a server says it
            err = {"error": {"type": "HTTPError", "message": "Not Found"}}
            return httpx.Response(404, json=err)
        out = routes[request.url.path]()
        if out is None:
            return httpx.Response(200, text="qualify_engine_cuda_oom_total 0\n")
        return httpx.Response(200, json=out)


def weights_file() -> Path:
    """A weights file in the data dir the harness and a local engine share (QUALIFY_HOME of the tests)."""
    path = settings.data_dir() / "weights" / "evidence-test.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights the harness hashes itself")
    return path


class StandingLauncher(Launcher):
    """An engine that is already up: the checks' view of a launcher, nothing more."""

    kind = "local"
    pid: int | None = None

    def start(self, timeout_s: float) -> str:
        return "http://engine"

    def url(self, refresh: bool = False) -> str:
        return "http://engine"

    def status(self) -> LaunchStatus:
        return LaunchStatus(alive=True, exit_code=None, restart_count=0, detail={"pid": self.pid})

    def stop(self, grace_s: float = 5.0) -> LaunchStatus:
        return self.status()

    def logs_tail(self, lines: int = 30) -> str:
        return ""

    def identity(self) -> dict[str, Any]:
        return {"launcher": "local"}

    def sibling(self, options: Any, name: str) -> StandingLauncher:
        return StandingLauncher()

    def run_refusal(self, kda_backend: str, timeout_s: float) -> RefusalOutcome:
        line = f"error: unknown kda_decode_backend {kda_backend!r}; choose one of auto, b12x, triton, torch"
        return RefusalOutcome(["engine"], 2, 0.1, line + "\n")


def _context(engine: Engine, target: str = "gpu", watch: str = "active") -> Context:
    req = RunRequest(layout=None, kda_backend="auto", spec="none", num_spec=0, preset="proxy",
                     launcher="local", image=None, gpus=None, timeout_s=60, mem_limit=None,
                     db_url="sqlite://", key_path="", json_output=True)  # fmt: skip
    client = EngineClient("http://engine")
    client._http = httpx.Client(transport=httpx.MockTransport(engine.handle))
    ctx = Context(request=req, launcher=StandingLauncher(), client=client, target=target)

    def fresh_reference(url: str, timeout_s: float, netns: object = None) -> EngineClient:
        other = EngineClient(url)  # a freshly booted engine of the same build: the subject weights, no lie
        other._http = httpx.Client(transport=httpx.MockTransport(Engine(engine.device).handle))
        return other

    ctx.client_for = fresh_reference
    ctx.clock = lambda: engine.now
    ctx.xid_watch = lambda: {"state": watch, "reason": "test"}
    ctx.xid_events = lambda: [classify(13, source="nvml")]
    return ctx


def _failed(outcome: Any) -> set[str]:
    return {k for k, c in outcome.conditions.items() if not c.holds}


def _through_capture(engine: Engine) -> Context:
    ctx = _context(engine)
    ctx.describe = ctx.client.describe()
    assert capture.run(ctx).status in ("pass", "fail")
    return ctx


def test_an_honest_gpu_engine_passes_every_check_here() -> None:
    engine = Engine()
    ctx = _context(engine)
    assert boot.run(ctx).status == "pass"
    assert backend.run(ctx).status == "pass"
    assert capture.run(ctx).status == "pass"
    assert reload.run(ctx).status == "pass"
    assert generation.run(ctx).status == "pass"
    assert faults.run(ctx).status == "pass"


def test_capture_claimed_without_graphs_fails_even_though_sizes_echo_the_config() -> None:
    ctx = _context(Engine(lie="no-graphs"))
    out = capture.run(ctx)
    assert out.status == "fail" and _failed(out) == {"a_graph_per_size_captured"}


def test_graph_mode_served_eagerly_fails_capture_reload_and_generation() -> None:
    engine = Engine(lie="eager-only")
    ctx = _through_capture(engine)
    assert "graph_mode_used" in _failed(capture.run(_context(engine)))
    out = reload.run(ctx)
    assert "every_comparison_replayed_graphs" in _failed(out)
    assert "replay_ran_graphs" in _failed(generation.run(ctx))


def test_stale_graphs_after_a_reload_fail_the_reload_check() -> None:
    ctx = _through_capture(Engine(lie="stale-graphs"))
    out = reload.run(ctx)
    assert out.status == "fail" and _failed(out) == {"other_weights_replay_equals_eager"}


def test_empty_answers_never_agree_with_each_other() -> None:
    ctx = _context(Engine(lie="empty"), target="cpu")
    out = generation.run(ctx)
    assert out.status == "fail" and {"tokens_generated", "deterministic"} <= _failed(out)
    assert out.evidence["prompts"] == 0 != len(PROMPTS)


def test_an_engine_on_the_cpu_of_a_gpu_host_fails_boot() -> None:
    out = boot.run(_context(Engine(lie="device")))
    assert _failed(out) == {"device_matches_target"}


def test_boot_hashes_the_weights_file_itself_and_records_the_config_it_sent() -> None:
    ctx = _context(Engine())
    up: list[bool] = []
    ctx.engine_up = lambda: up.append(ctx.url is not None)  # later checks' early work, once it answers
    out = boot.run(ctx)
    assert out.status == "pass" and up == [True]
    w = out.evidence["weights_file"]
    assert w["hashed"] and w["digest"] == file_digest(weights_file()) != W0  # not the engine's digest
    assert out.conditions["weights_file_hashed"].source == "observed"
    sent = out.evidence["config"]["sent"]
    assert {k: sent[k] for k in ("preset", "kda_decode_backend", "num_spec")} == {
        "preset": "proxy", "kda_decode_backend": "auto", "num_spec": 0
    }  # fmt: skip
    # The KV geometry is sent as explicit flags, so it is part of the config the receipt names.
    assert sent["dcp_size"] == 4 and sent["block_size"] == 2304 and sent["layer_pattern"] == "KKKAKKKA"


def test_weights_outside_the_data_dir_are_not_hashed_and_fail_boot() -> None:
    out = boot.run(_context(Engine(lie="weights-outside")))
    assert _failed(out) == {"weights_file_hashed"} and not out.evidence["weights_file"]["hashed"]


def test_an_engine_that_describes_another_config_than_sent_fails_boot() -> None:
    out = boot.run(_context(Engine(lie="config")))
    assert _failed(out) == {"described_config_agrees_with_sent"}
    assert "preset" in (out.conditions["described_config_agrees_with_sent"].detail or "")


def test_on_a_gpu_the_harness_sees_the_engine_pid_on_the_gpu_itself() -> None:
    ctx = _context(Engine())
    ctx.launcher.pid = 4242
    ctx.gpu_pids = lambda: {4242: [0]}
    cond = boot.run(ctx).conditions["device_matches_target"]
    assert cond.holds and cond.source == "observed" and "GPU [0]" in (cond.detail or "")
    # An engine that says "cuda" but whose process NVML does not list on any GPU fails, whatever it says.
    ctx = _context(Engine())
    ctx.launcher.pid = 4242
    ctx.gpu_pids = lambda: {os.getpid(): [0]}  # another process of this namespace is on the GPU
    out = boot.run(ctx)
    assert _failed(out) == {"device_matches_target"}
    assert out.conditions["device_matches_target"].source == "observed"
    # NVML pids from another pid namespace (some containers) say nothing here: the engine's word remains.
    ctx = _context(Engine())
    ctx.launcher.pid = 4242
    ctx.gpu_pids = lambda: {2**22 + 7: [0]}
    assert boot.run(ctx).conditions["device_matches_target"].source == "engine"


def test_a_docker_engine_is_not_hashed_by_the_harness_and_says_so() -> None:
    ctx = _context(Engine())
    ctx.launcher.kind = "docker"
    out = boot.run(ctx)
    assert out.status == "pass" and "weights_file_hashed" not in out.conditions
    assert out.evidence["weights_file"] == {
        "hashed": False, "why": "docker launcher: the weights are inside the container"
    }  # fmt: skip


def test_an_engine_that_answers_in_another_protocol_version_fails_boot_saying_so() -> None:
    out = boot.run(_context(Engine(lie="protocol")))
    assert _failed(out) == {"protocol_version_spoken"}
    detail = out.conditions["protocol_version_spoken"].detail or ""
    assert "'1'" in detail and "['2']" in detail


def test_a_code_digest_that_is_not_the_code_on_disk_fails_boot() -> None:
    out = boot.run(_context(Engine(lie="code")))
    assert _failed(out) == {"code_digest_matches_disk"}


@pytest.mark.parametrize(
    ("lie", "condition"),
    [
        ("substring-label", "kernels_of_resolved_backend_ran"),
        ("no-device-kernel", "device_kernels_of_resolved_backend_ran"),
    ],
)
def test_backend_proof_needs_its_exact_label_and_on_cuda_its_device_kernel(lie: str, condition: str) -> None:
    out = backend.run(_context(Engine(lie=lie)))
    assert out.status == "fail" and condition in _failed(out)


def test_kernels_of_another_backend_are_foreign_on_cuda() -> None:
    proof = backend.kernels_belong(["kda::torch", "_kda_decode_kernel"], "torch", "cuda")
    assert proof["labels"] == ["kda::torch"] and proof["foreign"] == ["_kda_decode_kernel"]
    assert backend.kernels_belong(["kda::torch"], "torch", "cpu")["foreign"] == []


def test_no_fatal_xid_is_not_a_pass_on_a_gpu_target_that_watched_nothing() -> None:
    assert _failed(faults.run(_context(Engine(), watch="unavailable"))) == {"xid_watched"}
    assert faults.run(_context(Engine(device="cpu"), target="cpu", watch="not_applicable")).status == "pass"


def test_engine_code_digest_on_disk_is_the_engines_own_definition(tmp_path: Path) -> None:
    import subprocess
    import sys

    from .conftest import ROOT

    # The engine computes it in its own process (torch and all); the harness must reach the same value.
    out = subprocess.run(
        [sys.executable, "-c", "from qualify.engine.engine import code_digest; print(code_digest())"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == engine_code_digest_on_disk()


def test_the_harness_sees_which_process_holds_the_engine_port() -> None:
    import socket
    import subprocess
    import sys

    listener = "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); " \
        "print(s.getsockname()[1], flush=True); time.sleep(30)"  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", listener], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert boot.holds_listener(child.pid, port) is True
        # Another process (this one) does not hold it; nor does the child hold a port nobody listens on.
        assert boot.holds_listener(os.getpid(), port) is False
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            unused = free.getsockname()[1]
        assert boot.holds_listener(child.pid, unused) is False
    finally:
        child.kill()
        child.wait()


def test_container_oom_is_a_condition_only_where_docker_could_kill_for_memory() -> None:
    assert "no_container_oom" not in faults.run(_context(Engine())).conditions


def test_a_cpu_target_never_carries_a_capture_pass_whatever_the_engine_says() -> None:
    # The mock engine claims a capture and answers "graph": on a cpu target that is a false claim.
    out = capture.run(_context(Engine(device="cpu"), target="cpu"))
    assert out.status == "fail" and _failed(out) == {"no_graphs_claimed_on_a_cpu_target"}


def test_only_torch_or_an_interpreted_triton_asked_for_by_name_runs_on_a_cpu() -> None:
    assert backend.runs_on_cpu("torch", "auto", {})[0]
    assert not backend.runs_on_cpu("triton", "auto", {"TRITON_INTERPRET": "1"})[0]
    assert not backend.runs_on_cpu("triton", "triton", {})[0]
    assert backend.runs_on_cpu("triton", "triton", {"TRITON_INTERPRET": "1"})[0]
    assert not backend.runs_on_cpu("b12x", "b12x", {"TRITON_INTERPRET": "1"})[0]


def test_graph_steps_at_eager_speed_fail_the_harness_timing_on_a_gpu() -> None:
    honest = capture.run(_context(Engine()))
    timing = honest.evidence["step_timing"]
    assert honest.status == "pass" and sorted(timing) == ["1", "4"]  # smallest and largest size that fits
    assert timing["1"]["eager_step_s"] == pytest.approx(1e-3) and timing["1"][
        "graph_step_s"
    ] == pytest.approx(2e-4)
    out = capture.run(_context(Engine(lie="eager-speed-graphs")))
    assert out.status == "fail" and _failed(out) == {"graph_steps_faster_than_eager"}
    assert out.conditions["graph_steps_faster_than_eager"].source == "observed"


@pytest.mark.parametrize("claims", ["reference", "own", "wrapped"])
def test_another_module_is_named_as_itself_never_as_the_reference_engine(claims: str) -> None:
    """QUALIFY_ENGINE_MODULE=X: the engine's claim must be X's own tree (a foreign engine) or the reference
    combined with X (a wrapper); the reference's digest alone is another engine's identity."""
    import hashlib

    from qualify.run.receipt import module_source_digest

    module = "tests.second_engine"
    own, _ = module_source_digest(module)
    base = engine_code_digest_on_disk()
    wrapped = "sha256:" + hashlib.sha256(f"{base}\0{module}\0{own}".encode()).hexdigest()
    engine = Engine()
    claim = {"reference": base, "own": own, "wrapped": wrapped}[claims]
    honest = engine.describe
    engine.describe = lambda: {**honest(), "engine": {**honest()["engine"], "code_digest": claim}}  # type: ignore[method-assign]
    ctx = _context(engine)
    ctx.launcher.module = module  # type: ignore[attr-defined]
    out = boot.run(ctx)
    cond = out.conditions["code_digest_matches_disk"]
    assert cond.holds == (claims != "reference"), cond.detail
    if claims == "reference":
        assert own in (cond.detail or "") and wrapped in (cond.detail or "")
    else:
        assert ctx.facts["code_identity"][0] == claim
