"""The monitor check's own steps (qualify/checks/monitor.py) with a scripted monitor and engine: the windows
it opens are the ones qualify/watch/cupti.py judges (labels, plans, order: the steps at every plan, then
each reload and the steps after it), its conditions are all `monitored`, a CPU target is a skip that says
why, and a GPU target without graphs or without a monitor fails."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from qualify.checks import monitor as check
from qualify.checks.base import Context

from . import monitor_traces as t


class ScriptedMonitor:
    """Answers each window with the synthetic trace's window of the same label."""

    def __init__(self, windows: list[dict[str, Any]]) -> None:
        self.by_label = {w["label"]: w for w in windows}
        self.windows: list[dict[str, Any]] = []
        self.hello, self.lost = t.HELLO, None

    def window(self, label: str) -> Any:
        mon = self

        class W:
            report: dict[str, Any] = {}

            def __enter__(self) -> W:
                return self

            def __exit__(self, *exc: object) -> None:
                base = label.split(" #")[0]  # a later attempt: the same window again
                self.report = mon.by_label.get(label) or {
                    **mon.by_label.get(base, {"missing": "not scripted"})
                }
                self.report["label"] = label
                mon.windows.append(self.report)

        return W()

    def status(self) -> dict[str, Any]:
        return {"windows": len(self.windows)}


class Client:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def describe(self) -> Any:
        return SimpleNamespace(
            capacity=SimpleNamespace(num_spec=3),
            config={"capture_sizes": [32, 16, 8, 4], "seed": 0},
            backend=SimpleNamespace(resolved="triton"),
        )

    def complete(self, req: Any) -> Any:
        self.calls.append(("complete", len(req.prompt), req.max_tokens, req.mode, req.speculative))
        return SimpleNamespace()

    def reload(self, req: Any, timeout_s: float) -> Any:
        self.calls.append(("reload", req.seed, req.path))
        return SimpleNamespace(weights_path="/w/proxy.safetensors")


def _ctx(target: str = "gpu", monitor: Any = None, captured: bool = True) -> Context:
    launcher = SimpleNamespace(kind="local", monitor=monitor)
    ctx = Context(request=None, launcher=launcher, client=Client(), target=target)  # type: ignore[arg-type]
    ctx.captured = captured
    ctx.facts["weights_file"] = {"bytes": t.WEIGHTS_BYTES}
    return ctx


def test_the_plans_are_every_capture_size_and_its_plain_decode_twin() -> None:
    assert check.plans_of(Client().describe()) == t.PLANS


def test_the_check_opens_the_windows_the_conditions_read_and_they_are_monitored() -> None:
    mon = ScriptedMonitor(t.run())
    ctx = _ctx(monitor=mon)
    out = check.run(ctx)
    assert out.status == "pass", out.reason
    assert [w["label"] for w in mon.windows] == [w["label"] for w in t.run()]
    assert all(c.source == "monitored" for c in out.conditions.values())
    assert out.evidence["monitor"]["file_sha256"] == check.monitor_file_digest()
    calls = ctx.client.calls  # type: ignore[attr-defined]
    assert ("complete", 2, 6, "graph", True) in calls and ("complete", 2, 1, "graph", False) in calls
    assert [c for c in calls if c[0] == "reload"] == [
        ("reload", None, None),
        ("reload", check.OTHER_SEED_OFFSET, None),
        ("reload", None, "/w/proxy.safetensors"),
    ]


def test_a_lie_in_the_windows_fails_the_check() -> None:
    out = check.run(_ctx(monitor=ScriptedMonitor(t.run(recapture=True))))
    assert out.status == "fail" and "reload_same_graphs_replayed" in (out.reason or "")


def test_a_cpu_target_skips_saying_why_and_a_gpu_target_without_monitor_or_graphs_fails() -> None:
    skip = check.run(_ctx("cpu", ScriptedMonitor([])))
    assert skip.status == "skip" and "not applicable" in (skip.reason or "")
    none = check.run(_ctx(monitor=None))
    assert none.status == "fail" and none.conditions["monitor_reported_from_the_engine"].source == "monitored"
    uncaptured = check.run(_ctx(monitor=ScriptedMonitor(t.run()), captured=False))
    assert uncaptured.status == "fail" and "no captured graphs" in (uncaptured.reason or "")
