"""backend: requested -> resolved backend and why; kernels of a profiled step belong to it; a bogus value
is refused by a second engine at construction (no silent fallback)."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, fail_unless
from qualify.run.request import KDA_BACKENDS

BOGUS_BACKEND = "bogus"
REFUSAL_TIMEOUT_S = 90.0
RESOLVED_CHOICES = ("b12x", "triton", "torch")

# Which profiled kernel names prove a backend ran: the engine tags its KDA kernels "kda::<backend>...".
BACKEND_MARKERS: dict[str, tuple[str, ...]] = {
    "torch": ("kda::torch",),
    "triton": ("kda::triton",),
    "b12x": ("kda::b12x",),
}


def kernels_belong(names: list[str], resolved: str) -> tuple[list[str], list[str]]:
    """(kernel names that prove `resolved` ran, names that prove another backend ran)."""
    ours = [n for n in names if any(m in n for m in BACKEND_MARKERS.get(resolved, ()))]
    theirs = [
        n
        for n in names
        for other, markers in BACKEND_MARKERS.items()
        if other != resolved and any(m in n for m in markers)
    ]
    return ours, theirs


def run(ctx: Context) -> Outcome:
    d = ctx.client.describe()
    b = d.backend
    probe = ctx.client.probe()
    ours, theirs = kernels_belong(probe.kernel_names, b.resolved)
    ctx.facts["backend"] = {
        "requested": b.requested,
        "resolved": b.resolved,
        "reason": b.reason,
        # The receipt keeps the KDA kernels (the proof); the check's evidence keeps every name.
        "kernel_names": sorted({n for n in probe.kernel_names if "kda" in n.lower()}),
    }
    refusal = ctx.launcher.run_refusal(BOGUS_BACKEND, min(REFUSAL_TIMEOUT_S, ctx.remaining()))
    out_lines = [ln for ln in refusal.output.strip().splitlines() if ln.strip()]
    last = out_lines[-1] if out_lines else ""
    names_choices = all(c in refusal.output for c in KDA_BACKENDS)
    evidence = {
        "requested": b.requested,
        "resolved": b.resolved,
        "reason": b.reason,
        "prefill_path": b.prefill_path,
        "probe": {
            "backend": probe.backend,
            "device_type": probe.device_type,
            "kernel_names": sorted(set(probe.kernel_names)),
            "proving": sorted(set(ours)),
            "foreign": sorted(set(theirs)),
        },
        "bogus_refusal": {
            "value": BOGUS_BACKEND,
            "command": refusal.command,
            "exit_code": refusal.exit_code,
            "seconds": round(refusal.seconds, 3),
            "error_line": last[-400:],
        },
    }
    return fail_unless(
        {
            "requested_as_asked": b.requested == ctx.request.kda_backend,
            "resolved_is_a_backend": b.resolved in RESOLVED_CHOICES,
            "explicit_request_honoured": ctx.request.kda_backend == "auto"
            or b.resolved == ctx.request.kda_backend,
            "probe_reports_resolved": probe.backend == b.resolved,
            "kernels_of_resolved_backend_ran": bool(ours),
            "no_kernels_of_other_backends": not theirs,
            "bogus_backend_refused": refusal.exit_code not in (None, 0),
            "refusal_names_the_choices": names_choices and BOGUS_BACKEND in refusal.output,
        },
        evidence,
    )


CHECK = Check("backend", run, timeout_s=150.0)
