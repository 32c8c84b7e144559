"""The monitored conditions (qualify/watch/cupti.py) on SYNTHETIC traces (tests/harness/monitor_traces.py):
the honest shape holds every condition on triton, b12x and torch; each lie fails the condition that names it
and, where the lie is narrow, only that one. Recorded H200 traces are replayed by test_cupti_replay.py."""

from __future__ import annotations

from typing import Any

import pytest

from qualify.run.verdict import judge
from qualify.watch import cupti

from . import monitor_traces as t


def _eval(
    windows: list[dict[str, Any]], backend: str = "triton", hello: Any = t.HELLO, lost: str | None = None
):
    found, evidence = cupti.evaluate(windows, t.PLANS, backend, t.WEIGHTS_BYTES, hello, lost)
    return {k: v[1] for k, v in found.items() if not v[0]}, found, evidence


@pytest.mark.parametrize("backend", ["triton", "b12x", "torch"])
def test_the_honest_shape_holds_every_monitored_condition(backend: str) -> None:
    failing, found, evidence = _eval(t.run(backend), backend)
    assert failing == {}, failing
    assert {k.split("_")[0] for k in found} == {"monitor", "capture", "backend", "reload"}
    assert evidence["steps"]["2x4"]["graph_ids"] == [3]


def test_one_size_run_eagerly_fails_capture_and_is_no_other_backend() -> None:
    failing, _, _ = _eval(t.run(eager_requests=2))
    assert set(failing) >= {
        "capture_every_size_replayed_its_graph",
        "capture_no_step_kernel_ran_eagerly",
        "capture_kda_kernels_only_in_graphs",
    }
    assert "2x4" in failing["capture_no_step_kernel_ran_eagerly"]
    assert "2x1" in failing["capture_every_size_replayed_its_graph"]
    # Its steps of 2 requests ran no KDA kernel inside a graph (and after the reloads no graph at all), but
    # the kernels it ran are still the resolved backend's.
    assert "2x" in failing["backend_resolved_kernels_in_every_step"]
    assert "backend_no_kernels_of_other_backends" not in failing


def test_an_eager_step_beside_a_replay_is_still_an_eager_step() -> None:
    """A subtler liar replays the graph (so graph ids and launches look right) and runs the eager step too."""
    windows = t.run()
    for w in windows:
        if w["label"] == "before decode 2x4":
            eager, _ = t._steps((2, 4), 0, t.KDA["triton"], eager=True)
            w["kernels"] += eager
    failing, _, _ = _eval(windows)
    assert set(failing) == {"capture_no_step_kernel_ran_eagerly", "capture_kda_kernels_only_in_graphs"}


def test_triton_run_while_b12x_is_reported_fails_the_backend_conditions() -> None:
    failing, _, _ = _eval(t.run("b12x", kda=t.KDA["triton"]), "b12x")
    assert set(failing) == {"backend_resolved_kernels_in_every_step", "backend_no_kernels_of_other_backends"}
    assert "triton" in failing["backend_no_kernels_of_other_backends"]


def test_torch_run_while_b12x_is_reported_fails_for_the_missing_b12x_kernels() -> None:
    failing, _, _ = _eval(t.run("b12x", kda=None), "b12x")
    assert set(failing) == {"backend_resolved_kernels_in_every_step"}


def test_b12x_kernels_under_a_torch_report_are_foreign() -> None:
    failing, _, _ = _eval(t.run("torch", kda=t.KDA["b12x"]), "torch")
    assert set(failing) == {"backend_no_kernels_of_other_backends"}


def test_recapture_after_reload_fails_the_reload_conditions() -> None:
    failing, _, _ = _eval(t.run(recapture=True))
    assert set(failing) == {"reload_same_graphs_replayed", "reload_no_graph_instantiated"}
    assert "same 8x4" in failing["reload_same_graphs_replayed"]


def test_a_parameter_sized_allocation_in_a_reload_from_file_fails() -> None:
    failing, _, _ = _eval(t.run(reload_alloc=t.WEIGHTS_BYTES))
    assert set(failing) == {"reload_no_parameter_sized_allocation"}
    small, _, _ = _eval(t.run(reload_alloc=8 << 20))  # scratch, well under a quarter of the weights
    assert small == {}


