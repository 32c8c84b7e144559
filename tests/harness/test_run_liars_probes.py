"""Lying engines that react to what they can see (issue 21, the probe half), through the real `qualify run`
path (local launcher, tiny preset, CPU): graphs claimed on a CPU, a triton backend claimed on a CPU, a
supervisor that hides a restarted worker, answers that react to the harness's probes, speculation simulated
against the engine's own output. Each is rejected by the condition that catches its lie."""

from __future__ import annotations

import os

import pytest

from .conftest import ROOT, Home, check

pytestmark = pytest.mark.slow


def _run(home: Home, liar: str | None, *args: str, wait: float = 300, **env: str) -> tuple[dict, dict]:
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if liar:
        extra["QUALIFY_ENGINE_MODULE"] = f"tests.liars.{liar}"
    ran = home.qualify("run", "--json", *args, env=home.env(**extra, **env), timeout=wait)
    assert ran.code in (0, 1), ran.stderr[-2000:]
    (p,) = home.predicates()
    return ran.summary(), p


def _failed(p: dict, name: str) -> dict[str, str]:
    return {k: c["detail"] for k, c in check(p, name)["conditions"].items() if not c["holds"]}


def test_graphs_claimed_on_a_cpu_target_fail_the_capture_check(home: Home) -> None:
    s, p = _run(home, "claimed_graphs")
    assert s["verdict"] == "rejected"
    cap = check(p, "capture")
    assert cap["status"] == "fail"
    assert set(_failed(p, "capture")) == {"no_graphs_claimed_on_a_cpu_target"}
    assert cap["conditions"]["no_graphs_claimed_on_a_cpu_target"]["source"] == "engine"
    assert "capture: fail" in s["reasons"]
    # Its "graph" answers to ordinary requests are false on a cpu target too.
    assert "eager_on_a_cpu_target" in _failed(p, "generation")


def test_a_triton_backend_claimed_on_a_cpu_target_is_rejected(home: Home) -> None:
    s, p = _run(home, "cpu_triton", "--fail-fast")
    assert s["verdict"] == "rejected"
    assert check(p, "backend")["evidence"]["resolved"] == "triton"
    failed = _failed(p, "backend")
    assert set(failed) == {"resolved_backend_runs_on_a_cpu"}
    assert "cannot run on a cpu target" in failed["resolved_backend_runs_on_a_cpu"]


def test_a_worker_reforked_by_a_supervisor_is_a_restart(home: Home) -> None:
    s, p = _run(home, "supervised")
    assert s["verdict"] == "rejected"
    # The restart is invisible to the launcher; only the process tree shows it. (Under load the re-forked
    # worker can still be warming up while the reload check's fresh-engine comparison runs: that check
    # may fail too, but never in place of faults.)
    failing = {c["name"] for c in s["checks"] if c["status"] not in ("pass", "skip")}
    assert "faults" in failing and failing <= {"faults", "reload"}, failing
    assert set(_failed(p, "faults")) == {"no_restarts"}
    faults = check(p, "faults")
    assert faults["evidence"]["launcher"]["restart_count"] == 0
    (r,) = faults["evidence"]["process_tree"]["restarts"]
    assert r["parent"] == faults["evidence"]["launcher"]["pid"] and r["why"] == "same parent and command line"
    assert p["faults"]["restart_count"] == 1 and "fault: engine restarted 1 time(s)" in s["reasons"]
    # /health answered with the launched pid throughout, which holds the listening socket.
    assert check(p, "boot")["conditions"]["health_pid_is_the_serving_process"]["holds"]


def test_an_engine_deterministic_only_on_the_old_fixed_prompts_is_not_deterministic_here(home: Home) -> None:
    s, p = _run(home, "prompt_aware")
    assert s["verdict"] == "rejected"
    assert "deterministic" in _failed(p, "generation")
    probes = check(p, "generation")["evidence"]["probes"]
    assert len(probes["seed"]) == 16 and int(probes["seed"], 16) >= 0 and probes["prompts_drawn"] > 10
    assert probes["tokenization"].startswith("byte-level")


def test_near_ties_forced_except_under_old_style_teacher_forcing_are_caught(home: Home) -> None:
    s, p = _run(home, "forcing_aware")
    assert s["verdict"] == "rejected"
    # Forcing requests look like every other request now, so it lies to them too: the forced candidate
    # diverges again.
    detail = _failed(p, "reload")["output_same_after_same_reload"]
    assert detail.startswith("differs") and "diverges again" in detail
    assert check(p, "generation")["evidence"]["probes"]["forcing_requests"] > 0


def test_a_damaging_reload_hidden_by_a_cache_is_caught_by_a_fresh_engine(home: Home) -> None:
    s, p = _run(home, "cached_reload")
    assert s["verdict"] == "rejected"
    # Every comparison on prompts the engine had seen holds (the cache answers them); only the fresh engine,
    # on prompts neither had seen, differs.
    assert set(_failed(p, "reload")) == {
        "after_same_reload_equals_a_fresh_engine",
        "restored_equals_a_fresh_engine",
    }
    fresh = check(p, "reload")["evidence"]["fresh_engine"]
    assert fresh["weights_digest"] == check(p, "reload")["evidence"]["subject_weights_digest"]
    assert {c["name"]: c["status"] for c in s["checks"]}["generation"] == "pass"


# ---------------------------------------------------------------- GPU only (scripts/gpu-check)
GPU_RUN = ("--preset", "proxy", "--spec", "mtp:3", "--timeout", "600")


@pytest.mark.gpu
def test_the_honest_proxy_engine_is_measurably_faster_replaying_and_speculating_on_a_gpu(home: Home) -> None:
    s, p = _run(home, None, *GPU_RUN, wait=700)
    assert s["verdict"] == "qualified", s["reasons"]
    timing = check(p, "capture")["evidence"]["step_timing"]
    assert timing and all(t["graph_step_s"] < t["bound_s"] for t in timing.values()), timing
    spec = check(p, "generation")["evidence"]["spec_timing"]
    assert spec["measured_ratio"] <= 0.8, spec


@pytest.mark.gpu
def test_graphs_claimed_from_eager_steps_run_at_eager_speed_on_a_gpu(home: Home) -> None:
    # --fail-fast: the run ends with the capture check that catches it (the device time is scarce).
    s, p = _run(home, "claimed_graphs", *GPU_RUN, "--fail-fast", wait=700)
    assert s["verdict"] == "rejected"
    assert "graph_steps_faster_than_eager" in _failed(p, "capture"), check(p, "capture")["evidence"][
        "step_timing"
    ]


@pytest.mark.gpu
def test_speculation_simulated_on_plain_decoding_is_as_slow_as_plain_decoding_on_a_gpu(home: Home) -> None:
    s, p = _run(home, "spec_simulated", *GPU_RUN, wait=700)
    assert s["verdict"] == "rejected"
    failed = _failed(p, "generation")
    assert "speculative_all_accepted_takes_fewer_steps" in failed, check(p, "generation")["evidence"][
        "spec_timing"
    ]
