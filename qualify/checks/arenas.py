"""arenas: metadata buffers sized for the capture envelope; addresses recorded; an over-capacity batch is
refused with CapacityError (409) and no arena address moves."""

from __future__ import annotations

from qualify.checks.base import Check, Context, Outcome, fail_unless
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
            "arenas_present": bool(before.arenas),
            "capacities_positive": all(a.capacity > 0 for a in before.arenas.values()),
            "addresses_distinct": len(set(addrs_before.values())) == len(addrs_before),
            "envelope_fits_batched_tokens": not capture_sizes
            or max(capture_sizes) <= cap.max_num_batched_tokens,
            "live_slots_cover_max_num_seqs": cap.live_slots >= cap.max_num_seqs,
            "num_spec_in_envelope": cap.num_spec == ctx.request.num_spec,
            "over_capacity_refused_409": refusal.get("status") == 409,
            "refusal_is_capacity_error": refusal.get("type") == CAPACITY_ERROR,
            "no_address_moved": not moved,
            "refusal_counted": after.counters.capacity_refusals > before.counters.capacity_refusals,
            "fitting_batch_served": len(ok_resp.choices) == cap.max_num_seqs,
        },
        evidence,
    )


CHECK = Check("arenas", run, timeout_s=120.0)