def test_a_silent_monitor_fails_every_condition_that_rests_on_it() -> None:
    failing, found, _ = _eval(t.run(silent=True))
    assert {
        "capture_every_size_replayed_its_graph",
        "capture_no_step_kernel_ran_eagerly",
        "backend_resolved_kernels_in_every_step",
        "reload_same_graphs_replayed",
    } <= set(failing)


def test_a_missing_window_fails_and_a_duplicate_label_cannot_replace_the_first() -> None:
    windows = [w for w in t.run() if w["label"] != "after back decode 1x1"]
    failing, _, _ = _eval(windows)
    assert "reload_monitor_reported_every_window" in failing
    # A second window with an honest label after a lying one: the first one counts.
    lying = t.run(eager_requests=2)
    honest = t.run()
    failing, _, _ = _eval(lying + honest)
    assert "capture_no_step_kernel_ran_eagerly" in failing


def test_a_monitor_that_never_said_hello_or_lost_its_channel_fails() -> None:
    failing, _, _ = _eval(t.run(), hello=None, lost="no hello from the monitor")
    assert set(failing) == {"monitor_reported_from_the_engine"}
    failing, _, _ = _eval(t.run(), lost="the monitor closed its channel")
    assert "stopped reporting" in failing["monitor_reported_from_the_engine"]
    no_cupti = {**t.HELLO, "error": "cupti-python not importable", "kinds": []}
    failing, _, _ = _eval(t.run(), hello=no_cupti)
    assert "CUPTI not recording" in failing["monitor_reported_from_the_engine"]


def test_malformed_reports_are_missing_windows_not_passes() -> None:
    bad = cupti.parse_window({"label": "x", "kernels": [{"graph": 1}]})
    assert bad.missing and not bad.reported
    assert cupti.parse_window("nope").missing


def _monitor_check(found: dict[str, tuple[bool, str]], source: str = "monitored") -> dict[str, Any]:
    conds = {k: {"holds": h, "source": source, "detail": d} for k, (h, d) in found.items()}
    status = "pass" if all(h for h, _ in found.values()) else "fail"
    return {"name": "monitor", "status": status, "conditions": conds}


def test_the_gpu_verdict_requires_the_monitored_conditions() -> None:
    from .test_verdict_policy import ALL_PASS

    _, honest, _ = _eval(t.run())
    results = [r if r["name"] != "monitor" else _monitor_check(honest) for r in ALL_PASS]
    assert judge(results, "gpu").verdict == "qualified", judge(results, "gpu").reasons
    # The same conditions on the engine's word do not do.
    results = [r if r["name"] != "monitor" else _monitor_check(honest, "engine") for r in ALL_PASS]
    j = judge(results, "gpu")
    assert j.verdict == "rejected" and any("monitored" in r for r in j.reasons), j.reasons
    # A run without the monitor's conditions (dropped, not failed) does not qualify either.
    results = [r if r["name"] != "monitor" else {**r, "conditions": {}} for r in ALL_PASS]
    assert any("no such condition" in r for r in judge(results, "gpu").reasons)


def test_a_cpu_target_may_skip_the_monitor_and_a_gpu_target_may_not() -> None:
    from .test_verdict_policy import with_status

    assert judge(with_status("monitor", "skip"), "cpu").verdict == "qualified"
    assert judge(with_status("monitor", "skip"), "gpu").verdict == "rejected"


def test_no_instantiation_is_not_proven_where_the_graph_calls_were_not_traced() -> None:
    windows = [{**w, "enabled": ["CONCURRENT_KERNEL", "MEMORY2"]} for w in t.run()]
    failing, _, _ = _eval(windows)
    assert set(failing) == {"reload_no_graph_instantiated"}
    assert "not traced" in failing["reload_no_graph_instantiated"]


