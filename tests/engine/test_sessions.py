"""Live sessions (`/qualify/sessions`) and the peer's swap mode against a real tiny engine on CPU: where the
peer puts a token's K/V is where the engine's attention geometry puts it (folded and per rank, any
interleave), a full swap of two sequences' memory makes each answer as the other did, swapping back restores
the baseline, and sessions hold and free capacity as they say."""

from __future__ import annotations

import random

import pytest
import torch

from qualify.engine import kv_export, sessions
from qualify.engine.arena import CapacityError
from qualify.engine.model.attention import DcpGeometry
from qualify.engine.peer import run_swaps, token_rows
from qualify.run.geometry import GEOMETRY

L = 20


@pytest.mark.parametrize(("dcp", "ranks", "interleave"), [(4, 1, 1), (4, 1, 2), (2, 2, 1), (4, 4, 3)])
def test_the_peer_finds_each_token_where_the_engine_stores_it(dcp: int, ranks: int, interleave: int):
    bs = 12
    g = {"block_size": bs, "dcp_size": dcp, "dcp_ranks": ranks, "interleave": interleave}
    span = bs * dcp
    blocks = [5, 2, 7, 3, 9]
    max_len = len(blocks) * span - 3
    positions = torch.arange(0, max_len)
    for rank in range(ranks) if ranks > 1 else [None]:
        geo = DcpGeometry(bs, dcp, interleave, max_len, len(blocks), rank=rank)
        col, off = geo.locate(positions)
        want = [
            blocks[c] * geo.block_storage + o
            for c, o in zip(col.tolist(), off.tolist(), strict=True)
            if o >= 0
        ]
        got = token_rows(g, blocks, 0, max_len, 0 if rank is None else rank)
        assert got == want
        assert len(got) == (
            max_len
            if rank is None
            else len([p for p in range(max_len) if (p % span // interleave) % dcp == rank])
        )


def _rows(st: dict) -> list[tuple[int, list[int], list[float]]]:
    return [(s["token_id"], s["top_ids"], s["top_logits"]) for s in st["sequences"]]


def _swap(engine, st: dict, hi: int, kinds=("kda", "attention")) -> dict:
    a, b = st["sequences"][0], st["sequences"][1]
    spec = {
        "mode": "swap",
        "geometry": GEOMETRY["tiny"].for_peer(0, "cpu"),
        "ranks": [{"rank": 0, "groups": kv_export.kv_handles(engine)["groups"]}],
        "swaps": [
            {
                "name": "pair",
                "kinds": list(kinds),
                "a": {"slots": a["state_slots"], "blocks": a["kv_blocks"]},
                "b": {"slots": b["state_slots"], "blocks": b["kv_blocks"]},
                "positions": [0, hi],
            }
        ],
    }
    return run_swaps(spec)


def _session(engine, prompts, feed, after_start=None, after_step=None):
    st = sessions.session_start(engine, "s", prompts, 3)
    try:
        if after_start:
            after_start(st)
        s1 = sessions.session_step(engine, "s", [feed[0]] * len(prompts))
        if after_step:
            after_step(st)
        s2 = sessions.session_step(engine, "s", [feed[1]] * len(prompts))
    finally:
        sessions.session_close(engine, "s")
    return st, _rows(s1), _rows(s2)


def test_a_full_swap_exchanges_the_outputs_and_swapping_back_restores_them(tiny_engine):
    rnd = random.Random(7)
    prompts = [[rnd.randrange(32, 127) for _ in range(L)] for _ in range(4)]
    feed = [100, 101]
    st, b1, b2 = _session(tiny_engine, prompts, feed)
    seqs = st["sequences"]
    assert (
        len({tuple(s["state_slots"]) for s in seqs}) == 4 and len({tuple(s["kv_blocks"]) for s in seqs}) == 4
    )
    assert all(s["num_tokens"] == L + 1 for s in seqs)
    reports = []
    _, t1, t2 = _session(
        tiny_engine,
        prompts,
        feed,
        lambda st: reports.append(_swap(tiny_engine, st, L)),
        lambda st: reports.append(_swap(tiny_engine, st, L + 1)),
    )
    assert t1[0] == b1[1] and t1[1] == b1[0] and t1[2:] == b1[2:]
    assert t2 == b2
    groups = reports[0]["ranks"][0]["groups"]
    assert {g["name"] for g in groups} == {"kda0", "kda1", "kda2", "attention0"}
    assert all(
        g["swaps"]["pair"]["bytes"] > 0 and g["swaps"]["pair"]["a_before"] != g["swaps"]["pair"]["b_before"]
        for g in groups
    )
    # Swapping back without the row the step wrote (position L) leaves the pair off the baseline.
    _, _, t2_short = _session(
        tiny_engine, prompts, feed, lambda st: _swap(tiny_engine, st, L), lambda st: _swap(tiny_engine, st, L)
    )
    assert t2_short[:2] != b2[:2] and t2_short[2:] == b2[2:]


def test_sessions_hold_capacity_until_closed_and_bound_their_steps(fresh_engine):
    e = fresh_engine
    prompts = [[65 + i] * 5 for i in range(e.cfg.max_num_seqs)]
    st = sessions.session_start(e, "a", prompts, 1)
    with pytest.raises(CapacityError):
        sessions.session_start(e, "b", [[65]], 1)
    with pytest.raises(ValueError, match="max_tokens"):
        sessions.session_step(e, "a", None)  # the prefill token was its one token
    with pytest.raises(ValueError, match="feed needs one token"):
        sessions.session_step(e, "a", [1])
    assert sessions.session_close(e, "a") == {"session": "a", "released": len(prompts)}
    with pytest.raises(ValueError, match="no open session"):
        sessions.session_step(e, "a", None)
    gens, _ = e.generate(prompts, 2)  # the capacity is back
    assert len(gens) == len(prompts) and st["sequences"][0]["token_id"] == gens[0].token_ids[0]
