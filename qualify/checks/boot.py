"""boot: the engine becomes healthy within the timeout; versions, device, driver and identity recorded."""

from __future__ import annotations

import time

from qualify.checks.base import Check, Context, Outcome, derived, engine_says, fail_unless, observed
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
    conditions = {
        # The launcher saw the engine come up (its ready line and /health) within the boot budget.
        "ready_within_timeout": observed(True, f"ready after {ready_s:.1f} s"),
        "preset_as_requested": engine_says(
            d.config.get("preset") == ctx.request.preset,
            f"engine config preset {d.config.get('preset')!r}, requested {ctx.request.preset!r}",
        ),
        "num_spec_as_requested": engine_says(
            d.capacity.num_spec == ctx.request.num_spec,
            f"engine num_spec {d.capacity.num_spec}, requested {ctx.request.num_spec}",
        ),
        "device_matches_target": engine_says(
            device_target == ctx.target, f"engine device {device_target}, target {ctx.target}"
        ),
    }
    if disk_digest is not None:
        # The harness hashed the code it launched; the engine's claim about itself must agree with it.
        conditions["code_digest_matches_disk"] = derived(
            bare_hex(d.engine.code_digest) == bare_hex(disk_digest),
            f"engine says {d.engine.code_digest}, disk has {disk_digest}",
        )
    return fail_unless(conditions, evidence)


CHECK = Check("boot", run, timeout_s=300.0)
