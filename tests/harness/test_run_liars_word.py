"""Engines whose own word is wrong, for the conditions whose source is `engine` and that no other liar makes
fail, through the real `qualify run` path (local launcher, tiny preset, CPU, sandbox): /health naming a
process that does not serve, describe naming another weights file than the one handed over, /health
naming another process at the end of the run than at boot, describe answering in another protocol
version, and an engine serving another capacity than the launch document sent. Each is rejected by the
condition it lies to."""

from __future__ import annotations

import pytest

from .conftest import Home, check
from .test_run_liars_layout import _liar_env

pytestmark = pytest.mark.slow


def _rejected(home: Home, liar: str, *args: str) -> dict:
    ran = home.qualify("run", "--json", *args, env=_liar_env(home, liar), timeout=300)
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    assert p["verdict"] == "rejected"
    assert home.verify_all().code == 0
    return p


def _failed(p: dict, check_name: str, cond: str, *words: str) -> None:
    c = check(p, check_name)["conditions"][cond]
    assert not c["holds"] and c["source"] == "engine", c
    for w in words:
        assert w in (c["detail"] or ""), c


def test_a_health_pid_that_is_not_the_serving_process_fails_boot(home: Home) -> None:
    p = _rejected(home, "health_elsewhere", "--fail-fast")
    _failed(p, "boot", "health_pid_is_the_serving_process", "processes of the launched tree")
    assert check(p, "boot")["status"] == "fail"


def test_an_engine_naming_other_weights_than_the_handed_file_fails_boot(home: Home) -> None:
    p = _rejected(home, "names_other_weights", "--fail-fast")
    _failed(p, "boot", "engine_names_handed_weights", "own-weights.safetensors")
    # Its output is the handed file's all the same: only its word is wrong.
    assert check(p, "boot")["conditions"]["handed_weights_reload_keeps_output"]["holds"]


def test_a_serving_process_swapped_during_the_run_fails_the_faults_check(home: Home) -> None:
    p = _rejected(home, "serving_swapped")
    assert check(p, "boot")["conditions"]["health_pid_is_the_serving_process"]["holds"]
    _failed(p, "faults", "same_serving_process_as_at_boot", "boot")
    ev = check(p, "faults")["evidence"]["serving_process"]
    assert ev["boot"]["pid"] != ev["end"]["pid"]


def test_describe_in_another_protocol_version_fails_boot(home: Home) -> None:
    p = _rejected(home, "describe_v1", "--fail-fast")
    _failed(p, "boot", "protocol_version_spoken", "protocol version '1'")


def test_an_engine_serving_another_capacity_than_sent_fails_boot(home: Home) -> None:
    p = _rejected(home, "own_capacity", "--fail-fast")
    _failed(p, "boot", "described_config_agrees_with_sent", "max_num_seqs")
