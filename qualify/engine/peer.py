"""The KV-transfer peer: a separate process that imports every group allocation from its handle and proves
it sees the same memory (`python -m qualify.engine.peer < handles.json`), and the engine-side driver.

Per group the peer checks byte size, alignment, device identity, a pattern and head checksum the engine
wrote, writes an acknowledgement the engine then checks, and tries a view outside the allocation (which
must be refused). It prints one JSON line: {ok, layout_seen, groups, error}.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .layout import (
    ALIGNMENT,
    PROBE_BYTES,
    LayoutError,
    allocation_extent,
    carve,
    group_span,
    import_allocation,
)

HEAD_BYTES = 1 << 20  # bytes at the start of an allocation both sides checksum (a chunk round trip)


def stream_bytes(nonce: str, label: str, n: int) -> bytes:
    """Deterministic bytes from (nonce, label): the pattern the engine writes and the ack the peer writes."""
    out, i = bytearray(), 0
    while len(out) < n:
        out += hashlib.sha256(f"{nonce}:{label}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def _host_identity() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().cpu().numpy())).hexdigest()


def _device_identity(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "uuid": str(torch.cuda.get_device_properties(device).uuid)}
    return {"type": "cpu", "host": _host_identity()}


# ---------------------------------------------------------------- peer side


def _out_of_bounds_refused(buf: torch.Tensor) -> bool:
    """Both our carve and torch itself must refuse a view that runs past the allocation's end."""
    n = buf.numel()
    try:
        carve(buf, n - ALIGNMENT, (2 * ALIGNMENT,), torch.uint8)
        return False
    except LayoutError:
        pass
    try:
        torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage(), 0, (n + 4096,))
        return False
    except RuntimeError:
        return True


def verify_group(g: dict, nonce: str, geometry: dict | None = None) -> dict:
    """geometry: {block_size, dcp_size}; the peer derives each group's span from it itself (layout_seen is
    what the peer computed, not an echo of the span the engine claims)."""
    buf, keep = import_allocation(g["handle"])
    half = PROBE_BYTES // 2
    p = g["probe_offset"]
    span = g["span"]
    if geometry is not None:
        span = group_span(g["kind"], geometry["block_size"], geometry["dcp_size"])
    res = {"name": g["name"], "span": span, "span_ok": span == g["span"]}
    # The extent is measured here (file size / mapped storage), not echoed from the handle.
    res["nbytes"] = allocation_extent(g["handle"], keep)
    res["nbytes_ok"] = res["nbytes"] == buf.numel() == g["nbytes"] == g["handle"]["nbytes"]
    res["alignment_ok"] = buf.data_ptr() % g["alignment"] == 0 and p % g["alignment"] == 0
    res["device_ok"] = _device_identity(buf.device) == g["device"]
    head = min(HEAD_BYTES, p)
    res["pattern_ok"] = bool(
        res["nbytes_ok"]
        and _sha(buf[p : p + half]) == g["pattern_sha256"]
        and _sha(buf[:head]) == g["head_sha256"]
    )
    ack = torch.frombuffer(bytearray(stream_bytes(nonce, "ack:" + g["name"], half)), dtype=torch.uint8)
    buf[p + half : p + PROBE_BYTES].copy_(ack.to(buf.device))
    if buf.device.type == "cuda":
        torch.cuda.synchronize(buf.device)
    else:
        for obj in keep:
            flush = getattr(obj, "flush", None)
            if flush is not None:
                flush()
    res["out_of_bounds_refused"] = _out_of_bounds_refused(buf)
    return res


def peer_main() -> int:
    payload = json.loads(sys.stdin.read())
    groups, error = [], None
    try:
        for g in payload["groups"]:
            groups.append(verify_group(g, payload["nonce"], payload["layout"]))
    except Exception as e:  # report what failed as data; the engine decides
        error = f"{type(e).__name__}: {e}"
    checks = ("nbytes_ok", "alignment_ok", "device_ok", "pattern_ok", "span_ok", "out_of_bounds_refused")
    ok = (
        error is None
        and len(groups) == len(payload["groups"])
        and all(all(g[c] for c in checks) for g in groups)
    )
    print(
        json.dumps({"ok": ok, "layout_seen": [g["span"] for g in groups], "groups": groups, "error": error})
    )
    return 0 if ok else 1


# ---------------------------------------------------------------- engine side


def verify_with_peer(engine, timeout: float = 300.0) -> dict:
    """Write patterns, run the peer process on the exported handles, check its acks, clear the probe pages."""
    t0 = time.perf_counter()
    nonce = os.urandom(16).hex()
    half = PROBE_BYTES // 2
    groups = []
    for a in engine.allocations:
        p = a.probe_offset
        pattern = torch.frombuffer(bytearray(stream_bytes(nonce, a.group.name, half)), dtype=torch.uint8)
        a.buffer[p : p + half].copy_(pattern.to(a.buffer.device))
        a.buffer[p + half : p + PROBE_BYTES].zero_()
        groups.append(
            {
                **a.record(),
                "probe_offset": p,
                "handle": a.handle,
                "device": _device_identity(a.buffer.device),
                "pattern_sha256": _sha(a.buffer[p : p + half]),
                "head_sha256": _sha(a.buffer[: min(HEAD_BYTES, p)]),
            }
        )
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    geometry = {"block_size": engine.cfg.block_size, "dcp_size": engine.cfg.dcp_size}
    payload = {"nonce": nonce, "layout": {"spans": engine.layout.spans, **geometry}, "groups": groups}
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result: dict = {"ok": False, "layout_seen": [], "groups": [], "error": None}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "qualify.engine.peer"],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if lines:
            result = json.loads(lines[-1])
        else:
            result["error"] = f"peer exited {proc.returncode} without a report: {proc.stderr.strip()[-400:]}"
    except subprocess.TimeoutExpired:
        result["error"] = f"peer did not answer within {timeout:.0f}s"
    by_name = {g["name"]: g for g in result.get("groups", [])}
    for a in engine.allocations:
        g = by_name.get(a.group.name)
        p = a.probe_offset
        if g is not None:
            want = stream_bytes(nonce, "ack:" + a.group.name, half)
            g["ack_ok"] = bytes(a.buffer[p + half : p + PROBE_BYTES].cpu().numpy().tobytes()) == want
        a.buffer[p : p + PROBE_BYTES].zero_()
    checks = (
        "nbytes_ok", "alignment_ok", "device_ok", "pattern_ok", "span_ok", "ack_ok", "out_of_bounds_refused",
    )  # fmt: skip
    groups_out = [{k: g.get(k, False) for k in ("name", *checks)} for g in result.get("groups", [])]
    ok = (
        result.get("error") is None
        and len(groups_out) == len(engine.allocations)
        and all(all(g[c] for c in checks) for g in groups_out)
        and result.get("layout_seen") == engine.layout.spans
    )
    return {
        "ok": ok,
        "layout_seen": result.get("layout_seen", []),
        "groups": groups_out,
        "seconds": time.perf_counter() - t0,
        "error": result.get("error"),
    }


if __name__ == "__main__":
    sys.exit(peer_main())
