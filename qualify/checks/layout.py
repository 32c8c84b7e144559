"""layout: the harness's own peer process imports every KV allocation the engine exports, derives each
group's span and byte layout from the geometry the harness asked for, measures the allocations, and
proves with nonce patterns (engine writes, peer reads; peer writes, engine echoes) that both sides share
the same memory. Then the intervention (qualify/checks/intervene.py): between decode steps of live sequences
the peer swaps the memory the geometry assigns to chosen sequences and the harness watches exactly those
outputs move, and come back when the bytes are swapped back. The engine's registered layout and exported
view table are compared with the geometry (the engine's word); --layout with the geometry, resting on the
intervention."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import secrets
import tempfile
from pathlib import Path
from typing import Any

from qualify.checks.base import Check, Context, Outcome, engine_says, fail_unless, observed
from qualify.checks.intervene import all_hold, intervene, peer_seconds
from qualify.client import EngineError
from qualify.protocol import KV_PROBE_BYTES, KvEchoRequest, KvFillRequest, KvHandle, pattern_bytes
from qualify.run.geometry import geometry_for
from qualify.run.launch import peer_geometry

PEER_TIMEOUT_S = 90.0  # the peer imports torch (and initialises CUDA) before it maps anything


def _sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _bad(groups: list[dict[str, Any]], ok: Any) -> list[str]:
    """Per group, a word on what is wrong (empty when `ok(group)` holds for every group)."""
    out = []
    for g in groups:
        why = ok(g)
        if why:
            out.append(f"{g.get('name')}: {why}")
    return out


def _each(groups: list[dict[str, Any]], ran: bool, why: Any, ok: str) -> Any:
    """Observed: the peer ran and `why(group)` finds nothing wrong in any group; else what it found."""
    bad = _bad(groups, why) if ran else ["the peer gave no report"]
    return observed(not bad, "; ".join(bad)[:400] if bad else ok)


def _flag(groups: list[dict[str, Any]], ran: bool, key: str, ok: str) -> Any:
    """Observed: the peer ran and every group reports `key` true; else the groups that do not."""
    bad = [g.get("name") for g in groups if not g.get(key)]
    if not ran:
        return observed(False, "the peer gave no report")
    return observed(not bad, f"not in {bad}" if bad else ok)


def _as_engine(c: Any) -> Any:
    """The same finding, labelled as resting on the engine's word."""
    return engine_says(c.holds, c.detail)


