"""FULL CUDA-graph capture and replay of decode / speculative-verify steps over fixed-address buffers.

Capture sizes (tokens, multiples of 1 + num_spec), the address record checked before every replay, and
`GraphRunner`, which wraps the runner's capture-ready step (stage -> forward over fixed buffers -> static
logits): it picks the smallest captured size for a batch, the runner pads the rest with the inert dummy
request (null state slot 0, null block 0, accepted 1, seq_len 0, repeated query start), and it counts
captures, replays and recaptures into the engine's counters.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


class AddressMoved(RuntimeError):
    """A tensor a captured graph reads or writes is no longer at its recorded address."""


def capture_sizes(max_num_seqs: int, num_spec: int, requested: Iterable[int] | None = None) -> list[int]:
    """Token counts to capture, largest first. Default: 1, 2, 4, ... requests and the full live batch
    (max_num_seqs requests), so a full batch replays. Requested sizes are validated and kept as given
    (EngineConfig's sizes, which size the arena): every one a multiple of 1 + num_spec.
    """
    tpr = 1 + num_spec
    if max_num_seqs < 1 or num_spec < 0:
        raise ValueError(f"max_num_seqs must be >= 1 and num_spec >= 0, got {max_num_seqs}, {num_spec}")
    if requested is None:
        reqs, b = set(), 1
        while b < max_num_seqs:
            reqs.add(b)
            b *= 2
        sizes = {r * tpr for r in reqs} | {max_num_seqs * tpr}
    else:
        sizes = set(requested)
        bad = sorted(s for s in sizes if s < 1 or s % tpr)
        if bad:
            raise ValueError(f"capture sizes {bad} are not positive multiples of 1 + num_spec = {tpr} tokens")
        if not sizes:
            raise ValueError("no capture sizes requested; leave them unset for the default")
    return sorted(sizes, reverse=True)


def pick_size(live_requests: int, sizes: Iterable[int], tokens_per_request: int = 1) -> int | None:
    """The smallest captured size (tokens) that holds `live_requests`, or None when none does."""
    need = live_requests * tokens_per_request
    fits = [s for s in sizes if s >= need]
    return min(fits) if fits else None


@dataclass(frozen=True)
class CaptureEnvelope:
    """What the captured graphs were planned for: live capacity and graph-plan capacity are separate."""

    max_num_seqs: int  # live requests (state slots)
    num_spec: int
    sizes: tuple[int, ...]  # captured token counts, largest first

    @property
    def tokens_per_request(self) -> int:
        return 1 + self.num_spec

    @property
    def max_tokens(self) -> int:
        return max(self.sizes)

    @property
    def max_requests(self) -> int:
        """Graph-plan capacity in requests (can exceed max_num_seqs with explicit sizes)."""
        return self.max_tokens // self.tokens_per_request

    @classmethod
    def from_config(cls, cfg) -> CaptureEnvelope:
        sizes = capture_sizes(cfg.max_num_seqs, cfg.num_spec, cfg.capture_sizes)
        return cls(cfg.max_num_seqs, cfg.num_spec, tuple(sizes))


@dataclass
class AddressRecord:
    """Every tensor a captured graph touches, with its data pointer at capture time.

    `check()` re-reads the pointers of the held tensors (cheap: one tuple compare) and raises when any
    moved; `same_as(...)` compares a freshly gathered set (catches a tensor *replaced* by a new object).
    """

    names: tuple[str, ...]
    tensors: tuple[Tensor, ...] = field(repr=False)
    pointers: tuple[int, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor]) -> AddressRecord:
        names = tuple(tensors)
        ts = tuple(tensors[n] for n in names)
        return cls(names, ts, tuple(t.data_ptr() for t in ts))

    def current(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def check(self) -> None:
        now = self.current()
        if now != self.pointers:
            moved = [n for n, a, b in zip(self.names, self.pointers, now, strict=True) if a != b]
            raise AddressMoved(
                f"{len(moved)} captured tensor(s) moved since capture ({', '.join(moved[:5])}); "
                "something reallocated instead of copying in place: recapture is refused, restart the engine"
            )

    def same_as(self, tensors: Mapping[str, Tensor]) -> list[str]:
        """Names whose address differs in `tensors` (or that appear/disappear); [] when all match."""
        fresh = {n: t.data_ptr() for n, t in tensors.items()}
        old = dict(zip(self.names, self.pointers, strict=True))
        return sorted(n for n in set(fresh) | set(old) if fresh.get(n) != old.get(n))

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, ptr in zip(self.names, self.pointers, strict=True):
            h.update(f"{name}={ptr:#x}\n".encode())
        return "sha256:" + h.hexdigest()


def captured_tensors(engine, plans: Iterable[tuple[int, int]] | None = None) -> dict[str, Tensor]:
    """Every tensor a captured decode / verify step reads or writes, by a stable name.

    Inputs and metadata (arena), static outputs, KV and state pools, the KDA workspace and scratch, the
    attention runtime's tables, and every parameter (weights are read in place, reload copies into them).
    `plans`: the (requests, tokens per request) shapes captured; only their KDA scratch is read by a graph
    (an eager step of another shape binds scratch of its own later, which no graph ever reads).
    """
    keep = None if plans is None else set(plans)
    out: dict[str, Tensor] = {}
    for name, buf in engine.arena.buffers.items():
        out[f"arena.{name}"] = buf.device
    out["static.logits"] = engine.runner.static.logits
    out["static.hidden"] = engine.runner.static.hidden
    for i, layer in enumerate(engine.model.layers):
        m = layer.mixer
        for pool in ("state", "conv_state", "k_cache", "v_cache"):
            t = getattr(m, pool, None)
            if isinstance(t, Tensor):
                out[f"pool.{i}.{pool}"] = t
    ws = engine.kda_rt.ws
    for f in fields(ws):
        out[f"kda.ws.{f.name}"] = getattr(ws, f.name)
    for key, scratch in sorted(engine.kda_rt._scratch.items()):
        if keep is not None and key not in keep:
            continue
        for name, t in sorted(scratch.items()):
            out[f"kda.scratch.{key[0]}x{key[1]}.{name}"] = t
    for name in ("kpos", "kcol", "koff", "cos", "sin"):
        out[f"attn.{name}"] = getattr(engine.attn_rt, name)
    for name, p in engine.model.named_parameters():
        out[f"param.{name}"] = p
    return out


class GraphRunner:
    """FULL CUDA graphs of an engine's decode / verify step, one per (padded requests, tokens per request).

    Installed as `runner.graphs`, it answers `padded_size(n, T)` and `replay(n_pad, T)`; the runner stages
    the padded batch (its padding rows are the inert dummy request) and reads the static outputs. Verify
    graphs cover the envelope's sizes; with num_spec > 0 plain-decode graphs (T = 1) are captured for the
    same request counts, so plain and speculative steps both replay.
    """

    def __init__(self, engine):
        self.engine = engine
        self.runner, self.counters = engine.runner, engine.counters
        self.device: torch.device = engine.device
        self.envelope = CaptureEnvelope.from_config(engine.cfg)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.record: AddressRecord | None = None
        self.report: dict | None = None
        self.reason: str | None = None
        if self.device.type != "cuda":
            self.reason = "CUDA graphs need a CUDA device"
        elif engine.cfg.cudagraph_mode != "full":
            self.reason = f"cudagraph_mode is {engine.cfg.cudagraph_mode!r}"

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def plans(self) -> list[tuple[int, int]]:
        """(padded requests, tokens per request) to capture, largest token count first."""
        T = self.envelope.tokens_per_request
        plans = [(size // T, T) for size in self.envelope.sizes]
        if T > 1:
            plans += [(n, 1) for n, _ in plans]
        return sorted(plans, key=lambda p: (p[0] * p[1], p[1]), reverse=True)

    def padded_size(self, n: int, T: int) -> int | None:
        """Rows of the smallest captured graph for n requests of T tokens; None runs the step eagerly."""
        sizes = [m * T for (m, t) in self.graphs if t == T]
        if not sizes or n < 1:
            return None
        size = pick_size(n, sizes, T)
        if size is None:
            self.counters.graph_oversize_eager += 1  # visible: the step runs eagerly (an eager step too)
            return None
        return size // T

    def replay(self, n_pad: int, T: int) -> Tensor:
        """Replay the captured step over the staged arena; returns the static logits [n_pad*T, vocab]."""
        graph = self.graphs[(n_pad, T)]
        self.record.check()  # type: ignore[union-attr]  # set whenever graphs exist
        graph.replay()
        self.counters.graph_replays += 1
        return self.runner.static.logits[: n_pad * T]

    def capture(self, warmup: int = 2) -> dict:
        """Capture every plan once (largest first, one memory pool). A second call returns the first
        report and captures nothing: recaptures stay 0."""
        if self.report is not None:
            return self.report
        sizes = list(self.envelope.sizes)
        if self.reason is not None:
            self.report = _report(False, self.reason, sizes, 0, 0.0, None)
            return self.report
        runner, dev = self.runner, self.device
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.no_grad():
                for n_pad, T in self.plans():
                    runner.stage_decode([], n_pad, T)  # every row is the inert dummy request
                    side = torch.cuda.Stream(dev)
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):  # eager warm-up: JIT compiles and bindings happen here
                        for _ in range(warmup):
                            runner.forward_decode_static(n_pad, T)
                    torch.cuda.current_stream(dev).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        runner.forward_decode_static(n_pad, T)
                    self.graphs[(n_pad, T)] = graph
                    self.counters.graph_captures += 1
            torch.cuda.synchronize(dev)
        except torch.cuda.OutOfMemoryError:
            self.graphs.clear()
            raise  # an OOM is a fault the server counts (cuda_oom), not a backend that cannot be captured
        except RuntimeError as exc:  # a backend that syncs with the host cannot be captured: say so
            self.graphs.clear()
            self.reason = f"capture failed, steps run eagerly: {str(exc).splitlines()[0]}"
            self.report = _report(False, self.reason, sizes, 0, time.perf_counter() - t0, None)
            return self.report
        self.record = AddressRecord.of(captured_tensors(self.engine, self.graphs))
        pool_bytes = _pool_bytes(pool, dev)
        self.report = _report(True, None, sizes, pool_bytes, time.perf_counter() - t0, self.record.digest())
        self.report["plans"] = [list(p) for p in self.graphs]
        return self.report

    def moved_since_capture(self) -> list[str]:
        """Names whose address differs from the capture record in a fresh gather (e.g. after a reload)."""
        if self.record is None:
            return []
        return self.record.same_as(captured_tensors(self.engine, self.graphs))


def _pool_bytes(pool, device: torch.device) -> int:
    """Bytes of the segments the caching allocator holds for the graphs' private memory pool."""
    want = tuple(pool)
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device") == device.index and tuple(seg.get("segment_pool_id", ())) == want
    )


def _report(captured: bool, reason: str | None, sizes: list[int], pool: int, secs: float, digest) -> dict:
    return {
        "captured": captured,
        "reason": reason,
        "sizes": sizes,
        "pool_bytes": int(pool),
        "seconds": secs,
        "address_digest": digest,
    }


def install(engine) -> GraphRunner:
    """The engine's GraphRunner (created once), installed as the runner's graph hook."""
    g = getattr(engine.runner, "graphs", None)
    if not isinstance(g, GraphRunner):
        g = GraphRunner(engine)
        engine.runner.graphs = g
    return g


def capture_engine(engine) -> dict:
    """`/qualify/capture`: capture every size once; the report (sizes, pool bytes, seconds, digest)."""
    return install(engine).capture()
