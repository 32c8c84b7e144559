"""backend: requested -> resolved backend and why; kernels of a profiled step belong to it; a bogus value
is refused by a second engine at construction (no silent fallback)."""

from __future__ import annotations

import os

from qualify.checks.base import Check, Context, Outcome, engine_says, fail_unless, observed
from qualify.launch.base import READY_RE
from qualify.run.request import KDA_BACKENDS

BOGUS_BACKEND = "bogus"
REFUSAL_TIMEOUT_S = 90.0
RESOLVED_CHOICES = ("b12x", "triton", "torch")
LABEL_PREFIX = "kda::"

# Device kernels that only one backend launches, as the CUDA profiler names them (exact names). Verified on
# an H200 (tests/engine/test_gpu_graphs.py): the Triton decode kernel. torch launches ATen kernels that any
# backend's surrounding model also launches, and b12x's CuTe kernel names are not pinned, so those two have
# no signature of their own: on CUDA they are proven by their label and by the absence of the others'.
DEVICE_SIGNATURES: dict[str, tuple[str, ...]] = {
    "triton": ("_kda_decode_kernel",),
    "torch": (),
    "b12x": (),
}


def label_backend(name: str) -> str | None:
    """`kda::triton` or `kda::triton::prefill` -> "triton"; anything else -> None (no substring matches)."""
    if not name.startswith(LABEL_PREFIX):
        return None
    return name[len(LABEL_PREFIX) :].split("::", 1)[0] or None


def kernels_belong(names: list[str], resolved: str, device_type: str) -> dict[str, list[str]]:
    """Which profiled names prove `resolved` ran, which prove another backend ran, and, on CUDA, which device
    kernels of `resolved` were seen (empty where the backend has no known signature)."""
    labels = {n: label_backend(n) for n in names}
    ours = sorted({n for n, b in labels.items() if b == resolved})
    foreign = {n for n, b in labels.items() if b is not None and b != resolved}
    device: list[str] = []
    if device_type == "cuda":
        device = sorted({n for n in names if n in DEVICE_SIGNATURES.get(resolved, ())})
        for other, sigs in DEVICE_SIGNATURES.items():
            if other != resolved:
                foreign |= {n for n in names if n in sigs}
    return {"labels": ours, "device": device, "foreign": sorted(foreign)}


def runs_on_cpu(resolved: str, requested: str, env: dict[str, str] | None) -> tuple[bool, str]:
    """Whether a backend can run on a CPU: torch always; triton only when asked for by name and run by
    Triton's interpreter, which the harness's own launch environment must have switched on (an engine
    asked for `auto` never resolves to triton there); b12x (CuTe kernels) never."""
    if resolved == "torch":
        return True, "torch runs on a CPU"
    interpreting = (env or {}).get("TRITON_INTERPRET") == "1"
    if resolved == "triton" and requested == "triton" and interpreting:
        return True, "triton asked for by name, under TRITON_INTERPRET=1 set by the harness's launch"
    why = "no TRITON_INTERPRET=1 in the launch environment" if resolved == "triton" else "it needs CUDA"
    return False, f"resolved {resolved!r} (requested {requested!r}) cannot run on a cpu target: {why}"


def run(ctx: Context) -> Outcome:
    d = ctx.client.describe()
    b = d.backend
    # The first profiled step may compile Triton kernels (prefill and decode): give it the check's budget.
    probe = ctx.client.probe(timeout_s=ctx.remaining())
    proof = kernels_belong(probe.kernel_names, b.resolved, probe.device_type)
    needs_device_kernel = probe.device_type == "cuda" and bool(DEVICE_SIGNATURES.get(b.resolved))
    ctx.facts["backend"] = {
        "requested": b.requested,
        "resolved": b.resolved,
        "reason": b.reason,
        # The receipt keeps the KDA kernels (the proof); the check's evidence keeps every name.
        "kernel_names": sorted({*proof["labels"], *proof["device"], *proof["foreign"]}),
    }
    refusal = ctx.launcher.run_refusal(BOGUS_BACKEND, min(REFUSAL_TIMEOUT_S, ctx.remaining()))
    out_lines = [ln for ln in refusal.output.strip().splitlines() if ln.strip()]
    last = out_lines[-1] if out_lines else ""
    evidence = {
        "requested": b.requested,
        "resolved": b.resolved,
        "reason": b.reason,
        "prefill_path": b.prefill_path,
        "glue": b.glue,
        "probe": {
            "backend": probe.backend,
            "device_type": probe.device_type,
            "kernel_names": sorted(set(probe.kernel_names)),
            "proving_labels": proof["labels"],
            "proving_device_kernels": proof["device"],
            "device_signature": list(DEVICE_SIGNATURES.get(b.resolved, ())),
            "foreign": proof["foreign"],
        },
        "bogus_refusal": {
            "value": BOGUS_BACKEND,
            "command": refusal.command,
            "exit_code": refusal.exit_code,
            "seconds": round(refusal.seconds, 3),
            "error_line": last[-400:],
        },
    }
    conditions = {
        "requested_as_asked": engine_says(
            b.requested == ctx.request.kda_backend, f"engine says requested {b.requested!r}"
        ),
        "resolved_is_a_backend": engine_says(b.resolved in RESOLVED_CHOICES, f"resolved {b.resolved!r}"),
        "explicit_request_honoured": engine_says(
            ctx.request.kda_backend == "auto" or b.resolved == ctx.request.kda_backend,
            f"requested {ctx.request.kda_backend!r}, resolved {b.resolved!r}",
        ),
        "probe_ran_on_the_engine_device": engine_says(
            probe.device_type == d.device.type, f"probe on {probe.device_type}, engine on {d.device.type}"
        ),
        # The profiler runs inside the engine: kernel names are the engine's report.
        "kernels_of_resolved_backend_ran": engine_says(
            bool(proof["labels"]), f"labels of {b.resolved}: {proof['labels'] or 'none'}"
        ),
        "no_kernels_of_other_backends": engine_says(not proof["foreign"], f"foreign: {proof['foreign']}"),
        # The refusal probe is a process the harness launched itself, with a bogus value.
        "bogus_backend_refused": observed(
            refusal.exit_code not in (None, 0), f"probe exit code {refusal.exit_code}"
        ),
        # Refused at construction: it never became ready, and said why in its last line, not a traceback.
        "refused_before_ready": observed(READY_RE.search(refusal.output) is None),
        "refusal_is_one_clear_line": observed(
            BOGUS_BACKEND in last
            and all(c in last for c in KDA_BACKENDS)
            and "Traceback" not in refusal.output,
            last[-200:] or "no output",
        ),
    }
    if ctx.target == "cpu":
        # The target is the harness's (decided before boot), the launch environment too; the resolved name is
        # the engine's: a backend that cannot run on a CPU means the engine's account is false.
        env = getattr(ctx.launcher, "env", None) or dict(os.environ)  # what the harness launched it with
        ok, why = runs_on_cpu(b.resolved, ctx.request.kda_backend, env)
        conditions["resolved_backend_runs_on_a_cpu"] = engine_says(ok, why)
    if needs_device_kernel:
        conditions["device_kernels_of_resolved_backend_ran"] = engine_says(
            bool(proof["device"]), f"device kernels seen: {proof['device'] or 'none'}"
        )
    return fail_unless(conditions, evidence)


CHECK = Check("backend", run, timeout_s=150.0)
