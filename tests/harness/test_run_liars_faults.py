"""Lying engines and a lying Xid watch, through the real `qualify run` path (local launcher, tiny preset,
CPU): an engine that dies after the faults check, and a GPU target whose only Xid source is a replayed
file. Each run is rejected, and its receipt's faults block and verdict agree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qualify.run.receipt import engine_code_digest_on_disk, file_digest
from receipts.statement import Faults

from .conftest import ROOT, SAMPLE_KMSG, Home, check

pytestmark = pytest.mark.slow


def _liar_env(home: Home, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return home.env(QUALIFY_ENGINE_MODULE="tests.liars.late_exit", PYTHONPATH=path, **extra)


@pytest.mark.parametrize("when", ["metrics", "sigterm"])
def test_an_engine_that_dies_after_the_faults_check_is_rejected(home: Home, when: str) -> None:
    ran = home.qualify("run", "--json", "--engine-env", f"LIAR_LATE_EXIT={when}", env=_liar_env(home))
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    # Every check passed, the faults check included: the lie comes after it.
    assert all(c["status"] in ("pass", "skip") for c in s["checks"]), s["checks"]
    assert check(s, "faults")["status"] == "pass"
    assert s["verdict"] == "rejected"
    (p,) = home.predicates()
    assert p["verdict"] == "rejected"
    assert check(p, "boot")["evidence"]["launcher"]["engine_module"] == "tests.liars.late_exit"
    blocking = Faults.model_validate(p["faults"]).blocking(p["target"])
    assert blocking, p["faults"]
    assert [r for r in s["reasons"] if r.startswith("fault: ")] == [f"fault: {b}" for b in blocking]
    # The receipt identifies what ran, as the harness saw it: the code subject covers the wrapper module,
    # the config is what the harness sent, the weights digest is the harness's hash of the file.
    assert "tests.liars.late_exit" in p["engine"]["code_scope"]
    subjects = {sub["name"].rsplit("-", 1)[-1]: sub["digest"]["sha256"] for sub in s["subjects"]}
    assert "sha256:" + subjects["code"] == p["engine"]["code_digest"] != engine_code_digest_on_disk()
    sent = p["engine"]["config"]
    assert {k: sent[k] for k in ("preset", "kda_decode_backend", "num_spec")} == {
        "preset": "tiny", "kda_decode_backend": "auto", "num_spec": 0
    }  # fmt: skip
    assert sent["dcp_size"] == 4 and sent["max_num_seqs"] == 8  # the geometry flags it sent, too
    assert p["engine"]["described_config"]["preset"] == "tiny"
    boot = check(p, "boot")
    assert boot["conditions"]["launched_process_serves_the_port"] == {
        "holds": True, "source": "observed", "detail": None
    }  # fmt: skip
    weights = boot["evidence"]["weights_file"]
    assert weights["hashed"] and file_digest(Path(weights["path"])) == "sha256:" + subjects["weights"]
    assert weights["digest"] != boot["evidence"]["engine"]["weights_digest"]
    if when == "sigterm":  # alive until stopped, then exit 1 instead of dying of SIGTERM
        assert p["faults"]["stop_exit_code"] == 1 and not p["faults"]["engine_dead"]
    else:  # gone before the stop: restarted by the supervisor, dead, or exit 1 at the stop (a race)
        f = p["faults"]
        assert f["restart_count"] or f["engine_dead"] or f["stop_exit_code"] == 1, f
    assert home.verify_all().code == 0


def test_a_gpu_target_with_a_replayed_kernel_log_is_not_watched(home: Home) -> None:
    """On this CPU machine the GPU host is simulated (QUALIFY_TEST_SIMULATE_GPU_HOST, tests only, recorded
    in the receipt), so the run also fails what a CPU engine cannot show on a GPU target (device, capture);
    what this test pins is that the replayed file is `replayed`, never `active`, and blocks on its own."""
    env = home.env(QUALIFY_KMSG_SOURCE=str(SAMPLE_KMSG), QUALIFY_TEST_SIMULATE_GPU_HOST="1")
    ran = home.qualify("run", "--json", env=env)
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "rejected" and s["target"] == "gpu"
    (p,) = home.predicates()
    f = p["faults"]
    assert f["xid_watch"] == "replayed" and "not a live watch" in f["xid_watch_reason"]
    assert "QUALIFY_TEST_SIMULATE_GPU_HOST=1" in f["xid_watch_reason"]
    watched = check(p, "faults")["conditions"]["xid_watched"]
    assert watched == {"holds": False, "source": "observed", "detail": watched["detail"]}
    assert "fault: Xid watch replayed on a gpu target" in s["reasons"]
    # The same faults block without the replay's fatal Xids still blocks a gpu target, and only that.
    alone = Faults.model_validate({**f, "xid_events": []})
    assert alone.blocking("gpu") == ["Xid watch replayed on a gpu target"] and alone.blocking("cpu") == []
    assert home.verify_all().code == 0
