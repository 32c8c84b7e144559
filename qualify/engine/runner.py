"""Prefill, capture-ready decode and greedy generation over the hybrid model.

A decode step is two calls: `stage_decode` (host -> fixed-address arena buffers) and
`forward_decode_static` (reads only fixed-address buffers, writes logits into a static output buffer,
no host sync), so graphs.py can capture the second and replay it after the first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.kda import build_chunk_metadata

from .arena import Arena, CapacityError
from .model import DecodeContext, HybridModel, PrefillContext
from .model.norm import rows_invariant
from .tokenizer import EOS

KDA_CHUNK = 64


class ModeUnavailable(Exception):
    """The caller asked for graph replay but this engine has no captured graphs."""

    type_name = "ModeUnavailable"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    slots: list[int]  # 1 + num_spec state slots (column j = state after verify token j)
    blocks: list[int]  # KV blocks of the attention groups, reserved for prompt + max_tokens
    output: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    top2: list[list[int]] = field(default_factory=list)  # per output token: [top-1 id, top-2 id]
    accepted_steps: list[int] | None = None  # speculative: drafts accepted at each verify step
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Generation:
    token_ids: list[int]
    top2_gaps: list[float]
    finish_reason: str
    prompt_tokens: int
    top2_ids: list[list[int]] = field(default_factory=list)
    accepted_per_step: list[int] | None = None

    @classmethod
    def of(cls, r: Request) -> Generation:
        return cls(r.output, r.gaps, r.finish_reason or "length", len(r.prompt), r.top2, r.accepted_steps)


class SlotPool:
    """Free lists of state-slot groups (slot 0 = null, never handed out) and KV blocks (block 0 = null)."""

    def __init__(self, cfg):
        T = cfg.tokens_per_request
        self.groups = deque([list(range(1 + i * T, 1 + (i + 1) * T)) for i in range(cfg.max_num_seqs)])
        self.blocks = deque(range(1, cfg.num_kv_blocks))

    def take(self, num_blocks: int) -> tuple[list[int], list[int]]:
        return self.groups.popleft(), [self.blocks.popleft() for _ in range(num_blocks)]

    def give(self, slots: list[int], blocks: list[int]) -> None:
        self.groups.append(slots)
        self.blocks.extend(blocks)


@dataclass
class StaticOutputs:
    """Named owner of the decode step's static outputs (what a captured graph writes)."""

    logits: Tensor  # [rows*T, vocab] fp32
    hidden: Tensor  # [rows*T, hidden]: the target's last hidden state, for the MTP draft


