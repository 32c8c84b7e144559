"""Engines that pass every check of their exported memory while computing with other memory, through the
real `qualify run` path (local launcher, tiny preset, CPU): the layout check's intervention (the harness's
peer swaps the memory the geometry assigns live sequences between decode steps) and the dcp check's
per-rank CPU time catch each one, naming the condition; the peer's read/write checks alone would not."""

from __future__ import annotations

import pytest

from .conftest import LAYOUT, Home, check
from .test_run_liars_layout import _liar_env

pytestmark = pytest.mark.slow
DCP2_LAYOUT = "2304,2304,2304,4608"


def _rejected(home: Home, env: dict[str, str], *args: str) -> dict:
    """The rejected run's predicate; the tests that assert only the layout check pass --fail-fast."""
    # The liar's own knobs reach its sandbox only as the operator adds them, on purpose (--engine-env).
    added = [a for k, v in env.items() if k.startswith("LIAR_") for a in ("--engine-env", f"{k}={v}")]
    ran = home.qualify("run", *args, "--json", *added, env=env, timeout=400)
    assert ran.code == 1, ran.stderr[-2000:]
    (p,) = home.predicates()
    assert p["verdict"] == "rejected"
    assert home.verify_all().code == 0
    return p


def _failed(cond: dict, name: str, *words: str) -> None:
    c = cond[name]
    assert not c["holds"] and c["source"] == "observed", (name, c)
    for w in words:
        assert w in c["detail"], (name, c["detail"])


def _peer_fooled(cond: dict) -> None:
    """The peer's read/write/size checks hold on decoys: they prove access, not use."""
    for name in ("peer_ran", "peer_allocation_sizes", "peer_read_engine_pattern", "peer_echo_round_trip"):
        assert cond[name]["holds"], (name, cond[name])
    assert cond["exported_views_match_geometry"]["source"] == "engine"


def test_decoy_allocations_that_hold_no_cache_are_rejected_by_the_intervention(home: Home):
    p = _rejected(home, _liar_env(home, "decoy_kv"), "--layout", LAYOUT, "--fail-fast")
    layout = check(p, "layout")
    cond = layout["conditions"]
    _peer_fooled(cond)
    _failed(cond, "intervention_memory_holds_caches", "identical (no cache there)", "full@rank0/attention0")
    _failed(cond, "intervention_swap_exchanges_outputs", "in the baseline")
    _failed(cond, "intervention_kda_slots_owned", "does not compute with the kda memory")
    _failed(cond, "intervention_attention_pages_owned", "does not compute with the attention memory")
    _failed(cond, "spans_equal_request", "the intervention did not show")
    assert not p["layout"]["peer_verified"]


def test_decoys_mirrored_from_the_real_caches_are_rejected_all_the_same(home: Home):
    env = _liar_env(home, "decoy_kv", LIAR_DECOY="mirror")
    cond = check(_rejected(home, env, "--layout", LAYOUT, "--fail-fast"), "layout")["conditions"]
    _peer_fooled(cond)
    assert cond["intervention_memory_holds_caches"]["holds"]  # the decoys hold plausible bytes
    _failed(cond, "intervention_swap_exchanges_outputs")
    _failed(cond, "intervention_kda_slots_owned")
    _failed(cond, "intervention_attention_pages_owned")


def test_an_engine_that_scrambles_the_owner_of_changed_memory_cannot_fake_the_exchange(home: Home):
    # It moves exactly the owners' outputs when their exported memory changes, and leaves the others:
    # only the exact predictions (the swapped pair answers as each other did; swapped back, as before)
    # tell it from an engine that computes with that memory.
    env = _liar_env(home, "decoy_kv", LIAR_DECOY="scramble")
    cond = check(_rejected(home, env, "--layout", LAYOUT, "--fail-fast"), "layout")["conditions"]
    for name in ("intervention_kda_slots_owned", "intervention_attention_pages_owned"):
        assert cond[name]["holds"], cond[name]
    assert cond["intervention_others_unchanged"]["holds"]
    _failed(cond, "intervention_swap_exchanges_outputs", "in the baseline")
    _failed(cond, "intervention_restore_gives_original", "after the swap back")


def test_the_same_bytes_laid_out_for_another_block_size_fail_the_intervention(home: Home):
    env = _liar_env(home, "wrong_layout", LIAR_GEOMETRY='{"block_size": 1152, "dcp_size": 8}')
    cond = check(_rejected(home, env, "--layout", LAYOUT, "--fail-fast"), "layout")["conditions"]
    assert cond["peer_allocation_sizes"]["holds"]
    # Beyond the engine's own view table, the effect shows it: the swap at the geometry's rows is partial.
    _failed(cond, "intervention_swap_exchanges_outputs")
    _failed(cond, "intervention_restore_gives_original")


def test_idle_children_standing_in_for_dcp_ranks_are_rejected(home: Home):
    env = _liar_env(home, "idle_dcp_ranks")
    p = _rejected(home, env, "--dcp", "2", "--layout", DCP2_LAYOUT)
    dcp = check(p, "dcp")["conditions"]
    # The folded engine's output equals the DCP 1 reference's, and its children are live processes.
    assert dcp["dcp_vs_dcp1"]["holds"] and dcp["every_rank_is_a_live_process_of_the_engine"]["holds"]
    _failed(dcp, "every_rank_worked_during_generation", "ranks [1] spent no CPU time")
    cond = check(p, "layout")["conditions"]
    _peer_fooled(cond)
    _failed(cond, "intervention_memory_holds_caches", "@rank1/")
    _failed(cond, "intervention_swap_exchanges_outputs")


def test_ranks_that_store_each_others_shards_are_caught_by_the_row_the_step_wrote(home: Home):
    # Every rank holds one shard of the asked-for shape and the output is right: only where the new
    # token's K/V went (another rank than the geometry's) shows, when the swap back misses it.
    env = _liar_env(home, "rotated_shards")
    p = _rejected(home, env, "--dcp", "2", "--layout", DCP2_LAYOUT)
    assert check(p, "dcp")["status"] == "pass"
    cond = check(p, "layout")["conditions"]
    assert cond["intervention_swap_exchanges_outputs"]["holds"]
    _failed(cond, "intervention_restore_gives_original", "after the swap back")
    failed = sorted(k for k, c in cond.items() if not c["holds"])
    assert failed == ["intervention_restore_gives_original", "spans_equal_request"], failed
