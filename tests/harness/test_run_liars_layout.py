"""Engines that lie about their KV layout, through the real `qualify run` path (local launcher, tiny
preset, CPU): the harness's own peer catches each lie, the layout check fails naming what differed, and
the honest engine (tests/harness/test_run_local.py) still qualifies."""

from __future__ import annotations

import glob
import json
import os

import pytest

from .conftest import LAYOUT, ROOT, Home, check

pytestmark = pytest.mark.slow


def _liar_env(home: Home, module: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return home.env(QUALIFY_ENGINE_MODULE=f"tests.liars.{module}", PYTHONPATH=path, **extra)


def _layout_of_rejected_run(home: Home, env: dict[str, str]) -> dict:
    # The liar's own knobs reach its sandbox only as the operator adds them, on purpose (--engine-env).
    added = [a for k, v in env.items() if k.startswith("LIAR_") for a in ("--engine-env", f"{k}={v}")]
    # --fail-fast: nothing after the layout check is asserted, so the run ends with it.
    ran = home.qualify("run", "--layout", LAYOUT, "--fail-fast", "--json", *added, env=env)
    assert ran.code == 1, ran.stderr[-2000:]
    s = ran.summary()
    assert s["verdict"] == "rejected" and "layout: fail" in s["reasons"]
    (p,) = home.predicates()
    assert p["verdict"] == "rejected"
    assert home.verify_all().code == 0
    return check(p, "layout")


def test_an_engine_laid_out_for_another_dcp_size_that_reports_the_asked_for_spans_is_rejected(home: Home):
    layout = _layout_of_rejected_run(home, _liar_env(home, "wrong_layout"))
    cond = layout["conditions"]
    # The engine's word agrees with the request; what the peer measured does not.
    assert layout["evidence"]["registered"] == [2304, 2304, 2304, 9216]
    assert (
        cond["registered_spans_match_peer"]["holds"]
        and cond["registered_spans_match_peer"]["source"] == "engine"
    )
    sizes = cond["peer_allocation_sizes"]
    assert not sizes["holds"] and sizes["source"] == "observed"
    assert sizes["detail"].startswith("attention0: measured ") and "the geometry needs" in sizes["detail"]
    views = cond["exported_views_match_geometry"]  # the engine's own view table: its word
    assert views["source"] == "engine"
    assert (
        not views["holds"]
        and "attention0: layer 3 k shape [9, 2, 2304, 1, 16] != [9, 4, 2304, 1, 16]" in (views["detail"])
    )
    assert not cond["spans_equal_request"]["holds"] and cond["spans_equal_request"]["source"] == "observed"
    # It registered the sizes it has, which are not what the asked-for geometry needs.
    assert not cond["registered_sizes_match_peer"]["holds"]
    assert "the geometry needs" in cond["registered_sizes_match_peer"]["detail"]


def test_block_size_halved_with_dcp_doubled_keeps_the_bytes_but_not_the_views(home: Home):
    env = _liar_env(home, "wrong_layout", LIAR_GEOMETRY=json.dumps({"block_size": 1152, "dcp_size": 8}))
    cond = _layout_of_rejected_run(home, env)["conditions"]
    assert cond["peer_allocation_sizes"]["holds"]  # same bytes: only the exported views tell
    views = cond["exported_views_match_geometry"]
    assert not views["holds"] and "[9, 8, 1152, 1, 16] != [9, 4, 2304, 1, 16]" in views["detail"]


def test_an_engine_whose_handles_lead_elsewhere_is_rejected_whatever_its_peer_verify_says(home: Home):
    layout = _layout_of_rejected_run(home, _liar_env(home, "canned_peer"))
    cond = layout["conditions"]
    echo = cond["peer_echo_round_trip"]
    assert not echo["holds"] and echo["source"] == "observed" and "engine read" in echo["detail"]
    assert not cond["peer_read_engine_pattern"]["holds"]
    assert cond["peer_allocation_sizes"]["holds"]  # the copies are the right size: only the bytes differ
    # The harness never asked the engine to vouch for itself.
    log = next(home.path.glob("runs/*/engine.log")).read_text()
    assert "LIAR_PEER_VERIFY_CALLED" not in log
    assert not glob.glob("/dev/shm/qualify-liar-copy-*")  # the liar cleaned up its copies


def test_an_export_table_that_overstates_and_an_echo_that_clamps_fail_the_observed_peer_conditions(
    home: Home,
):
    # Shared-memory files claimed to be CUDA allocations, one allocation exported twice under a name the
    # layer pattern does not have, and an echo that clamps an out-of-range request instead of refusing it.
    cond = _layout_of_rejected_run(home, _liar_env(home, "sloppy_export"))["conditions"]
    for name, words in (
        ("peer_device", "not in ['kda0', 'kda1', 'kda2', 'attention0']"),
        ("peer_found_every_group", "unexpected ['kda9']"),
        ("echo_refuses_out_of_bounds", "the engine hashed 64 bytes"),
    ):
        c = cond[name]
        assert not c["holds"] and c["source"] == "observed" and words in c["detail"], (name, c)
    # The memory itself is the engine's real memory: the intervention holds.
    assert all(c["holds"] for k, c in cond.items() if k.startswith("intervention_"))
