"""Engine test fixtures: a private data dir for generated weights, and a tiny CPU engine."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _engine_home(tmp_path_factory):
    old = os.environ.get("QUALIFY_HOME")
    os.environ["QUALIFY_HOME"] = str(tmp_path_factory.mktemp("qualify-home"))
    yield
    if old is None:
        os.environ.pop("QUALIFY_HOME", None)
    else:
        os.environ["QUALIFY_HOME"] = old


def make_engine(**fields):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    fields.setdefault("device", "cpu")
    return Engine(EngineConfig(**fields))


def prefill_row(runner, batch, at, one_forward=False):
    """The logits and last hidden state of batch[at], prefilled with the rest of `batch`: by the engine's
    prefill, or with `one_forward` in one plain varlen forward over the whole batch (no row invariance)."""
    reqs = [runner.admit(p, 1) for p in batch]
    try:
        logits = (runner._prefill_varlen if one_forward else runner.prefill)(reqs)
        return logits[at].clone(), runner.prefill_hidden[at].clone()
    finally:
        for q in reqs:
            runner.release(q)


@pytest.fixture(scope="session")
def tiny_engine(_engine_home):
    """Shared tiny engine: tests that change its weights must use their own engine."""
    e = make_engine()
    yield e
    e.close()


@pytest.fixture
def fresh_engine(_engine_home):
    e = make_engine()
    yield e
    e.close()
