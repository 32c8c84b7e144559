"""The KV-transfer peer the harness launches (`python -m qualify.engine.peer --spec SPEC [--out REPORT]`):
it imports every group allocation from the engine's exported handles and reports what it found.

Self-contained (numpy and the standard library; torch only for CUDA-IPC handles, imported when one is
met, so a CPU run's peer starts in a fraction of a second) so that the harness can run this very file
inside an engine container. Nothing the engine says about spans is read: the peer derives each group, its
span and its exact byte layout from the geometry the harness asked for, measures each allocation, checks
the pattern the engine wrote, writes its own, samples a region for the engine to echo, and confirms that a
view past the allocation's end is refused. The report is one JSON object (docs/PEER.md).

With `"mode": "swap"` in the spec it is the harness's hand in the intervention instead: between two decode
steps it exchanges, in every rank's allocations, the bytes the geometry assigns two live sequences (their
state slots and the K/V rows of their positions, located from their block ids) and reports what it swapped;
the same swap applied again restores the bytes. Both work on shm files and CUDA-IPC storages alike.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import math
import os
import sys
import time

import numpy as np

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
SAMPLE_BYTES = 1 << 16  # bytes of the cache region the peer hashes for the engine to echo


def pattern_bytes(nonce: str, n: int) -> bytes:
    """The protocol's nonce pattern (qualify.protocol.pattern_bytes), restated so this file stands alone."""
    out, i = bytearray(), 0
    while len(out) < n:
        out += hashlib.sha256(f"{nonce}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def _sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------- the peer's own reading of the geometry


def span_of(kind: str, g: dict) -> int:
    """Tokens one block of a group covers. KDA: block_size. Attention: block_size * dcp_size, since each of
    the dcp_size shards holds an interleaved block_size of every attention block."""
    return g["block_size"] if kind == "kda" else g["block_size"] * g["dcp_size"]


def derive_groups(g: dict) -> list[dict]:
    """Layers of one kind grouped in layer order, group_size at a time; KDA groups first, then attention."""
    out = []
    for kind, letter in (("kda", "K"), ("attention", "A")):
        layers = [i for i, c in enumerate(g["layer_pattern"]) if c == letter]
        for j in range(0, len(layers), g["group_size"]):
            name = f"{kind}{j // g['group_size']}"
            out.append({"name": name, "kind": kind, "layers": layers[j : j + g["group_size"]]})
    return out


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def expected_views(kind: str, layers: list[int], g: dict) -> tuple[list[dict], int, int]:
    """(views, probe offset, total bytes) of one group's allocation as the geometry lays it out.

    KDA layer: fp32 state [slots, H, V, K] (V = K) and conv [slots, 3*H*K, width-1]; attention layer: K and V
    [blocks, shards, block_size, kv_heads, head_dim], blocks = 1 + max_num_seqs * ceil(len / span), shards
    = dcp_size folded, 1 on each rank of a distributed DCP (dcp_ranks = dcp_size)."""
    slots = 1 + g["max_num_seqs"] * (1 + g["num_spec"])
    blocks = 1 + g["max_num_seqs"] * -(-g["max_model_len"] // span_of("attention", g))
    views, offset = [], 0
    for layer in layers:
        if kind == "kda":
            h, k = g["kda_heads"], g["kda_head_dim"]
            parts = [
                ("state", [slots, h, k, k], "float32"),  # [slots, H, V, K] with V = K
                ("conv", [slots, 3 * h * k, g["conv_width"] - 1], g["dtype"]),
            ]
        else:
            shards = g["dcp_size"] if g.get("dcp_ranks", 1) == 1 else 1  # a DCP rank stores one shard
            kv = [blocks, shards, g["block_size"], g["attn_kv_heads"], g["attn_head_dim"]]
            parts = [("k", kv, g["dtype"]), ("v", kv, g["dtype"])]
        for name, shape, dtype in parts:
            views.append({"layer": layer, "name": name, "offset": offset, "shape": shape, "dtype": dtype})
            offset = _align(offset + math.prod(shape) * ITEMSIZE[dtype], g["alignment"])
    return views, offset, _align(offset + g["probe_bytes"], g["alignment"])


def views_differ(exported: list[dict], expected: list[dict]) -> str | None:
    """The first difference between the engine's exported views and the geometry's, in words."""
    have = {(v["layer"], v["name"]): v for v in exported}
    for v in expected:
        got = have.pop((v["layer"], v["name"]), None)
        if got is None:
            return f"layer {v['layer']} {v['name']} not exported"
        for key in ("offset", "shape", "dtype"):
            if got.get(key) != v[key]:
                return f"layer {v['layer']} {v['name']} {key} {got.get(key)} != {v[key]}"
    if have:
        return f"unexpected views {sorted(have)}"
    return None


# ---------------------------------------------------------------- importing an allocation


def _cuda_extent(ptr: int) -> int | None:
    """Bytes from `ptr` to the end of the device allocation holding it (cuMemGetAddressRange)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        fn = cuda.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            return None
        return base.value + size.value - ptr
    except (OSError, AttributeError):
        return None


class Buffer:
    """One imported allocation as bytes: read, write and exchange ranges, and the facts the report needs."""

    on_cuda = False
    device: dict = {"type": "cpu"}

    def __len__(self) -> int:
        raise NotImplementedError

    def address(self) -> int:
        raise NotImplementedError

    def read(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def write(self, offset: int, raw: bytes) -> None:
        raise NotImplementedError

    def swap(self, a: int, b: int, n: int) -> tuple[bytes, bytes, bytes]:
        """Exchange [a, a+n) and [b, b+n): (a's bytes before, b's bytes before, a's bytes after)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every write visible to the engine."""

    def out_of_bounds_refused(self) -> bool:
        """A view one page past the allocation's end must be refused."""
        raise NotImplementedError


class ShmBuffer(Buffer):
    """A shm file mapped whole, at the size the file itself has (whatever the handle claims)."""

    def __init__(self, path: str) -> None:
        size = os.stat(path).st_size
        self.mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))

    def __len__(self) -> int:
        return int(self.mm.shape[0])

    def address(self) -> int:
        return int(self.mm.ctypes.data)

    def read(self, offset: int, n: int) -> bytes:
        return self.mm[offset : offset + n].tobytes()

    def write(self, offset: int, raw: bytes) -> None:
        self.mm[offset : offset + len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def swap(self, a: int, b: int, n: int) -> tuple[bytes, bytes, bytes]:
        ta, tb = self.mm[a : a + n].copy(), self.mm[b : b + n].copy()
        self.mm[a : a + n] = tb
        self.mm[b : b + n] = ta
        return ta.tobytes(), tb.tobytes(), self.mm[a : a + n].tobytes()

    def sync(self) -> None:
        self.mm.flush()

    def out_of_bounds_refused(self) -> bool:
        try:
            np.ndarray((len(self) + 4096,), dtype=np.uint8, buffer=self.mm)
            return False
        except (TypeError, ValueError):
            return True


class CudaBuffer(Buffer):
    """A CUDA-IPC storage opened from the handle; the driver says how far its allocation really extends."""

    on_cuda = True

    def __init__(self, handle: dict) -> None:
        import torch  # only here: a CPU run's peer never pays torch's import

        self.torch = torch
        t0 = time.perf_counter()
        if not torch.cuda.is_initialized():
            torch.cuda._lazy_init()
            SECONDS["cuda_init"] = round(time.perf_counter() - t0, 4)
        t1 = time.perf_counter()
        dev, ev = handle["device_index"], handle["event_handle"]
        self.storage = torch.UntypedStorage._new_shared_cuda(
            dev,
            bytes.fromhex(handle["handle"]),
            handle["storage_size_bytes"],
            handle["storage_offset_bytes"],
            bytes.fromhex(handle["ref_counter_handle"]),
            handle["ref_counter_offset"],
            bytes.fromhex(ev) if ev else b"",
            handle["event_sync_required"],
        )
        self.t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(
            self.storage, 0, (handle["nbytes"],)
        )
        uuid = str(getattr(torch.cuda.get_device_properties(self.t.device), "uuid", ""))
        self.device = {"type": "cuda", "uuid": uuid}
        SECONDS["opens"] = round(SECONDS.get("opens", 0.0) + time.perf_counter() - t1, 4)

    def __len__(self) -> int:
        return int(self.t.numel())

    def address(self) -> int:
        return int(self.t.data_ptr())

    def read(self, offset: int, n: int) -> bytes:
        return self.t[offset : offset + n].cpu().numpy().tobytes()

    def write(self, offset: int, raw: bytes) -> None:
        src = self.torch.frombuffer(bytearray(raw), dtype=self.torch.uint8).to(self.t.device)
        self.t[offset : offset + len(raw)].copy_(src)

    def swap(self, a: int, b: int, n: int) -> tuple[bytes, bytes, bytes]:
        ta, tb = self.t[a : a + n].clone(), self.t[b : b + n].clone()
        self.t[a : a + n].copy_(tb)
        self.t[b : b + n].copy_(ta)
        return (
            ta.cpu().numpy().tobytes(),
            tb.cpu().numpy().tobytes(),
            self.t[a : a + n].cpu().numpy().tobytes(),
        )

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.t.device)

    def out_of_bounds_refused(self) -> bool:
        try:
            self.torch.empty(0, dtype=self.torch.uint8, device=self.t.device).set_(
                self.t.untyped_storage(), 0, (len(self) + 4096,)
            )
            return False
        except RuntimeError:
            return True


def import_allocation(handle: dict) -> tuple[Buffer, int | None]:
    """(the allocation, bytes measured on this side): a shm file's own size, or the extent the CUDA driver
    reports for the device allocation from the buffer's start."""
    if handle.get("kind") == "shm":
        buf: Buffer = ShmBuffer(handle["path"])
        return buf, len(buf)
    if handle.get("kind") == "cuda-ipc":
        buf = CudaBuffer(handle)
        return buf, _cuda_extent(buf.address())
    raise ValueError(f"unknown handle kind {handle.get('kind')!r}; expected 'shm' or 'cuda-ipc'")


# ---------------------------------------------------------------- one group, the whole report


def verify_group(want: dict, got: dict | None, spec: dict) -> dict:
    g = spec["geometry"]
    views, probe, nbytes = expected_views(want["kind"], want["layers"], g)
    res: dict = {
        **want,
        "span": span_of(want["kind"], g),
        "nbytes_expected": nbytes,
        "found": got is not None,
    }
    if got is None:
        res["error"] = "not in the engine's handles"
        return res
    res["layers_match"] = got.get("layers") == want["layers"] and got.get("kind") == want["kind"]
    res["views_differ"] = views_differ(got.get("views", []), views)
    res["probe_match"] = (got.get("probe") or {}).get("offset") == probe
    buf, measured = import_allocation(got["handle"])
    res["nbytes_measured"], res["nbytes_handle"] = measured, got["handle"].get("nbytes")
    on_cuda = buf.on_cuda
    res["size_ok"] = bool(
        measured is not None
        and res["nbytes_handle"] == got.get("nbytes") == nbytes
        and (measured >= nbytes if on_cuda else measured == nbytes)
    )
    res["alignment_ok"] = buf.address() % g["alignment"] == 0
    res["device"] = dict(buf.device)
    if on_cuda:
        res["device_ok"] = buf.device["uuid"] == (got.get("device") or {}).get("uuid")
    else:
        res["device_ok"] = (got.get("device") or {}).get("type") == "cpu"
    half = g["probe_bytes"] // 2
    usable = min(len(buf), measured or 0)
    if probe + g["probe_bytes"] > usable:
        res["error"] = f"the probe page at {probe} lies past the {usable} bytes this allocation has"
        res["out_of_bounds_refused"] = buf.out_of_bounds_refused()
        return res
    seen = buf.read(probe, half)
    res["engine_pattern"] = {"offset": probe, "length": half, "sha256": _sha(seen)}
    res["engine_pattern_ok"] = seen == pattern_bytes(f"{spec['read_nonce']}:{want['name']}", half)
    mine = pattern_bytes(f"{spec['write_nonce']}:{want['name']}", half)
    buf.write(probe + half, mine)
    buf.sync()
    res["written"] = {"offset": probe + half, "length": half, "sha256": _sha(buf.read(probe + half, half))}
    n = min(spec.get("sample_bytes", SAMPLE_BYTES), probe)
    at = (int.from_bytes(os.urandom(8), "little") % max(1, (probe - n) // g["alignment"] + 1)) * g[
        "alignment"
    ]
    res["sample"] = {"offset": at, "length": n, "sha256": _sha(buf.read(at, n))}
    res["out_of_bounds_refused"] = buf.out_of_bounds_refused()
    return res


# ---------------------------------------------------------------- intervention: swap two sequences' memory


def token_rows(g: dict, blocks: list[int], lo: int, hi: int, rank: int) -> list[int]:
    """Rows of an attention K/V view [blocks, shards, block_size, ...], flattened over its first three dims,
    that hold positions [lo, hi) of a sequence with this block table, on this process (folded: every
    shard; distributed: only the positions dealt to `rank`). Position p sits in block column p // span,
    shard (o // interleave) % dcp_size and local slot (o // (interleave * dcp_size)) * interleave +
    o % interleave of that shard, o = p % span."""
    span, s, i, bs = span_of("attention", g), g["dcp_size"], g.get("interleave", 1), g["block_size"]
    folded = g.get("dcp_ranks", 1) == 1
    rows = []
    for p in range(lo, hi):
        col, o = divmod(p, span)
        if col >= len(blocks):
            raise ValueError(f"position {p} lies past the {len(blocks)} blocks of the block table")
        shard, local = (o // i) % s, (o // (i * s)) * i + o % i
        if folded:
            rows.append((blocks[col] * s + shard) * bs + local)
        elif shard == rank:
            rows.append(blocks[col] * bs + local)
    return rows


def _runs(starts_a: list[int], starts_b: list[int], width: int) -> list[tuple[int, int, int]]:
    """Pairs of equal rows (byte starts) merged into (a, b, length) runs where both sides are contiguous."""
    out: list[list[int]] = []
    for a, b in zip(starts_a, starts_b, strict=True):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1][2] += width
        else:
            out.append([a, b, width])
    return [(a, b, n) for a, b, n in out]


def swap_ranges(kind: str, layers: list[int], g: dict, swap: dict, rank: int) -> list[tuple[int, int, int]]:
    """(offset in a, offset in b, length) byte runs of one group's allocation that hold sequence a's and
    sequence b's memory, as the geometry lays it out: KDA, every layer's state and conv rows of their state
    slots; attention, every layer's K and V rows of positions swap["positions"] = [lo, hi)."""
    views, _, _ = expected_views(kind, layers, g)
    a, b = swap["a"], swap["b"]
    out: list[tuple[int, int, int]] = []
    for v in views:
        width = math.prod(v["shape"][1:]) * ITEMSIZE[v["dtype"]] if kind == "kda" else 0
        if kind == "kda":
            if len(a["slots"]) != len(b["slots"]):
                raise ValueError("the two sequences hold different numbers of state slots")
            ra = [v["offset"] + s * width for s in a["slots"]]
            rb = [v["offset"] + s * width for s in b["slots"]]
        else:
            width = math.prod(v["shape"][3:]) * ITEMSIZE[v["dtype"]]
            lo, hi = swap["positions"]
            ra = [v["offset"] + r * width for r in token_rows(g, a["blocks"], lo, hi, rank)]
            rb = [v["offset"] + r * width for r in token_rows(g, b["blocks"], lo, hi, rank)]
        out += _runs(ra, rb, width)
    return out


def _swap(buf: Buffer, runs: list[tuple[int, int, int]]) -> dict:
    """Exchange the bytes of each (a, b, length) run; the digests of a's bytes before and after."""
    ha, hb, after = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    total = 0
    for a, b, n in runs:
        was_a, was_b, now_a = buf.swap(a, b, n)
        ha.update(was_a)
        hb.update(was_b)
        after.update(now_a)
        total += n
    buf.sync()
    return {
        "bytes": total,
        "runs": len(runs),
        "a_before": "sha256:" + ha.hexdigest(),
        "b_before": "sha256:" + hb.hexdigest(),
        "a_after": "sha256:" + after.hexdigest(),
    }


def run_swaps(spec: dict) -> dict:
    """Between two decode steps: for every rank's allocations and every swap, exchange the bytes the
    geometry says sequence a and sequence b own (only groups of the swap's kinds). Each swap is its own
    inverse, so applying the same swap again restores the bytes."""
    g = spec["geometry"]
    derived = derive_groups(g)
    ranks = []
    for entry in spec["ranks"]:
        rank = entry["rank"]
        exported = {h["name"]: h for h in entry["groups"]}
        groups = []
        for want in derived:
            res: dict = {"name": want["name"], "kind": want["kind"], "swaps": {}}
            got = exported.get(want["name"])
            if got is None:
                groups.append({**res, "error": "not in the engine's handles"})
                continue
            try:
                buf, measured = import_allocation(got["handle"])
                _, _, nbytes = expected_views(want["kind"], want["layers"], g)
                if measured is None or measured < nbytes or len(buf) < nbytes:
                    raise ValueError(f"{measured} bytes mapped, the geometry needs {nbytes}")
                for sw in spec["swaps"]:
                    if want["kind"] in sw["kinds"]:
                        res["swaps"][sw["name"]] = _swap(
                            buf, swap_ranges(want["kind"], want["layers"], g, sw, rank)
                        )
            except Exception as e:  # one bad allocation must not hide the others
                res["error"] = f"{type(e).__name__}: {e}"
            groups.append(res)
        ranks.append({"rank": rank, "groups": groups})
    return {"pid": os.getpid(), "mode": "swap", "ranks": ranks, "error": None}


def run(spec: dict) -> dict:
    g = spec["geometry"]
    derived = derive_groups(g)
    exported = {h["name"]: h for h in spec["handles"]["groups"]}
    groups = []
    for want in derived:
        try:
            groups.append(verify_group(want, exported.get(want["name"]), spec))
        except Exception as e:  # one bad handle must not hide the others: report it as data
            groups.append({**want, "span": span_of(want["kind"], g), "error": f"{type(e).__name__}: {e}"})
    names = {w["name"] for w in derived}
    return {
        "pid": os.getpid(),
        "spans": [span_of(w["kind"], g) for w in derived],
        "groups": groups,
        "unexpected": sorted(n for n in exported if n not in names),
        "error": None,
    }


@contextlib.contextmanager
def acting_as(ids: str | None):
    """Within: the real and effective uid and gid `ids` ("UID:GID", the sandboxed engine's), no
    supplementary groups; the saved uid and gid stay the peer's own, to return to. The NVIDIA driver opens
    a legacy CUDA IPC handle only for a process of the exporter's real uid (on the H200: root importers
    failed with cudaErrorMapBufferObjectFailed whatever namespaces they shared, scripts/ipc-matrix, and so
    did this peer with only the engine's effective uid; tests/data/ipc-matrix). The engine's uid cannot
    trace the peer (ptrace needs all three uids to match, and a uid change makes the peer non-dumpable);
    it can signal it, which only makes the check fail."""
    if not ids:
        yield
        return
    uid, gid = (int(x) for x in ids.split(":"))
    ruid, euid, _ = os.getresuid()
    rgid, egid, _ = os.getresgid()
    groups = os.getgroups()
    os.setgroups([])
    os.setresgid(gid, gid, -1)
    os.setresuid(uid, uid, -1)
    try:
        yield
    finally:
        os.setresuid(ruid, euid, -1)
        os.setresgid(rgid, egid, -1)
        os.setgroups(groups)


# Where a peer's seconds went (its report's seconds_each): waiting for its order, CUDA's start, the handles'
# opening, the whole of the work; diagnostics for the harness's evidence.
SECONDS: dict[str, float] = {}

MAX_ORDER_BYTES = 1 << 16  # the one line a waiting peer reads: {"spec": PATH, "out": PATH}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qualify.engine.peer")
    p.add_argument("--spec", default=None, help="JSON: geometry, the engine's kv-handles, nonces")
    p.add_argument("--out", default=None, help="write the report here (default: stdout)")
    p.add_argument(
        "--wait", action="store_true",
        help="start, import torch, then read one JSON line {spec, out} from stdin (a spare the harness "
        "starts ahead of time); EOF before it: exit 0",
    )  # fmt: skip
    p.add_argument(
        "--cuda-as", default=None, metavar="UID:GID",
        help="open the CUDA handles with this real and effective uid and gid (the sandboxed engine's), "
        "keeping the saved ones; the spec is read and the report written with the peer's own",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.wait:
        import torch  # noqa: F401  (the slow part of a start, done before the spec is known)

        t_wait = time.perf_counter()
        line = sys.stdin.readline(MAX_ORDER_BYTES)
        SECONDS["waited_for_order"] = round(time.perf_counter() - t_wait, 4)
        if not line.strip():
            return 0  # not needed after all (the run ended, or the harness went away)
        order = json.loads(line)
        args.spec, args.out = str(order["spec"]), str(order["out"])
    if args.spec is None:
        p.error("--spec is required (or --wait)")
    t_work = time.perf_counter()
    try:
        with open(args.spec) as f:
            spec = json.load(f)
        if args.cuda_as:
            import torch  # noqa: F401  (read with the peer's own uid; CUDA starts later, under the engine's)
        with acting_as(args.cuda_as):
            report = run_swaps(spec) if spec.get("mode") == "swap" else run(spec)
    except Exception as e:
        report = {
            "pid": os.getpid(),
            "spans": [],
            "groups": [],
            "unexpected": [],
            "error": f"{type(e).__name__}: {e}",
        }
    SECONDS["work"] = round(time.perf_counter() - t_work, 4)
    report["seconds_each"] = dict(SECONDS)
    text = json.dumps(report)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    else:
        print(text, flush=True)
    return 0 if report["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