def test_host_work_between_verify_steps_that_shares_some_step_kernels_is_not_an_eager_step() -> None:
    """MTP drafting runs eagerly between verify steps with some of the step's kernels (norms, projections):
    honest, and not what an eager step looks like (all of the graph's kernels, as often as the graph)."""
    windows = t.run()
    for w in windows:
        if "decode" in w["label"] and w["label"].endswith("x4"):
            w["kernels"] += [t._k("_rmsnorm_residual_kernel", 0, 6), t._k("linear_small_kernel", 0, 3)]
    failing, _, _ = _eval(windows)
    assert failing == {}, failing


def test_requests_that_end_early_go_on_in_smaller_graphs_and_that_is_honest() -> None:
    """A request that stops at EOS leaves the batch: a window of 8 requests goes on in the graphs of 4 and 2,
    and after other weights in other ones; each plan still replayed its own graph, and only captured ones."""
    windows = t.run()
    for w in windows:
        if w["label"] == "before decode 8x4":
            w["kernels"] += [t._k(n, 2, 6, 6) for n in t.STEP] + [t._k(n, 4, 6, 6) for n in t.STEP]
        if w["label"] == "after other decode 8x4":
            w["kernels"] += [t._k(n, 3, 6, 6) for n in t.STEP]
    failing, _, evidence = _eval(windows)
    assert failing == {}, failing
    assert evidence["steps"]["8x4"]["own_graphs"] == [1] and evidence["steps"]["8x4"]["graph_ids"] == [
        1,
        2,
        4,
    ]


def test_an_attempt_without_its_own_graph_is_tried_again_and_every_attempt_counts() -> None:
    windows = t.run()
    first = next(w for w in windows if w["label"] == "before decode 8x4")
    retry = {**first, "label": "before decode 8x4 #2"}
    first["kernels"] = [
        k if not k["graph"] else {**k, "graph": 2} for k in first["kernels"]
    ]  # only 4's graph
    windows.insert(windows.index(first) + 1, retry)
    assert _eval(windows)[0] == {}
    # An attempt that ran the step eagerly fails the plan, whatever the next attempt shows.
    eager, _ = t._steps((8, 4), 0, t.KDA["triton"], eager=True)
    first["kernels"] = t._prefill() + eager
    failing, _, _ = _eval(windows)
    assert (
        "capture_no_step_kernel_ran_eagerly" in failing
        and "8x4" in failing["capture_no_step_kernel_ran_eagerly"]
    )


def test_a_truncated_window_proves_nothing() -> None:
    """A liar could flood a window with distinct launches until the eager step falls past the bounds."""
    windows = [{**w, "truncated": True} if w["label"] == "before decode 2x4" else w for w in t.run()]
    failing, _, _ = _eval(windows)
    assert "truncated" in failing["capture_monitor_reported_every_window"]


def test_the_signatures_keep_the_backends_apart() -> None:
    assert cupti.signature_names(["_kda_decode_kernel"], "triton") == {"_kda_decode_kernel"}
    assert cupti.signature_names(["_kda_decode_kernel"], "b12x") == set()
    # b12x's kernel as CUPTI named it on the H200; Triton's is not b12x's, b12x's is not Triton's.
    assert cupti.signature_names(["_packed_sequential_kda_decode_kernel"], "b12x") == {t.KDA["b12x"]}
    assert cupti.signature_names(["_packed_sequential_kda_decode_kernel"], "triton") == set()
    # The engine's other Triton kernels (prefill, fused glue) are no backend's signature.
    glue = [
        "_rmsnorm_kernel",
        "_conv_decode_kernel",
        "_attn_decode_kernel",
        "wu_kernel",
        "_gated_rmsnorm_kernel",
    ]
    assert all(not cupti.signature_names(glue, b) for b in cupti.KDA_SIGNATURES)


def test_api_tracing_that_recorded_no_graph_launch_proves_no_absence_of_instantiation() -> None:
    """Recorded on the H200 once: the monitor said the graph calls were traced and recorded none of them, so
    a recapture in the reload window went unseen by its calls (its new graph ids still gave it away)."""
    windows = [{**w, "api": []} for w in t.run(recapture=True)]
    failing, _, _ = _eval(windows)
    assert "not traced" in failing["reload_no_graph_instantiated"]
    assert "reload_same_graphs_replayed" in failing
