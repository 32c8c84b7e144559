"""bench/batch_variance.py on the tiny CPU engine: a prompt prefilled alone twice gives the same logits (the
control every figure rests on), among fillers it is found at its own row (a wrong row would move by whole
logits), and the summary counts what the rows say."""

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


def test_alone_twice_is_exact_and_fillers_move_the_logits_little(engine) -> None:
    got = bv.measure(engine, prompts=3, rounds=2, seed=1)
    assert len(got["rows"]) == 3 and got["repeat_alone_max_abs"] == 0.0
    # on the CPU only the head's fp32 product changes with the batch's rows (its sums' order): a few ulps
    assert 0.0 <= got["among_fillers_max_abs"] < 1e-3
    assert got["prompts_whose_top1_changed"] == 0
    assert got["gaps_below_epsilon"] == sum(1 for r in got["rows"] if r["top2_gap_alone"] < bv.EPSILON)


def test_a_row_mix_up_shows_as_a_large_move(engine, monkeypatch) -> None:
    # the same measurement reading the wrong row of the batch: what the control above rules out
    real = bv._prefill

    def wrong_row(runner, batch, at):
        return real(runner, batch, (at + 1) % len(batch))

    monkeypatch.setattr(bv, "_prefill", wrong_row)
    got = bv.measure(engine, prompts=2, rounds=2, seed=2)
    assert got["among_fillers_max_abs"] > 0.1
