"""layout: the registered spans equal --layout; chunk is their lcm, ratios chunk/span; the peer process
imported and verified every allocation."""

from __future__ import annotations

import math

from qualify.checks.base import Check, Context, Outcome, derived, engine_says, fail_unless


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
    # Until the harness launches the peer itself, everything here reaches the harness through the engine:
    # the engine spawns the peer and relays its answer.
    conditions = {
        "chunk_is_lcm": derived(lay.chunk == lcm, f"chunk {lay.chunk}, lcm {lcm}"),
        "ratios_are_chunk_over_span": derived(
            lay.ratios == [lay.chunk // s for s in lay.spans] and all(lay.chunk % s == 0 for s in lay.spans),
            f"ratios {lay.ratios}",
        ),
        "one_group_per_span": engine_says(len(lay.groups) == len(lay.spans)),
        "peer_ok": engine_says(peer.ok, peer.error),
        "peer_saw_registered_layout": engine_says(
            peer.layout_seen == lay.spans, f"peer saw {peer.layout_seen}"
        ),
        "peer_verified_every_group": engine_says(
            not bad_groups and len(groups) == len(lay.groups),
            f"bad groups: {bad_groups}" if bad_groups else None,
        ),
    }
    if want is not None:
        conditions["spans_equal_request"] = engine_says(
            lay.spans == want, f"registered {lay.spans} != requested {want}" if lay.spans != want else None
        )
    else:
        evidence["demanded"] = "nothing: no --layout was given; the registered layout is recorded only"
    return fail_unless(conditions, evidence)


CHECK = Check("layout", run, timeout_s=90.0)
