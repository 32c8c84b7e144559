"""capture: FULL CUDA graphs captured for every size, and replay equals eager (coherence rule).
Where the engine cannot capture (CPU) the check is a skip carrying the engine's reason."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, coherence, fail_unless


def run(ctx: Context) -> Outcome:
    before = ctx.client.describe()
    cap = ctx.client.capture()
    evidence = {
        "capture": cap.model_dump(mode="json"),
        "cudagraph_mode": before.cudagraph_mode,
        "device_type": before.device.type,
    }
    if not cap.captured:
        if ctx.target == "cpu":
            return Outcome(
                "skip", evidence, cap.reason or "the engine does not capture graphs on this device"
            )
        return Outcome("fail", evidence, f"no graphs captured on a {ctx.target} target: {cap.reason}")
    ctx.captured = True
    want = sorted(before.config.get("capture_sizes") or [])
    eager = ctx.generate(mode="eager")
    graph = ctx.generate(mode="graph")
    after = ctx.client.describe()
    coh = coherence(eager, graph)
    ctx.facts["eager_vs_graph"] = coh
    evidence.update(
        requested_sizes=want,
        replay_vs_eager=coh,
        mode_used=graph.mode_used,
        counters={"before": before.counters.model_dump(), "after": after.counters.model_dump()},
    )
    return fail_unless(
        {
            "every_size_captured": sorted(cap.sizes) == want,
            "graph_mode_used": graph.mode_used == "graph",
            "replays_counted": after.counters.graph_replays > before.counters.graph_replays,
            "replay_equals_eager": coh["agrees"],
        },
        evidence,
    )


CHECK = Check("capture", run, timeout_s=300.0)
