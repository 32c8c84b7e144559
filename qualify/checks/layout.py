"""layout: the registered spans equal --layout; chunk is their lcm, ratios chunk/span; the peer process
imported and verified every allocation."""

from __future__ import annotations

import math

from qualify.checks.base import Check, Context, Outcome, fail_unless


def run(ctx: Context) -> Outcome:
    d = ctx.client.describe()
    lay = d.layout
    want = ctx.request.layout
    lcm = math.lcm(*lay.spans) if lay.spans else 0
    peer = ctx.client.peer_verify()
    groups = [g.model_dump(mode="json") for g in peer.groups]
    flags = (
        "nbytes_ok",
        "alignment_ok",
        "device_ok",
        "pattern_ok",
        "ack_ok",
        "out_of_bounds_refused",
        "span_ok",
    )
    bad_groups = [g["name"] for g in groups if not all(g.get(f) for f in flags)]
    ctx.facts["layout"] = {
        "spans": lay.spans,
        "chunk": lay.chunk,
        "ratios": lay.ratios,
        "groups": [
            {"index": i, "kind": g.kind, "layers": g.layers, "span": g.span, "nbytes": g.nbytes}
            for i, g in enumerate(lay.groups)
        ],
        "peer_verified": peer.ok and not bad_groups and len(groups) == len(lay.groups),
    }
    evidence = {
        "requested": want,
        "registered": lay.spans,
        "chunk": lay.chunk,
        "ratios": lay.ratios,
        "groups": [g.model_dump(mode="json") for g in lay.groups],
        "peer": {
            "ok": peer.ok,
            "layout_seen": peer.layout_seen,
            "groups": groups,
            "error": peer.error,
            "seconds": peer.seconds,
        },
    }
    return fail_unless(
        {
            "spans_equal_request": want is None or lay.spans == want,
            "chunk_is_lcm": lay.chunk == lcm,
            "ratios_are_chunk_over_span": lay.ratios == [lay.chunk // s for s in lay.spans]
            and all(lay.chunk % s == 0 for s in lay.spans),
            "one_group_per_span": len(lay.groups) == len(lay.spans),
            "peer_ok": peer.ok,
            "peer_saw_registered_layout": peer.layout_seen == lay.spans,
            "peer_verified_every_group": not bad_groups and len(groups) == len(lay.groups),
        },
        evidence,
    )


CHECK = Check("layout", run, timeout_s=90.0)
