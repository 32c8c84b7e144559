"""boot: the engine becomes healthy within the timeout; versions, device, driver and identity recorded."""

from __future__ import annotations

import time

from qualify.checks.base import Check, Context, Outcome, fail_unless
from qualify.run.receipt import bare_hex, engine_code_digest_on_disk
from receipts.statement import config_digest


def run(ctx: Context) -> Outcome:
    t0 = time.monotonic()
    try:
        ctx.url = ctx.launcher.start(ctx.remaining())
    except TimeoutError as exc:
        return Outcome("error", {"logs": ctx.launcher.logs_tail(15)}, str(exc))
    except RuntimeError as exc:
        return Outcome(
            "fail",
            {"status": ctx.launcher.status().to_evidence(), "logs": ctx.launcher.logs_tail(15)},
            str(exc),
        )
    ready_s = time.monotonic() - t0
    health = ctx.client.health()
    d = ctx.client.describe()
    ctx.describe = d
    ours = config_digest(d.config)
    # The target is what the harness knows of the host and the launch (set before boot), never what the
    # engine says of itself: an engine on a GPU host that came up on the CPU must not qualify as a CPU target.
    device_target = "gpu" if d.device.type == "cuda" else "cpu"
    # A local engine runs the code installed beside the harness: its self-reported code digest, which
    # becomes the receipt's subject, must equal the digest the harness computes from the same files.
    disk_digest = engine_code_digest_on_disk() if ctx.launcher.kind == "local" else None
    evidence = {
        "url": ctx.url,
        "ready_seconds": round(ready_s, 3),
        "pid": health.pid,
        "engine": d.engine.model_dump(mode="json"),
        "device": d.device.model_dump(mode="json"),
        "driver": d.device.driver,
        "versions": d.versions.model_dump(mode="json"),
        "config_digest": {"engine": d.config_digest, "harness": ours},
        "target": {"expected": ctx.target, "engine_device": device_target},
        "code_digest": {"engine": d.engine.code_digest, "harness_on_disk": disk_digest},
        "cudagraph_mode": d.cudagraph_mode,
        "launcher": ctx.launcher.identity(),
    }
    return fail_unless(
        {
            "healthy": health.ready,
            # The receipt's subject is the digest of the config the engine reports; both sides must agree.
            "config_digest_matches": d.config_digest == ours,
            "preset_as_requested": d.config.get("preset") == ctx.request.preset,
            "num_spec_as_requested": d.capacity.num_spec == ctx.request.num_spec,
            "device_matches_target": device_target == ctx.target,
            "code_digest_matches_disk": disk_digest is None
            or bare_hex(d.engine.code_digest) == bare_hex(disk_digest),
        },
        evidence,
    )


CHECK = Check("boot", run, timeout_s=300.0)
