"""bench/qualify_run.py's fresh-host summary reads the boot phases and the receipt's kernel-cache record as
the harness writes them: the warm step's workers and specializations, the engine that got the kernels late
(and after how long a wait), and what each engine compiled itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import qualify_run  # noqa: E402
from bench.qualify_run import _fresh_host, engine_startup, own_compiles, weights_step  # noqa: E402
from qualify.engine import REQUEST_LINE, STARTUP_LINE  # noqa: E402
from qualify.engine.precompile import OWN_COMPILE_LINE  # noqa: E402


def test_the_fresh_host_summary_names_the_workers_the_late_give_and_what_engines_compiled() -> None:
    phases = {"prepare": 5.9, "prepare_weights_seeding_step_s": 5.1, "kernels_given_after_ready": 1.4}
    phases["prepare_weights_start_waited_for_seeding_s"] = 3.2
    phases["prepare_weights_stream_hash_s"] = 3.4
    kc = {
        "warm_step_s": 12.5,
        "warm_seconds_each": {"eager b=1 n=6": 0.4, "capture": 6.0},
        "filled_this_run": True,
        "files": 480,
        "waited_before_timed_checks_s": 0.0,
        "precompile": {
            "jobs": 14,
            "specializations": 61,
            "compiled": 60,
            "failed": [{"kernel": "k"}],
            "record_s": 2.1,
            "record_error": "RuntimeError: CUDA error: device-side assert triggered",
            "kernels": ["_attn_decode_kernel", "_gate_kernel"],
            "deferred": ["_packed_sequential_kda_decode_kernel"],
            "launcher_errors": [],
            "seconds": 11.0,
            "launchers_built": 58,
        },  # fmt: skip
        "given": {
            "engine": {
                "given": True,
                "at_start": "still running",
                "late": {"given": True, "waited_s": 1.2, "entries": 70, "entries_it_had": 1},
                "early": {"entries": 9, "files": 58, "matches_kept": True},
                "compiled_itself": {"entries": 2, "kernels": ["_missed"]},
            },  # fmt: skip
            "fresh-reference": {"given": True, "digest": "sha256:x", "compiled_itself": {"entries": 0}},
        },
    }
    got = _fresh_host(phases, kc)
    assert got["precompile_workers"] == 14 and got["precompile_specializations"] == 61
    assert got["precompile_failed"] == 1 and got["warm_step_s"] == 12.5
    assert got["warm_seconds_each"] == {"eager b=1 n=6": 0.4, "capture": 6.0}
    assert got["precompile_record_error"].startswith("RuntimeError: CUDA error")
    assert got["precompile_kernels"] == ["_attn_decode_kernel", "_gate_kernel"]
    assert got["precompile_deferred"] == ["_packed_sequential_kda_decode_kernel"]
    assert got["weights_seeding_step_s"] == 5.1 and got["kernels_given_after_ready_s"] == 1.4
    assert got["weights_start_waited_for_seeding_s"] == 3.2
    assert got["weights_stream_hash_s"] == 3.4 and got["weights_stream_read_s"] is None
    eng, ref = got["engines"]["engine"], got["engines"]["fresh-reference"]
    assert eng["at_start"] is False and eng["late_waited_s"] == 1.2 and eng["compiled_itself"] == 2
    assert eng["compiled_itself_kernels"] == ["_missed"]
    assert eng["early_entries"] == 9 and eng["early_matches_kept"] is True
    assert ref["at_start"] is True and ref["late_waited_s"] is None and ref["compiled_itself"] == 0
    assert _fresh_host({}, {})["engines"] == {}


def test_the_kernels_an_engine_compiled_itself_are_read_from_each_engine_log(tmp_path: Path) -> None:
    (tmp_path / "fresh-reference").mkdir()
    rec = {"kernel": "_norm_head_kernel", "constexprs": {"BM": 16}, "divisible_by_16": ["x"]}
    (tmp_path / "engine.log").write_text(
        f"# engine startup (s): {{}}\n{OWN_COMPILE_LINE}{json.dumps(rec)}\n{OWN_COMPILE_LINE}{{cut\n"
    )
    (tmp_path / "fresh-reference" / "engine.log").write_text("nothing compiled here\n")
    (tmp_path / "warm-step.log").write_text("{}\n")
    got = own_compiles(str(tmp_path))
    assert list(got) == ["engine.log"]  # only logs with such lines
    assert got["engine.log"][0] == rec and got["engine.log"][1] == {"unreadable": "{cut\n"}
    assert own_compiles(None) == {} and own_compiles(str(tmp_path / "gone")) == {}


def test_each_engines_start_up_and_the_seeding_steps_own_seconds_are_read_from_their_logs(
    tmp_path: Path,
) -> None:
    (tmp_path / "fresh-reference").mkdir()
    boot = {"at_serve": 0.05, "weights_wait": 1.25, "weights": 0.4, "at_ready": 3.1}
    (tmp_path / "engine.log").write_text(f"# qualify: boot 1\n{STARTUP_LINE}{json.dumps(boot)}\n")
    (tmp_path / "fresh-reference" / "engine.log").write_text(f"{STARTUP_LINE}{{cut\n")
    (tmp_path / "warm-step.log").write_text("{}\n")
    got = engine_startup(str(tmp_path))
    assert got == {"engine.log": [boot], "fresh-reference/engine.log": [{"unreadable": "{cut\n"}]}
    assert weights_step(str(tmp_path)) is None  # cached weights: no step ran
    said = {"weights": "fd 9", "bytes": 10, "seconds": {"process_start_to_here": 0.1, "config": 1.9}}
    (tmp_path / "weights-step.log").write_text(f"a line of the step's\n{json.dumps(said)}\n")
    assert weights_step(str(tmp_path)) == said
    assert engine_startup(None) == {} and weights_step(None) is None


def test_evidence_seconds_lists_the_seconds_figures_by_path_and_stops_at_its_bound() -> None:
    ev = {
        "total_seconds_count": 1,  # not a seconds key
        "fresh_engine": {"seconds": {"boot": 5.0}, "peer_s": 1.25, "seconds_each": {"load": 0.5}},
        "runs": [{"label": "apply", "seconds": 1.5}, {"flag_s": True, "inner": {"wait_seconds": 2}}],
    }
    assert qualify_run.evidence_seconds(ev) == {
        "fresh_engine.seconds.boot": 5.0,
        "fresh_engine.peer_s": 1.25,
        "fresh_engine.seconds_each.load": 0.5,
        "runs[0].seconds": 1.5,
        "runs[1].inner.wait_seconds": 2.0,
    }
    many = {f"k{i}_s": float(i) for i in range(qualify_run.MAX_EVIDENCE_SECONDS + 10)}
    assert len(qualify_run.evidence_seconds(many)) == qualify_run.MAX_EVIDENCE_SECONDS


def test_the_capture_timing_is_kept_with_its_samples() -> None:
    capture = {"step_timing": {"1": {"eager_samples_s": [5e-3, 6e-3], "graph_samples_s": [1e-3, 4e-3],
                                     "rank_p": 0.2, "rounds": 9, "first_rounds": {"rank_p": 0.03},
                                     "rule": "..."}}}  # fmt: skip
    got = qualify_run.step_timing(capture)
    assert got["1"]["graph_samples_s"] == [1e-3, 4e-3] and got["1"]["rounds"] == 9 and "rule" not in got["1"]
    assert qualify_run.step_timing({}) == {}


def test_request_seconds_sum_each_engine_log_and_the_engine_under_tests_per_check(tmp_path: Path) -> None:
    def line(n: int, mode: str, verb: float, prefill: float, spec: bool = False) -> str:
        rec = {"n": n, "max_tokens": 2, "mode": mode, "spec": spec, "verb_s": verb, "prefill_s": prefill,
               "prompts": n, "handler_s": verb + 0.001}  # fmt: skip
        return f"{REQUEST_LINE}{json.dumps(rec)}\n"

    (tmp_path / "fresh-reference").mkdir()
    (tmp_path / "engine.log").write_text(
        "# engine startup (s): {}\n" + line(3, "eager", 0.05, 0.03) + line(8, "graph", 0.2, 0.08)
        + line(8, "graph", 0.3, 0.08) + f"{REQUEST_LINE}{{cut\n" + line(1, "graph", 0.1, 0.01, spec=True)
    )  # fmt: skip
    (tmp_path / "fresh-reference" / "engine.log").write_text(line(4, "eager", 0.04, 0.02))
    waits = {
        "boot": {"POST /v1/completions": {"n": 1, "s": 0.06}, "GET /health": {"n": 1, "s": 0.0}},
        "layout": {"GET /v1/describe": {"n": 1, "s": 0.0}},
        "capture": {"POST /v1/completions": {"n": 2, "s": 0.6}},
        "generation": {"POST /v1/completions": {"n": 1, "s": 0.12}},
    }
    got = qualify_run.request_seconds(str(tmp_path), waits)
    eng = got["engine.log"]
    assert eng["all"]["requests"] == 4 and eng["all"]["prompts"] == 20 and eng["aligned"] is True
    assert eng["all"]["prefill_s"] == 0.2 and eng["all"]["prefill_s_per_prompt"] == 0.01
    assert eng["by_shape"]["plain graph n=8"]["requests"] == 2 and "spec graph n=1" in eng["by_shape"]
    assert list(eng["by_check"]) == ["boot", "capture", "generation"]
    assert eng["by_check"]["capture"]["verb_s"] == 0.5 and eng["by_check"]["capture"]["harness_wait_s"] == 0.6
    assert (
        got["fresh-reference/engine.log"]["all"]["requests"] == 1
        and "by_check" not in got["fresh-reference/engine.log"]
    )
    waits["generation"]["POST /v1/completions"]["n"] = 2  # a failed request logs no line
    assert qualify_run.request_seconds(str(tmp_path), waits)["engine.log"]["aligned"] is False
    assert qualify_run.request_seconds(None, waits) == {}