class Runner:
    def __init__(
        self, cfg, model: HybridModel, arena: Arena, device: torch.device, counters, stop_at_eos: bool = True
    ):
        self.cfg, self.model, self.arena, self.device, self.counters = cfg, model, arena, device, counters
        self.pool = SlotPool(cfg)
        rows = cfg.plan_rows * cfg.tokens_per_request
        dtype = getattr(torch, cfg.dtype)
        self.static = StaticOutputs(
            torch.zeros(rows, cfg.shape.vocab, dtype=torch.float32, device=device),
            torch.zeros(rows, cfg.shape.hidden, dtype=dtype, device=device),
        )
        self.graphs = None  # set by graphs.py: padded_size(n, T) -> int | None, replay(n_pad, T) -> logits
        self._contexts: dict[tuple[int, int], DecodeContext] = {}
        self.prefill_hidden: Tensor | None = None
        # Seconds spent prefilling (the first token of each prompt picked: synchronized) and the prompts,
        # since boot: a diagnostic the server logs per request (what a request's time went to).
        self.prefill_seconds = 0.0
        self.prefill_prompts = 0
        # A request ends at EOS. An engine whose weights were never loaded (the warm step's recording pass,
        # Engine(weights=False)) passes False: its tokens come from whatever memory held, and one that
        # happened to pick EOS after prefill would skip the decode steps whose kernels the pass records.
        self.stop_at_eos = stop_at_eos

    # ------------------------------------------------------------------ admission

    def blocks_for(self, total_tokens: int) -> int:
        return -(-total_tokens // self.cfg.attention_span)

    def check_admission(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Refuse (CapacityError, nothing allocated) a batch that cannot run to completion."""
        cfg = self.cfg
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        free = len(self.pool.groups)
        if len(prompts) > free:
            raise CapacityError(
                "live state slots",
                free,
                len(prompts),
                "requests",
                f"send at most {cfg.max_num_seqs} prompts at once",
            )
        for p in prompts:
            if len(p) + max_tokens > cfg.max_model_len:
                raise CapacityError(
                    "block_tables (max_model_len)",
                    cfg.max_model_len,
                    len(p) + max_tokens,
                    "tokens per request",
                    "shorten the prompt or max_tokens",
                )
            if len(p) > cfg.max_num_batched_tokens:
                raise CapacityError(
                    "arena buffer 'input_ids' (max_num_batched_tokens)",
                    cfg.max_num_batched_tokens,
                    len(p),
                    "prompt tokens",
                    "shorten the prompt",
                )
            if not p:
                raise ValueError("a prompt has no tokens; send at least one token (text always has BOS)")
            if any(t < 0 or t >= cfg.shape.vocab for t in p):
                bad = next(t for t in p if t < 0 or t >= cfg.shape.vocab)
                raise ValueError(f"token ids must lie in [0, {cfg.shape.vocab}); got {bad}")
        need = sum(self.blocks_for(len(p) + max_tokens) for p in prompts)
        if need > len(self.pool.blocks):
            raise CapacityError("KV blocks", len(self.pool.blocks), need, "blocks")

    def admit(self, prompt: list[int], max_tokens: int) -> Request:
        slots, blocks = self.pool.take(self.blocks_for(len(prompt) + max_tokens))
        return Request(list(prompt), max_tokens, slots, blocks)

    def release(self, req: Request) -> None:
        if req.slots:
            self.pool.give(req.slots, req.blocks)
            req.slots, req.blocks = [], []

    def _block_rows(self, reqs: list[Request]) -> list[int]:
        B = self.cfg.max_blocks_per_seq
        return [b for r in reqs for b in (r.blocks + [0] * (B - len(r.blocks)))]

    # ------------------------------------------------------------------ prefill (eager)

    @torch.no_grad()
    def prefill(self, reqs: list[Request]) -> Tensor:
        """fp32 logits of each prompt's last token [N, vocab], which never depend on the batch the prompt
        came in. The harness compares answers given in batches of different composition (fillers, decoys,
        a drafted batch of one), and a plainly batched prefill's sums depend on the batch's row count: the
        fused glue's projections take linear_small up to kernels.fused.SMALL_M rows and cuBLAS past them,
        and cuBLAS chooses its kernels by the row count. Batched so, a prompt's logits moved by up to 0.109
        among fillers (bench/batch_variance.py, H100, 2026-12-05), twice the coherence rule's epsilon, and an
        honest engine was once rejected on it.

        A fused engine (CUDA) prefills the batch in one forward under rows_invariant: every projection
        through kernels.fused.linear_rows (one launch shape for any row count, no split of K), the KDA
        state pass at a fixed tile, attention and the conv per prompt as always, and each prompt's head on
        its own row. One forward's host work instead of one per prompt: on an H100 host (2026-12-05)
        prefill was 19 of 28 s of the engine's work in a qualify run, about 28 ms a prompt, nearly all of
        it launching. Other engines (the CPU reference) prefill each prompt on its own.
        Each prompt's last hidden state is kept in `prefill_hidden`, rows in order."""
        if self.model.norm.fused:
            with rows_invariant():
                return self._prefill_varlen(reqs, heads_apart=True)
        if len(reqs) <= 1:
            return self._prefill_varlen(reqs)
        logits, hidden = [], []
        for r in reqs:
            logits.append(self._prefill_varlen([r]))
            hidden.append(self.prefill_hidden)
        self.prefill_hidden = torch.cat(hidden)
        return torch.cat(logits)

    def _prefill_varlen(self, reqs: list[Request], heads_apart: bool = False) -> Tensor:
        """Run whole prompts varlen in one forward; returns fp32 logits of each prompt's last token (with
        `heads_apart`, each prompt's through the head on its own: a one-row product, as alone)."""
        a, cfg = self.arena, self.cfg
        lens = [len(r.prompt) for r in reqs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        total, N = cu[-1], len(reqs)
        max_chunks = a.buffers["chunk_indices"].shape[0]
        need_chunks = sum(-(-n // KDA_CHUNK) for n in lens)
        a.check_fits("input_ids", total, "tokens")
        a.check_fits("prefill_slots", N, "prompts")
        if need_chunks > max_chunks:
            raise CapacityError("arena buffer 'chunk_indices'", max_chunks, need_chunks, "chunks")
        a.stage("input_ids", [t for r in reqs for t in r.prompt])
        a.stage("positions", [i for n in lens for i in range(n)])
        a.stage("query_start_loc", cu, fill=total)
        a.stage("prefill_slots", [r.slots[0] for r in reqs])
        a.stage("has_initial_state", [0] * N)
        a.stage("seq_lens", lens)
        a.stage("block_tables", self._block_rows(reqs))
        num_chunks = build_chunk_metadata(
            cu, KDA_CHUNK, a.view("chunk_indices", max_chunks, 2), a.view("chunk_offsets", N + 1)
        )
        a.stage("num_chunks", [num_chunks])
        ctx = PrefillContext(
            positions=a.view("positions", total),
            bounds=list(zip(cu[:-1], cu[1:], strict=True)),
            cu_seqlens=a.view("query_start_loc", N + 1),
            slots=a.view("prefill_slots", N),
            slots_host=[r.slots[0] for r in reqs],
            has_initial_state=a.view("has_initial_state", N),
            chunk_indices=a.view("chunk_indices", max_chunks, 2),
            chunk_offsets=a.view("chunk_offsets", N + 1),
            num_chunks=num_chunks,
            seq_lens=a.view("seq_lens", N),
            seq_lens_q=torch.tensor(lens, device=self.device),
            block_tables=a.view("block_tables", N, cfg.max_blocks_per_seq),
            selector_rows=a.view("selector_rows", total, cfg.selector_topk),
        )
        hidden = self.model.forward_hidden(a.view("input_ids", total), ctx, decode=False)
        last = torch.tensor([c - 1 for c in cu[1:]], device=self.device)
        self.prefill_hidden = hidden[last]  # each prompt's last hidden state: what the MTP draft starts from
        if heads_apart and N > 1:
            return self.model.logits_apart(self.prefill_hidden)
        return self.model.logits(self.prefill_hidden)

    # ------------------------------------------------------------------ capture-ready decode

    def stage_decode(
        self, reqs: list[Request], n_pad: int, T: int = 1, tokens: list[list[int]] | None = None
    ) -> None:
        """Host -> arena for one decode step of `reqs` padded to `n_pad` rows of `T` tokens.

        Padding rows are the inert dummy request: null state slot 0, null block 0, seq_len 0, accepted 1.
        `tokens` (per request, T ids) defaults to each request's last token (plain decode, T = 1)."""
        a, n = self.arena, len(reqs)
        if n > n_pad:
            raise ValueError(f"stage_decode: {n} requests do not fit {n_pad} rows")
        # Check rows and columns separately and before anything is staged: the flat state_slots buffer
        # could hold n_pad*T entries for a T = 1 step with more rows than every per-row buffer has.
        rows, cols = a.buffers["state_slots"].shape
        if n_pad > rows:
            raise CapacityError(
                "arena buffer 'state_slots'",
                rows,
                n_pad,
                "request rows",
                "the batch exceeds the graph/live envelope",
            )
        if cols < T:
            raise CapacityError(
                "arena buffer 'state_slots'", cols, T, "tokens per request", "at most 1 + num_spec per step"
            )
        if tokens is None:
            tokens = [[(r.output or r.prompt)[-1]] for r in reqs]
        first = [r.num_tokens - 1 for r in reqs]  # position of each request's first token this step
        a.stage("input_ids", [t for ts in tokens for t in ts])
        a.stage("positions", [p + j for p in first for j in range(T)])
        a.stage("state_slots", [s for r in reqs for s in r.slots[:T]])
        a.stage("num_accepted", [1] * n, fill=1)
        a.stage("num_live", [n])
        a.stage("seq_lens", [p + T for p in first])
        a.stage("block_tables", self._block_rows(reqs))
        a.stage("query_start_loc", list(range(0, (n + 1) * T, T)), fill=n * T)

    def decode_context(self, n_pad: int, T: int = 1) -> DecodeContext:
        key = (n_pad, T)
        ctx = self._contexts.get(key)
        if ctx is None:
            a, cfg = self.arena, self.cfg
            ctx = DecodeContext(
                n=n_pad,
                T=T,
                positions=a.view("positions", n_pad * T),
                state_slots=a.view("state_slots", n_pad, T),
                num_accepted=a.view("num_accepted", n_pad),
                num_live=a.view("num_live", 1),
                seq_lens=a.view("seq_lens", n_pad),
                block_tables=a.view("block_tables", n_pad, cfg.max_blocks_per_seq),
                selector_rows=a.view("selector_rows", n_pad * T, cfg.selector_topk),
            )
            self._contexts[key] = ctx
        return ctx

    @torch.no_grad()
    def forward_decode_static(self, n_pad: int, T: int = 1) -> Tensor:
        """One decode (T = 1) or verify (T = 1 + num_spec) step over the staged arena; capturable.

        Reads only fixed-address buffers (arena, KV/state pools, KDA workspace, parameters); writes the
        static logits [n_pad*T, vocab] and hidden states, and returns the logits view."""
        rows = n_pad * T
        ctx = self.decode_context(n_pad, T)
        ids = self.arena.view("input_ids", rows)
        self.model.decode_into(ids, ctx, self.static.hidden[:rows], self.static.logits[:rows])
        return self.static.logits[:rows]

    def decode_step(self, reqs: list[Request], mode: str = "auto") -> tuple[Tensor, str]:
        """Plain decode of every request's last token; returns (logits [n, vocab], "eager" | "graph")."""
        n = len(reqs)
        if self.graphs is not None and mode != "eager":
            n_pad = self.graphs.padded_size(n, 1)
            if n_pad is not None:
                self.stage_decode(reqs, n_pad, 1)
                return self.graphs.replay(n_pad, 1)[:n], "graph"
        if mode == "graph":
            raise ModeUnavailable(
                "mode 'graph' needs captured CUDA graphs for this batch (cudagraph_mode full, a CUDA device, "
                "a batch within the largest capture size); use mode 'auto' or 'eager'"
            )
        self.stage_decode(reqs, n, 1)
        self.counters.eager_steps += 1
        return self.forward_decode_static(n, 1)[:n], "eager"

    # ------------------------------------------------------------------ greedy generation

    @staticmethod
    def pick(logits: Tensor) -> tuple[list[int], list[float]]:
        """Greedy choice and the top-2 logit gap of each row (the near-tie evidence of the coherence rule)."""
        toks, gaps, _ = Runner.pick_top2(logits)
        return toks, gaps

    @staticmethod
    def pick_top2(logits: Tensor) -> tuple[list[int], list[float], list[int]]:
        """`pick` plus each row's runner-up token id (both ids are reported with every generated token)."""
        top = torch.topk(logits.float(), 2, dim=-1)
        gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
        return top.indices[:, 0].tolist(), gaps, top.indices[:, 1].tolist()

    def timed_prefill(self, batch: list[Request]) -> tuple[list[int], list[float], list[int]]:
        """`pick_top2(prefill(batch))`, its seconds added to `prefill_seconds` (the pick synchronizes)."""
        t0 = time.perf_counter()
        out = self.pick_top2(self.prefill(batch))
        self.prefill_seconds += time.perf_counter() - t0
        self.prefill_prompts += len(batch)
        return out

    def _append(self, req: Request, token: int, gap: float, second: int = -1) -> None:
        """Append one generated token with its top-2 gap and runner-up id (-1: not known, test paths)."""
        req.output.append(token)
        req.gaps.append(gap)
        req.top2.append([token, second])
        self.counters.tokens_generated += 1
        if token == EOS and self.stop_at_eos:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_tokens:
            req.finish_reason = "length"

    def generate(
        self, prompts: list[list[int]], max_tokens: int, mode: str = "auto"
    ) -> tuple[list[Generation], str]:
        """Greedy generation for a batch admitted as a whole (or refused as a whole with CapacityError).

        Prompts are prefilled in groups within max_num_batched_tokens, then decoded together; a finished
        request leaves the batch at once and frees its slots."""
        if mode == "graph" and self.graphs is None:
            raise ModeUnavailable(
                "mode 'graph' needs captured CUDA graphs (cudagraph_mode full on a CUDA device); "
                "use mode 'auto' or 'eager'"
            )
        self.check_admission(prompts, max_tokens)
        reqs = [self.admit(p, max_tokens) for p in prompts]
        modes: set[str] = set()
        try:
            waiting = deque(reqs)
            while waiting:
                batch, budget = [], self.cfg.max_num_batched_tokens
                while waiting and len(waiting[0].prompt) <= budget:
                    budget -= len(waiting[0].prompt)
                    batch.append(waiting.popleft())
                toks, gaps, seconds = self.timed_prefill(batch)
                for r, t, g, t2 in zip(batch, toks, gaps, seconds, strict=True):
                    self._append(r, t, g, t2)
            running = [r for r in reqs if not r.done]
            while running:
                logits, used = self.decode_step(running, mode)
                modes.add(used)
                toks, gaps, seconds = self.pick_top2(logits)
                for r, t, g, t2 in zip(running, toks, gaps, seconds, strict=True):
                    self._append(r, t, g, t2)
                for r in running:
                    if r.done:
                        self.release(r)
                running = [r for r in running if not r.done]
        finally:
            for r in reqs:
                self.release(r)
        used = "mixed" if len(modes) > 1 else (modes.pop() if modes else "eager")
        return [Generation.of(r) for r in reqs], used
