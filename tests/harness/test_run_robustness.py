"""What the run does when things around it go wrong: a store that fails at the end keeps the signed receipt
on disk and exits 1; heavy engine calls get their check's budget; the target is the host's, not the
engine's claim."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy.exc

from qualify.checks import backend, capture, reload
from qualify.run import receipt as rc
from qualify.run.pipeline import REQUEST_TIMEOUT_S, Pipeline
from receipts import keys
from receipts import statement as st
from receipts.testing import synthetic_predicate

from .test_checks_evidence import Engine, StandingLauncher, _context


class LostStore:
    def append_receipt(self, envelope: Any) -> Any:
        raise sqlalchemy.exc.OperationalError("INSERT", {}, Exception("server closed the connection"))


def test_a_store_lost_at_the_end_keeps_the_signed_receipt_and_exits_1(tmp_path: Path) -> None:
    predicate = st.QualificationPredicate.model_validate(synthetic_predicate())
    subject = [st.Subject(name="e-config", digest={"sha256": "0" * 64})]
    kept = tmp_path / "run" / "receipt.dsse.json"
    with pytest.raises(rc.ReceiptNotStored) as err:
        rc.sign_and_append(LostStore(), keys.generate(), predicate, subject, save_to=kept)  # type: ignore[arg-type]
    assert err.value.exit_code == 1 and "\n" not in str(err.value)
    assert str(kept) in str(err.value) and "qualify receipts import" in str(err.value)
    envelope = json.loads(kept.read_bytes())
    assert envelope["payloadType"] == "application/vnd.in-toto+json" and envelope["signatures"]


def test_heavy_engine_calls_get_the_check_budget_not_a_short_default() -> None:
    engine = Engine()
    seen: dict[str, float] = {}
    handle = engine.handle

    def recording(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.extensions["timeout"]["read"]
        return handle(request)

    ctx = _context(engine)
    ctx.client._http = httpx.Client(transport=httpx.MockTransport(recording))
    ctx.deadline = ctx.client.deadline = time.monotonic() + 250  # a check's budget, as the pipeline sets it
    ctx.describe = ctx.client.describe()
    backend.run(ctx)
    capture.run(ctx)
    reload.run(ctx)
    # A cold proxy engine compiles Triton kernels in its first profiled step and capture warm-up, and a
    # reload generates and hashes 2.9 GB of weights: the old 30 s per request was too short for them.
    for path in ("/qualify/probe", "/qualify/capture", "/qualify/reload"):
        assert seen[path] > 200, (path, seen[path])
    assert REQUEST_TIMEOUT_S >= 120


@pytest.mark.parametrize(("visible", "target"), [("", "cpu"), ("-1", "cpu"), ("0", "gpu"), (None, "gpu")])
def test_a_local_target_is_the_hosts_gpu_unless_cuda_visible_devices_hides_it(
    visible: str | None, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = StandingLauncher()
    launcher.env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}  # type: ignore[attr-defined]
    p = Pipeline.__new__(Pipeline)  # only the target logic: no store, key or run directory needed
    p.launcher, p.req = launcher, None  # type: ignore[assignment]
    monkeypatch.setattr(Pipeline, "_host_has_gpu", lambda self: True)
    assert p._expected_target() == target
    monkeypatch.setattr(Pipeline, "_host_has_gpu", lambda self: False)
    assert p._expected_target() == "cpu"
