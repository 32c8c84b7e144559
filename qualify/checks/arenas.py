"""arenas: metadata buffers sized for the capture envelope; addresses recorded; an over-capacity batch is
refused with CapacityError (409) and no arena address moves."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, engine_says, fail_unless, observed
from qualify.client import EngineError
from qualify.protocol import CAPACITY_ERROR, CompletionRequest


def run(ctx: Context) -> Outcome:
    before = ctx.client.describe()
    cap = before.capacity
    addrs_before = {name: a.address for name, a in before.arenas.items()}
    capture_sizes = before.config.get("capture_sizes") or []
    # One request more than the engine can hold live: must be refused, never queued or reallocated.
    n = max(cap.live_slots, cap.max_num_seqs) + 1
    batch = [[7 + (i % 50), 11, 13] for i in range(n)]
    refusal: dict = {"batch_size": n}
    try:
        resp = ctx.client.complete(CompletionRequest(prompt=batch, max_tokens=2))
        refusal.update(status=200, refused=False, choices=len(resp.choices))
    except EngineError as exc:
        refusal.update(status=exc.status, type=exc.type, message=exc.message[:300], refused=True)
    after = ctx.client.describe()
    addrs_after = {name: a.address for name, a in after.arenas.items()}
    moved = sorted(
        k for k in addrs_before.keys() | addrs_after.keys() if addrs_before.get(k) != addrs_after.get(k)
    )
    # The engine still serves a batch that fits.
    ok_resp = ctx.client.complete(CompletionRequest(prompt=batch[: cap.max_num_seqs], max_tokens=2))
    evidence = {
        "capacity": cap.model_dump(mode="json"),
        "capture_sizes": capture_sizes,
        "arenas": {k: v.model_dump(mode="json") for k, v in before.arenas.items()},
        "over_capacity": refusal,
        "moved": moved,
        "capacity_refusals": {
            "before": before.counters.capacity_refusals,
            "after": after.counters.capacity_refusals,
        },
        "fitting_batch_served": len(ok_resp.choices),
    }
    return fail_unless(
        {
            "arenas_present": engine_says(bool(before.arenas), "describe lists no arenas"),
            "capacities_positive": engine_says(
                all(a.capacity > 0 for a in before.arenas.values()),
                f"capacities { ({k: a.capacity for k, a in before.arenas.items()}) }",
            ),
            "addresses_distinct": engine_says(
                len(set(addrs_before.values())) == len(addrs_before), f"addresses {addrs_before}"
            ),
            "num_spec_in_envelope": engine_says(
                cap.num_spec == ctx.request.num_spec, f"envelope num_spec {cap.num_spec}"
            ),
            # The harness sent the oversized batch and saw the answer itself.
            "over_capacity_refused_409": observed(
                refusal.get("status") == 409, f"{n} requests answered {refusal.get('status')}"
            ),
            "refusal_is_capacity_error": observed(
                refusal.get("type") == CAPACITY_ERROR, f"error type {refusal.get('type')}"
            ),
            "no_address_moved": engine_says(not moved, f"moved: {moved}" if moved else None),
            "refusal_counted": engine_says(
                after.counters.capacity_refusals > before.counters.capacity_refusals,
                f"capacity_refusals {before.counters.capacity_refusals} -> "
                f"{after.counters.capacity_refusals}",
            ),
            "fitting_batch_served": observed(
                len(ok_resp.choices) == cap.max_num_seqs,
                f"{len(ok_resp.choices)} of {cap.max_num_seqs} answered",
            ),
        },
        evidence,
    )


CHECK = Check("arenas", run, timeout_s=120.0)
