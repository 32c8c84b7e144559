"""The warm step records b12x's start-up conformance check instead of compiling it before its recording
(kernels/kda/b12x.py record_conformance): the check runs without comparing (nothing launches in a recording
pass), the device's status is taken for that process only, and the step does so only where the engine would
consult b12x."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from kernels.kda import b12x
from qualify.engine import __main__ as main


def test_the_check_is_recorded_without_comparing_and_the_status_is_kept_for_the_process(monkeypatch) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(b12x, "_STATUS", {})
    monkeypatch.setattr(b12x, "_import_gdn_decode", lambda: None)
    monkeypatch.setattr(b12x, "conformance_check", lambda device, **kw: calls.append(kw))
    monkeypatch.setattr(b12x, "_prefill_note", lambda device: "prefill: triton")
    dev = torch.device("cuda", 0)
    ok, why = b12x.record_conformance(dev)
    assert ok and "recorded, not compared" in why and calls == [{"compare": False}]
    assert b12x._status(dev) == (ok, why) and calls == [{"compare": False}]  # kept: not checked again
    assert b12x.record_conformance(torch.device("cpu"))[0] is False  # no CUDA: as a serving engine finds it


def test_an_uninstalled_b12x_is_found_as_a_serving_engine_would_find_it(monkeypatch) -> None:
    monkeypatch.setattr(b12x, "_STATUS", {})

    def broken():  # noqa: ANN202
        raise ImportError("no module named b12x")

    monkeypatch.setattr(b12x, "_import_gdn_decode", broken)
    ok, why = b12x.record_conformance(torch.device("cuda", 0))
    assert not ok and "not importable" in why


@pytest.mark.parametrize(
    ("backend", "num_spec", "device", "records"),
    [("auto", 3, "cuda", True), ("b12x", 0, "cuda", True), ("auto", 0, "cuda", False),
     ("triton", 3, "cuda", False), ("auto", 3, "cpu", False)],
)  # fmt: skip
def test_the_warm_step_records_the_check_only_where_the_engine_would_consult_b12x(
    monkeypatch, backend: str, num_spec: int, device: str, records: bool
) -> None:
    seen: list[object] = []
    monkeypatch.setattr(b12x, "record_conformance", lambda dev: seen.append(dev))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Pre:
        def recording(self):  # noqa: ANN202
            import contextlib

            return contextlib.nullcontext()

    cfg = SimpleNamespace(kda_decode_backend=backend, num_spec=num_spec, device=device)
    main._record_b12x_conformance(cfg, Pre())
    assert seen == ([torch.device("cuda", 0)] if records else [])


@pytest.mark.parametrize("requested", ["auto", "b12x", "triton", "torch"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_the_warm_steps_rule_is_the_one_resolve_backend_follows(
    monkeypatch, requested: str, speculative: bool, device: str
) -> None:
    """consults_b12x says yes exactly where resolve_backend asks b12x for its status."""
    from kernels.kda import backend

    asked: list[object] = []

    def status(dev):  # noqa: ANN001, ANN202
        asked.append(dev)
        return True, "ok"

    monkeypatch.setattr(b12x, "b12x_status", status)
    monkeypatch.setattr(backend, "_interpreting", lambda: True)  # triton on a cpu device resolves
    with contextlib.suppress(backend.BackendUnavailable):
        backend.resolve_backend(requested, speculative=speculative, device=device)
    assert bool(asked) == backend.consults_b12x(requested, speculative=speculative, device=device)