def _peer(
    ctx: Context, geometry: dict[str, Any], rank: int, handles: list[KvHandle], single: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fill each probe page of one DCP rank through the engine, run the harness's peer on that rank's
    exported handles, and return (its report or {}, what the harness saw: nonces, fills, the peer's exit)."""
    read_nonce, write_nonce = secrets.token_hex(16), secrets.token_hex(16)
    half = KV_PROBE_BYTES // 2
    fills = {}
    for h in handles:
        try:
            fill = ctx.client.kv_fill(
                KvFillRequest(
                    group=h.name,
                    offset=h.probe.offset,
                    length=half,
                    nonce=f"{read_nonce}:{h.name}",
                    rank=rank,
                )
            )
            fills[h.name] = fill.sha256
        except EngineError as exc:  # a handle the engine will not fill is a finding about that handle
            fills[h.name] = f"refused: {exc.status} {exc.type}"
    spec = {
        "geometry": geometry,
        "handles": {"groups": [h.model_dump(mode="json") for h in handles]},
        "read_nonce": read_nonce,
        "write_nonce": write_nonce,
    }
    # The spec, the peer's log and its report stay in the run directory beside the engine's log.
    run_dir = getattr(ctx.launcher, "run_dir", None)
    with contextlib.ExitStack() as stack:
        where = Path(run_dir) if run_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        where.mkdir(parents=True, exist_ok=True)
        path = where / ("peer-spec.json" if single else f"peer-spec-rank{rank}.json")
        path.write_text(json.dumps(spec))
        out = ctx.launcher.run_peer(path, min(PEER_TIMEOUT_S, max(1.0, ctx.remaining())))
    seen = {
        "write_nonce": write_nonce,
        "engine_fills": fills,
        "exit_code": out.exit_code,
        "seconds": round(out.seconds, 3),
        "peer_seconds": peer_seconds(out.report or {}),
        "error": out.error,
        "output": out.output[-400:] or None,
    }
    return out.report or {}, seen


def _why_not(seen: dict[str, Any]) -> str:
    """Why a peer run gave no usable report: the launcher's error, the peer's, or its exit code."""
    return str(seen.get("error") or seen.get("report_error") or f"exit {seen.get('exit_code')}")


def _echoes(
    ctx: Context, groups: list[dict[str, Any]], write_nonce: str, rank: int
) -> dict[str, dict[str, Any]]:
    """Per group: the engine's hash of the bytes the peer wrote and of the region the peer sampled, beside
    what the harness expects (its own hash of the pattern it told the peer to write)."""
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        name, wrote, sample = g.get("name"), g.get("written"), g.get("sample")
        if not (isinstance(wrote, dict) and isinstance(sample, dict)):
            continue
        want = _sha(pattern_bytes(f"{write_nonce}:{name}", int(wrote["length"])))
        echo = ctx.client.kv_echo(
            KvEchoRequest(group=name, offset=wrote["offset"], length=wrote["length"], rank=rank)
        )
        back = ctx.client.kv_echo(
            KvEchoRequest(group=name, offset=sample["offset"], length=sample["length"], rank=rank)
        )
        out[name] = {
            "written": {"harness": want, "peer": wrote.get("sha256"), "engine": echo.sha256},
            "sample": {"peer": sample.get("sha256"), "engine": back.sha256},
        }
    return out


def _oob_echo_refused(ctx: Context, group: str, nbytes: int) -> tuple[bool, str]:
    try:
        r = ctx.client.kv_echo(KvEchoRequest(group=group, offset=max(0, nbytes - 16), length=64))
        return False, f"the engine hashed 64 bytes at {r.offset} of a {nbytes}-byte allocation"
    except EngineError as exc:
        return exc.status == 400, f"{exc.status} {exc.type}"


PEERS_AHEAD = 3  # the layout check's peer and the intervention's two swaps (one rank)


def prefetch(ctx: Context, boot_s: float) -> None:
    """On a GPU target, start this check's peers once the engine's first process exists, beside the rest
    of its boot (each imports torch, most of a peer's start: on an H100 host, 2026-12-05, a peer started
    after boot was still importing when the check began, 4.2 s for 0.2 of work; started once the engine
    answered, the first peer still took 1.7 s for 0.3 of work); each then waits for its spec
    (launch/local.py). Called again once the engine answers and after boot, it tops up the peers that died
    waiting."""
    start = getattr(ctx.launcher, "prepare_peers", None)
    if ctx.target == "gpu" and start is not None:
        start(PEERS_AHEAD)


def run(ctx: Context) -> Outcome:
    prefetch(ctx, 0.0)  # the ones not started yet (a --fail-fast run starts none ahead)
    d = ctx.client.describe()
    lay = d.layout
    want = ctx.request.layout
    doc = ctx.facts.get("launch_document")  # the peer expects what the harness sent, nothing else
    geometry = (
        peer_geometry(doc)
        if doc is not None
        else geometry_for(ctx.request).for_peer(ctx.request.num_spec, ctx.target)
    )
    handles = ctx.client.kv_handles()
    # Distributed DCP: every rank registers its own allocations, and the peer verifies each rank's.
    rank_sets = [(r.rank, r.groups) for r in handles.ranks] or [(0, handles.groups)]
    single = len(rank_sets) == 1
    groups: list[dict[str, Any]] = []
    echoes: dict[str, dict[str, Any]] = {}
    rank_spans: dict[int, list[int]] = {}
    seen: dict[str, Any] = {}
    ran = bool(rank_sets)
    for rank, rank_handles in rank_sets:
        report, seen_r = _peer(ctx, geometry, rank, rank_handles, single)
        found = [g for g in report.get("groups", []) if isinstance(g, dict)]
        label = (lambda n: n) if single else (lambda n, r=rank: f"rank{r}/{n}")
        for name, e in _echoes(ctx, found, seen_r["write_nonce"], rank).items():
            echoes[label(name)] = e
        groups += [{**g, "name": label(g.get("name"))} for g in found]
        rank_spans[rank] = report.get("spans") or []
        seen[str(rank)] = {
            **seen_r,
            "unexpected": report.get("unexpected"),
            "report_error": report.get("error"),
        }
        ran = ran and bool(report) and report.get("error") is None and bool(found)
    spans = rank_spans.get(0) or []
    first = next(iter(seen.values()), {"error": "no allocations exported", "exit_code": None})
    unexpected = [u for s in seen.values() for u in (s.get("unexpected") or [])]
    oob_ok, oob_detail = (False, "no group to try")
    if lay.groups:
        oob_ok, oob_detail = _oob_echo_refused(ctx, lay.groups[0].name, lay.groups[0].nbytes)

    def size(g: dict[str, Any]) -> str | None:
        if g.get("size_ok"):
            return None
        return (
            f"measured {g.get('nbytes_measured')} bytes, handle says {g.get('nbytes_handle')}, "
            f"the geometry needs {g.get('nbytes_expected')}"
        )

    def views(g: dict[str, Any]) -> str | None:
        if not g.get("found"):
            return g.get("error") or "not found"
        if not g.get("layers_match"):
            return "kind or layers differ from the layer pattern"
        if g.get("views_differ"):
            return str(g["views_differ"])
        return None if g.get("probe_match") else "probe page not where the geometry puts it"

    def echo(g: dict[str, Any]) -> str | None:
        e = echoes.get(g.get("name"))
        if e is None:
            return g.get("error") or "no pattern written"
        w, s = e["written"], e["sample"]
        if not w["harness"] == w["peer"] == w["engine"]:
            return f"peer wrote {w['peer']}, engine read {w['engine']}, harness expects {w['harness']}"
        return None if s["peer"] == s["engine"] else f"sampled region: peer {s['peer']}, engine {s['engine']}"

    laid_out = ran and not _bad(groups, views) and not _bad(groups, size)
    registered = lay.spans
    if single:
        sizes = {g.name: g.nbytes for g in lay.groups}
    else:
        sizes = {f"rank{r.rank}/{g.name}": g.nbytes for r in d.dcp_ranks for g in r.groups}
    measured = {g.get("name"): g.get("nbytes_measured") for g in groups}
    expected = {g.get("name"): g.get("nbytes_expected") for g in groups}

    def sizes_agree() -> bool:
        """The engine registered the size the geometry needs, and the peer found at least that much: a
        shared-memory file measures exactly its size, a CUDA allocation's driver extent is rounded up to
        the allocator's granularity."""
        return sizes.keys() == measured.keys() and all(
            sizes[k] == expected[k] and isinstance(measured[k], int) and measured[k] >= sizes[k]
            for k in sizes
        )

    lcm = math.lcm(*spans) if spans else 0
    missing = [g.get("name") for g in groups if not g.get("found")]
    conditions = {
        # What the harness's own peer process saw (observed).
        "peer_ran": observed(
            ran,
            f"exit {first.get('exit_code')}" + ("" if single else f" on each of {len(seen)} ranks")
            if ran
            else "; ".join(f"rank {r}: {_why_not(s)}" for r, s in seen.items()) or "no allocations exported",
        ),
        "peer_found_every_group": observed(
            ran and not missing and not unexpected,
            f"missing {missing}, unexpected {unexpected}"
            if missing or unexpected
            else f"{len(groups)} groups, as the layer pattern gives",
        ),
        "peer_allocation_sizes": _each(groups, ran, size, "every allocation as large as the geometry needs"),
        # The engine's exported view table against the geometry: its own account of where the caches are
        # (the intervention below is what shows they are there).
        "exported_views_match_geometry": _as_engine(
            _each(groups, ran, views, "every exported view where the geometry puts it")
        ),
        "peer_device": _flag(groups, ran, "device_ok", "every allocation on the device it was exported from"),
        "peer_read_engine_pattern": _flag(
            groups, ran, "engine_pattern_ok", "the pattern the engine wrote, in every allocation"
        ),
        "peer_echo_round_trip": _each(
            groups, ran, echo, "the engine read back what the peer wrote and sampled"
        ),
        "echo_refuses_out_of_bounds": observed(oob_ok, oob_detail),
        # The engine's registration against the peer's derivation: the engine's numbers.
        "registered_spans_match_peer": engine_says(
            ran and registered == spans, f"engine registered {registered}, peer derived {spans}"
        ),
        "registered_sizes_match_peer": engine_says(
            ran and sizes_agree(),
            f"engine registered {sizes}, the geometry needs {expected}, peer measured {measured}",
        ),
        "chunk_is_lcm": engine_says(
            lay.chunk == lcm, f"engine chunk {lay.chunk}, lcm of the peer's spans {lcm}"
        ),
        "ratios_are_chunk_over_span": engine_says(
            bool(spans) and lay.ratios == [lay.chunk // s for s in spans] and lay.chunk % lcm == 0,
            f"engine ratios {lay.ratios}",
        ),
        "one_group_per_span": engine_says(len(lay.groups) == len(lay.spans)),
    }
    evidence: dict[str, Any] = {
        "requested": want,
        "registered": registered,
        "chunk": lay.chunk,
        "ratios": lay.ratios,
        "groups": [g.model_dump(mode="json") for g in lay.groups],
        "geometry": geometry,
        "peer": {
            **(first if single else {"ranks": seen}),
            "spans": spans,
            "groups": groups,
            "unexpected": unexpected,
        },
        "echoes": echoes,
    }
    # The intervention: the memory the geometry assigns each live sequence is the memory it computes with.
    moved, evidence["intervention"] = intervene(ctx, geometry, rank_sets)
    conditions.update(moved)
    proven = all_hold(moved)
    if want is not None:
        # The geometry's spans equal the request (the harness's own numbers), and they count as observed
        # because the intervention at the places that geometry predicts moved the sequences it predicts.
        if spans != want:
            why = f"the asked-for geometry gives spans {spans}, requested {want}"
        elif not proven:
            why = "the intervention did not show the engine computing with memory laid out for these spans"
        elif not laid_out:
            why = "the allocations are not laid out for the geometry the peer derived from"
        else:
            why = f"spans {spans}: the intervention at the places they predict moved the predicted outputs"
        conditions["spans_equal_request"] = observed(spans == want and laid_out and proven, why)
    else:
        evidence["demanded"] = "nothing: no --layout was given; the registered layout is recorded only"
    peer_ok = all(c.holds for k, c in conditions.items() if k.startswith("peer_"))
    ctx.facts["layout"] = {
        "spans": registered,
        "chunk": lay.chunk,
        "ratios": lay.ratios,
        "groups": [
            {"index": i, "kind": g.kind, "layers": g.layers, "span": g.span, "nbytes": g.nbytes}
            for i, g in enumerate(lay.groups)
        ],
        "peer_verified": peer_ok and proven and conditions["registered_spans_match_peer"].holds,
    }
    return fail_unless(conditions, evidence)


CHECK = Check("layout", run, timeout_s=150.0, prepare=prefetch, prepare_at_ready=True, prepare_at_spawn=True)
