"""bench/batch_variance.py on the tiny CPU engine: a prompt prefilled alone twice gives the same logits (the
control every figure rests on), among fillers the engine's prefill gives them again and one forward over
the batch moves them a little, a prompt is found at its own row (a wrong row would move by whole logits),
and the summary counts what the rows say."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
bv = pytest.importorskip("bench.batch_variance")


@pytest.fixture(scope="module")
def engine():
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    e = Engine(EngineConfig(preset="tiny", device="cpu", cudagraph_mode="none"))
    yield e
    e.close()


def test_alone_twice_is_exact_and_fillers_move_nothing(engine) -> None:
    got = bv.measure(engine, prompts=3, rounds=2, seed=1)
    assert len(got["rows"]) == 3 and got["repeat_alone_max_abs"] == 0.0
    assert got["among_fillers_max_abs"] == 0.0  # each prompt prefilled on its own
    assert got["prompts_whose_top1_changed"] == 0
    assert got["gaps_below_epsilon"] == sum(1 for r in got["rows"] if r["top2_gap_alone"] < bv.EPSILON)
    # one forward over each batch: on the CPU only the head's fp32 product changes with the batch's rows
    # (its sums' order), a few ulps, but not nothing
    one = bv.measure(engine, prompts=3, rounds=2, seed=1, one_forward=True)
    assert one["repeat_alone_max_abs"] == 0.0 and 0.0 < one["among_fillers_max_abs"] < 1e-3


def test_a_row_mix_up_shows_as_a_large_move(engine, monkeypatch) -> None:
    # the same measurement reading the wrong row of the batch: what the control above rules out
    real = bv._prefill

    def wrong_row(runner, batch, at, one_forward=False):
        return real(runner, batch, (at + 1) % len(batch), one_forward)

    monkeypatch.setattr(bv, "_prefill", wrong_row)
    got = bv.measure(engine, prompts=2, rounds=2, seed=2)
    assert got["among_fillers_max_abs"] > 0.1
