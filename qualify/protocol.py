"""The engine protocol (docs/PROTOCOL.md): pydantic messages shared by the harness and the engine, no torch.

Also the coherence rule of two greedy runs (docs/generation.md), implemented once here for both sides.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)

# The protocol's version: the engine reports it in `describe` (and in its manifest), the receipt records it,
# and the harness refuses an engine that speaks another one (docs/PROTOCOL.md, "Versions").
PROTOCOL_VERSION = "2"
SUPPORTED_PROTOCOL_VERSIONS = ("2",)
CAPACITY_ERROR = "CapacityError"
# The line a DCP engine prints before it exits because a follower rank died ("... rank=R how").
DCP_RANK_LOST = "QUALIFY_DCP_RANK_LOST"


def tree_digest(root: str | Path, files: list[Path]) -> str:
    """The code-digest algorithm (docs/PROTOCOL.md, "Identity"): sha256 over the files sorted by path, each
    as (its path relative to `root` with / separators, NUL, its bytes, NUL); `sha256:<hex>`."""
    import hashlib

    base = Path(root)
    h = hashlib.sha256()
    for f in sorted(files):
        if f.is_file():
            h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def package_digest(package_dir: str | Path) -> str:
    """A foreign engine's code digest: `tree_digest` over every .py under its package's directory."""
    root = Path(package_dir)
    return tree_digest(root, list(root.rglob("*.py")))


def dcp_ranks_lost(log_text: str) -> list[str]:
    """The lost-rank lines of an engine log, each as "rank=R how"."""
    return [ln.split(DCP_RANK_LOST, 1)[1].strip() for ln in log_text.splitlines() if DCP_RANK_LOST in ln]


class _Msg(BaseModel):
    """Requests refuse unknown fields (fail closed); responses tolerate additions from newer engines."""

    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- errors


class ErrorDetail(_Reply):
    type: str
    message: str


class ErrorBody(_Reply):
    """Every 4xx/5xx answer: {"error": {"type": ..., "message": ...}}."""

    error: ErrorDetail


# ---------------------------------------------------------------- /health


class Health(_Reply):
    status: Literal["ok"] = "ok"
    ready: bool
    pid: int


# ---------------------------------------------------------------- /v1/describe


class EngineInfo(_Reply):
    name: str
    version: str
    code_digest: str  # sha256 over the engine's source files
    weights_digest: str
    # The weights file the engine loaded (None: none named); the harness hashes it where it can read it.
    weights_path: str | None = None


class BackendInfo(_Reply):
    requested: str
    resolved: str
    reason: str
    prefill_path: str
    glue: str | None = None  # the decode step's glue ops: "triton fused" or "torch" (None: not said)


class KvGroupInfo(_Reply):
    name: str
    kind: Literal["kda", "attention"]
    layers: list[int]
    span: int
    nbytes: int
    alignment: int
    handle_kind: Literal["cuda-ipc", "shm"]


class LayoutInfo(_Reply):
    spans: list[int]
    chunk: int
    ratios: list[int]
    groups: list[KvGroupInfo]


class ArenaBufferInfo(_Reply):
    address: int
    capacity: int
    shape: list[int]
    dtype: str


class CapacityInfo(_Reply):
    live_slots: int
    max_num_seqs: int
    max_num_batched_tokens: int
    graph_max_batch: int
    num_spec: int


class DeviceInfo(_Reply):
    type: str
    name: str
    compute_capability: str | None = None
    driver: str | None = None
    total_memory: int | None = None


class Versions(_Reply):
    python: str
    torch: str
    triton: str | None = None
    cuda: str | None = None
    qualify: str


class Counters(_Reply):
    """The one list of engine counters: the engine keeps an instance and adds to it in place, and its
    /v1/describe and /metrics answers are built from it."""

    requests: int = 0
    tokens_generated: int = 0
    cuda_oom: int = 0
    capacity_refusals: int = 0
    graph_captures: int = 0
    graph_replays: int = 0
    graph_recaptures: int = 0
    graph_oversize_eager: int = 0  # steps above the largest captured size: run eagerly (also in eager_steps)
    eager_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted speculative draft tokens, engine-wide; 0 before any draft."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0


class DcpRankInfo(_Reply):
    """One DCP rank's process: its place, pid, device and the KV allocations it registered."""

    rank: int
    world: int
    local_shards: int
    pid: int
    device: str
    groups: list[KvGroupInfo]


class Describe(_Reply):
    # The protocol version the engine speaks (PROTOCOL_VERSION); None: an engine older than version 2.
    protocol_version: str | None = None
    engine: EngineInfo
    config: dict
    config_digest: str
    backend: BackendInfo
    layout: LayoutInfo
    dcp_mode: Literal["folded", "distributed"] = "folded"
    dcp: DcpRankInfo | None = None  # the describing process (rank 0)
    dcp_ranks: list[DcpRankInfo] = []  # distributed: every rank, in rank order
    arenas: dict[str, ArenaBufferInfo]
    capacity: CapacityInfo
    device: DeviceInfo
    versions: Versions
    counters: Counters
    cudagraph_mode: Literal["full", "none"]


# ---------------------------------------------------------------- /v1/completions


class CompletionRequest(_Msg):
    """OpenAI-style, greedy only. A list of strings or of token lists is a batch."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(ge=1)
    mode: Literal["auto", "eager", "graph"] = "auto"
    speculative: bool = False
    # Harness-supplied drafts (speculative, one prompt): drafts[s] holds the num_spec tokens the engine must
    # verify at its s-th verify step instead of drafting its own; steps past the list draft as usual. The
    # harness knows exactly how many of them a greedy verifier accepts (the longest prefix it would emit).
    drafts: list[list[int]] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is an empty list; give text, token ids, or a batch of either")
            if isinstance(v[0], list) and any(len(p) == 0 for p in v):
                raise ValueError("a prompt in the batch has no tokens")
            if isinstance(v[0], int) and any(t < 0 for t in v):
                raise ValueError("token ids must be non-negative")
            if isinstance(v[0], list) and any(t < 0 for p in v for t in p):
                raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _drafts_fit(self) -> CompletionRequest:
        d = self.drafts
        if d is None:
            return self
        if not self.speculative:
            raise ValueError("drafts are verified by speculative decoding: set speculative=true")
        if len(self.prompts()) != 1:
            raise ValueError("drafts apply to one prompt: send a batch of one")
        if not d or len(d) > self.max_tokens:
            raise ValueError("drafts need between 1 and max_tokens verify steps")
        if any(not row or len(row) > 64 or any(t < 0 for t in row) for row in d):
            raise ValueError("each verify step drafts 1 to 64 non-negative token ids")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class Choice(_Reply):
    index: int
    token_ids: list[int]
    text: str
    top2_gaps: list[float]  # per generated token: logit(top1) - logit(top2) of the step that chose it
    finish_reason: Literal["length", "stop"]
    # Per generated token: [top-1 id, top-2 id] of the step that chose it (the near-tie evidence; an engine
    # that omits them gets the exact-identity rule only).
    top2_ids: list[list[int]] = []
    prompt_token_ids: list[int] | None = None  # the prompt as the engine tokenized it (for teacher forcing)
    accepted_per_step: list[int] | None = None  # speculative: drafts accepted at each verify step, in order


class Usage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(_Reply):
    choices: list[Choice]
    mode_used: Literal["eager", "graph", "mixed"]
    usage: Usage


# ---------------------------------------------------------------- /qualify/reload


class ReloadRequest(_Msg):
    """path: a safetensors file to load in place; seed: fresh weights with that seed; neither: reload."""

    path: str | None = None
    seed: int | None = None

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v < 2**63):
            raise ValueError("seed must be in [0, 2**63)")
        return v


class Census(_Reply):
    params: int
    addresses_unchanged: bool
    changed: list[str]  # parameter names whose checksum changed
    before_digest: str
    after_digest: str
    arena_addresses_unchanged: bool
    # tensors a captured graph reads whose address differs from capture time (empty without graphs)
    graph_addresses_moved: list[str] = []


class ReloadResponse(_Reply):
    census: Census
    seconds: float
    weights_path: str


# ---------------------------------------------------------------- /qualify/kv-handles, kv-fill, kv-echo
# What a KV-transfer peer needs to import each group allocation, and the two calls that let the harness
# confirm the peer and the engine see the same bytes. The engine's spans are deliberately absent: the peer
# derives them from the geometry the harness asked for (docs/PEER.md).

KV_ALIGNMENT = 256  # every view and the probe page start on this many bytes
KV_PROBE_BYTES = 4096  # the page at the end of each allocation: engine-written half, peer-written half
# The most a launch document may ask an engine to wait for its weights file (LaunchWeights.wait_s).
WEIGHTS_WAIT_MAX_S = 3600.0
KV_ECHO_MAX_BYTES = 1 << 20  # the most bytes one kv-echo may hash


def pattern_bytes(nonce: str, n: int) -> bytes:
    """Deterministic bytes from a nonce (sha256 of `nonce:i`, i = 0, 1, ...): what kv-fill writes, and what
    the harness and the peer each compute for themselves to check it."""
    import hashlib

    out, i = bytearray(), 0
    while len(out) < n:
        out += hashlib.sha256(f"{nonce}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


class KvViewInfo(_Reply):
    layer: int
    name: str  # "state" | "conv" | "k" | "v"
    offset: int
    shape: list[int]
    dtype: str


class KvRegion(_Reply):
    offset: int
    nbytes: int


class KvHandle(_Reply):
    """One group allocation as a peer imports it. `handle` is {kind: "shm", path, nbytes} or the CUDA-IPC
    fields (kind "cuda-ipc", device_index, handle, storage_size_bytes, ...)."""

    name: str
    kind: Literal["kda", "attention"]
    layers: list[int]
    nbytes: int
    alignment: int
    device: dict
    handle: dict
    probe: KvRegion
    views: list[KvViewInfo]


class KvRankHandles(_Reply):
    """One DCP rank's allocations (distributed DCP: every rank registers its own)."""

    rank: int
    groups: list[KvHandle]


class KvHandles(_Reply):
    groups: list[KvHandle]  # the answering process's (rank 0's) allocations
    ranks: list[KvRankHandles] = []  # distributed DCP: every rank's, in rank order; empty when folded


class KvEchoRequest(_Msg):
    """Hash `length` bytes of a group's allocation at `offset`, as the engine reads them."""

    group: str
    offset: int = Field(ge=0)
    length: int = Field(ge=1, le=KV_ECHO_MAX_BYTES)
    rank: int = Field(0, ge=0, description="the DCP rank whose allocation (0 when folded)")


class KvFillRequest(_Msg):
    """Write pattern_bytes(nonce, length) into a group's probe page at `offset` (inside the page only)."""

    group: str
    offset: int = Field(ge=0)
    length: int = Field(ge=1, le=KV_PROBE_BYTES)
    nonce: str = Field(min_length=8, max_length=128)
    rank: int = Field(0, ge=0, description="the DCP rank whose allocation (0 when folded)")


class KvDigest(_Reply):
    group: str
    offset: int
    length: int
    sha256: str  # sha256:<hex> of the bytes as the engine reads them (echo) or wrote them (fill)


# ---------------------------------------------------------------- /qualify/sessions

# Live sequences held between decode steps, so that the harness's peer can change their exported memory
# between two steps and the harness can watch which outputs move (docs/PROTOCOL.md, docs/PEER.md).
SESSION_MAX_SEQUENCES = 64
SESSION_MAX_PROMPT_TOKENS = 4096
SESSION_TOP_K = 8  # logits reported per sequence and step: enough to see any change of the row


class SessionStartRequest(_Msg):
    """Admit and prefill these prompts and hold them live; `max_tokens` bounds the tokens each may generate
    (its KV blocks are reserved for prompt + max_tokens)."""

    prompts: list[list[int]] = Field(min_length=1, max_length=SESSION_MAX_SEQUENCES)
    max_tokens: int = Field(ge=1, le=256)

    @field_validator("prompts")
    @classmethod
    def _sizes(cls, v: list[list[int]]) -> list[list[int]]:
        for p in v:
            if not 1 <= len(p) <= SESSION_MAX_PROMPT_TOKENS:
                raise ValueError(f"every prompt needs 1..{SESSION_MAX_PROMPT_TOKENS} tokens")
        return v


class SessionStepRequest(_Msg):
    """One decode step of every sequence. `feed` (one token per sequence) replaces the token each sequence
    reads this step (its last token, whose K/V the step writes); without it each reads its own last one."""

    feed: list[int] | None = Field(None, max_length=SESSION_MAX_SEQUENCES)


class SessionSequence(_Reply):
    """One live sequence after prefill or a step: the token it produced, the top of its logits row, and the
    memory it holds (state slots and KV block ids: the engine's word, which the harness tests by effect)."""

    index: int
    token_id: int
    top_ids: list[int]  # the SESSION_TOP_K highest logits' token ids, best first
    top_logits: list[float]  # and their logits
    num_tokens: int  # prompt + generated tokens so far
    state_slots: list[int]  # KDA state slots, 1 + num_spec
    kv_blocks: list[int]  # attention KV block ids, in block-table order


class SessionState(_Reply):
    session: str
    mode_used: str = "eager"
    sequences: list[SessionSequence]


class SessionClosed(_Reply):
    session: str
    released: int  # sequences whose memory was freed


# ---------------------------------------------------------------- /qualify/capture, /qualify/probe


class CaptureResponse(_Reply):
    captured: bool
    reason: str | None = None
    sizes: list[int]
    pool_bytes: int
    seconds: float
    address_digest: str | None = None


class ProbeResponse(_Reply):
    kernel_names: list[str]
    backend: str
    device_type: str


# ---------------------------------------------------------------- the launch document and the manifest
# Before boot the harness reads the engine's manifest (`python -m MODULE manifest`: the model dimensions it
# chose, per preset, and the protocol versions it speaks), then writes ONE launch document and starts the
# engine with `serve --launch FILE`. Everything the checks later hold the engine to (the KV geometry, the
# per-group cache views, the capacities, the weights file, the scratch dir) is in that document, and the
# harness's expectations are derived from it, never from the reference engine's presets (docs/PROTOCOL.md).

LAUNCH_FLAG = "--launch"  # serve --launch FILE
MANIFEST_COMMAND = "manifest"  # python -m MODULE manifest: prints one EngineManifest as JSON
MAX_MANIFEST_BYTES = 64 * 1024
DTYPES = ("float32", "bfloat16", "float16")
# The state of every KDA layer is fp32, whatever the cache dtype (docs/LAYOUT.md).
KDA_STATE_DTYPE = "float32"


class ModelDims(_Msg):
    """The per-layer cache dimensions an engine chose for its model (what its caches' shapes follow from).
    The KDA state of a head is V x K with V = K = kda_head_dim."""

    kda_heads: int = Field(ge=1)
    kda_head_dim: int = Field(ge=1, description="K = V: the key and value dimension of a KDA head")
    conv_width: int = Field(ge=2, description="depthwise causal conv width; its cached state keeps width-1")
    attn_kv_heads: int = Field(ge=1)
    attn_head_dim: int = Field(ge=1)
    vocab: int = Field(ge=257, description="byte tokens 0..255 then the engine's specials")


class EngineManifest(_Reply):
    """What an engine declares before it is booted (`python -m MODULE manifest`)."""

    name: str
    version: str
    protocol_versions: list[str]
    presets: dict[str, ModelDims]  # the model an engine of each preset has
    kda_backends: list[str] = ["auto", "torch"]
    dcp_distributed: bool = False  # whether it runs dcp_ranks = dcp_size (one process per shard)


class LaunchGeometry(_Msg):
    """The KV geometry the harness asks for (docs/LAYOUT.md, docs/PEER.md)."""

    layer_pattern: str = Field(pattern=r"^[KA]+$", description="K = KDA layer, A = attention layer")
    group_size: int = Field(ge=1, description="layers of one kind per KV group allocation")
    block_size: int = Field(
        ge=1, description="tokens per block of a KDA group; per shard of an attention block"
    )
    dcp_size: int = Field(ge=1, description="decode-context-parallel shards of the attention KV")
    dcp_ranks: int = Field(ge=1, description="processes the shards run in: 1 (folded) or dcp_size")
    interleave: int = Field(1, ge=1, description="tokens dealt to a DCP shard at a time, round-robin")
    kv_dtype: Literal["float32", "bfloat16", "float16"]  # conv state, attention K and V
    alignment: int = KV_ALIGNMENT
    probe_bytes: int = KV_PROBE_BYTES


class LaunchCapacity(_Msg):
    """The capacity envelope. `slots` KDA state slots and `blocks` attention blocks per group follow from it
    (docs/PEER.md); a batch of more than max_num_seqs prompts is over capacity (409 CapacityError)."""

    max_num_seqs: int = Field(ge=1, description="requests live at once; more in one batch is refused")
    max_model_len: int = Field(ge=2, description="prompt + generated (+ num_spec) tokens of one request")
    max_num_batched_tokens: int = Field(ge=1, description="tokens one step may process")
    num_spec: int = Field(ge=0, le=8, description="speculative tokens per verify step (--spec mtp:N)")
    capture_sizes: list[int] | None = None  # graph sizes in tokens (multiples of 1 + num_spec); None: own


class LaunchView(_Msg):
    layer: int
    name: Literal["state", "conv", "k", "v"]
    offset: int
    shape: list[int]
    dtype: Literal["float32", "bfloat16", "float16"]


class LaunchGroup(_Msg):
    """One KV group allocation exactly as the harness's peer will expect it (per DCP rank)."""

    name: str
    kind: Literal["kda", "attention"]
    layers: list[int]
    span: int
    nbytes: int
    probe: KvRegion
    views: list[LaunchView]


class LaunchWeights(_Msg):
    """The weights file: load it; when it does not exist and `create` is true, write seeded weights there
    first (seed `seed`). The harness hashes this file (sha256 of its bytes) for the receipt's subject.
    `wait_s` (with `create` false): the harness may start the engine before the file is in place (it is
    seeding it), so the engine waits up to this many seconds for the file to appear before loading it; the
    file appears whole (it is renamed or linked into place)."""

    path: str
    seed: int = Field(0, ge=0)
    create: bool = True
    wait_s: float = Field(0.0, ge=0.0, le=WEIGHTS_WAIT_MAX_S)

    @model_serializer(mode="wrap")
    def _no_wait_unless_asked(self, handler: Any) -> Any:
        # wait_s is written only where the harness asks for a wait: a document without one reads as before
        # to an engine that checks its fields strictly against an earlier schema.
        out = handler(self)
        if isinstance(out, dict) and not self.wait_s:
            out.pop("wait_s", None)
        return out


class LaunchDocument(_Msg):
    """What `serve --launch FILE` reads: the whole configuration the harness asks the engine to be."""

    protocol_version: str
    preset: str
    model: ModelDims  # copied from the engine's manifest for the preset
    kda_decode_backend: str
    seed: int = Field(0, ge=0)
    geometry: LaunchGeometry
    capacity: LaunchCapacity
    kv_groups: list[LaunchGroup]  # as laid out on each rank (distributed DCP: every rank the same)
    weights: LaunchWeights
    scratch_dir: str  # the one directory the engine may write (seeded reloads write their weights here)


# ---------------------------------------------------------------- coherence rule (docs/generation.md)


Outcome = Literal["identical", "near_tie", "differs"]
Forcing = Literal["not_needed", "missing", "identical", "diverged"]


class CoherenceReport(_Reply):
    agrees: bool
    first_divergence: int | None
    gap: float | None  # the reference's top-2 gap at the first divergence
    rule: str
    epsilon: float
    outcome: Outcome = "differs"
    candidate_gap: float | None = None
    reason: str | None = None  # one line: why a divergence is (or is not) a near tie
    # teacher forcing after a near tie: not needed (nothing follows it), missing (no continuation given),
    # identical (the forced candidate continued exactly as the reference), diverged (it did not)
    forcing: Forcing | None = None


def coherence_rule_text(epsilon: float) -> str:
    return (
        "two greedy runs agree when their tokens are identical (identical), or when they differ once at a "
        "near tie (near_tie): at the first differing position both runs report the same two top tokens, "
        f"swapped, the reference's top-2 logit gap below epsilon={epsilon:g} and the two gaps summing below "
        "2 x epsilon (top-2 logits within epsilon of each other's explain the swap), and the candidate, fed "
        "the reference's tokens through that position (teacher forcing), continues exactly as the reference "
        "did; anything else differs"
    )


def _at(seq: list | None, i: int):
    return seq[i] if seq is not None and 0 <= i < len(seq) else None


def _gap_ok(g: float | None, epsilon: float) -> bool:
    return g is not None and math.isfinite(g) and 0 <= g < epsilon


def _near_tie_refusal(
    d: int,
    ref_tok: int,
    cand_tok: int,
    ref_gap: float | None,
    cand_gap: float | None,
    ref_pair: list | None,
    cand_pair: list | None,
    epsilon: float,
) -> str | None:
    """Why the divergence at d is not a near tie (None when it is one, before teacher forcing)."""
    if ref_pair is None or cand_pair is None:
        side = "reference" if ref_pair is None else "candidate"
        return f"token {d}: the {side} reports no top-2 token ids, so no near tie can be shown"
    if list(ref_pair) != [ref_tok, cand_tok] or list(cand_pair) != [cand_tok, ref_tok]:
        return (
            f"token {d}: top-2 ids {list(ref_pair)} (reference) and {list(cand_pair)} (candidate) are not "
            f"the swapped pair [{ref_tok}, {cand_tok}] / [{cand_tok}, {ref_tok}]"
        )
    if not _gap_ok(ref_gap, epsilon):
        return f"token {d}: the reference's gap {ref_gap} is not below epsilon"
    # A swap needs the two runs' top-2 logits to differ by (ref_gap + cand_gap) / 2 on average: within
    # epsilon, it is what numerics of bf16 logits explain (the H200's b12x replay vs eager once swapped a
    # pair at gaps 0.0017 / 0.084).
    if not (_gap_ok(cand_gap, 2 * epsilon) and ref_gap + cand_gap < 2 * epsilon):
        return (
            f"token {d}: gaps {ref_gap} (reference) and {cand_gap} (candidate) do not sum below "
            f"2 x epsilon, so numerics within epsilon do not explain the swap"
        )
    return None


def compare_greedy(
    reference_tokens: list[int],
    reference_gaps: list[float],
    candidate_tokens: list[int],
    epsilon: float,
    *,
    reference_top2: list[list[int]] | None = None,
    candidate_gaps: list[float] | None = None,
    candidate_top2: list[list[int]] | None = None,
    forced_continuation: list[int] | None = None,
) -> CoherenceReport:
    """Coherence of a candidate greedy run against a reference run (the rule in `coherence_rule_text`).

    Both sides' top-2 ids and gaps are needed for a near tie; without them only identity agrees. After a
    near tie at d, `forced_continuation` is what the candidate generated when its prompt was extended by
    reference_tokens[:d + 1]; it must equal reference_tokens[d + 1:] (a second divergence never agrees).
    A length mismatch is a difference at the shorter length, never a near tie.
    """
    if epsilon < 0 or math.isnan(epsilon):
        raise ValueError("epsilon must be a non-negative number")
    rule = coherence_rule_text(epsilon)
    base = {"rule": rule, "epsilon": epsilon}
    n = min(len(reference_tokens), len(candidate_tokens))
    d = next((i for i in range(n) if reference_tokens[i] != candidate_tokens[i]), None)
    if d is None and len(reference_tokens) == len(candidate_tokens):
        return CoherenceReport(agrees=True, first_divergence=None, gap=None, outcome="identical", **base)
    if d is None:
        why = f"lengths differ ({len(reference_tokens)} reference, {len(candidate_tokens)} candidate tokens)"
        return CoherenceReport(agrees=False, first_divergence=n, gap=None, reason=why, **base)
    ref_gap, cand_gap = _at(reference_gaps, d), _at(candidate_gaps, d)
    found = {
        "first_divergence": d,
        "gap": None if ref_gap is None else float(ref_gap),
        "candidate_gap": None if cand_gap is None else float(cand_gap),
    }
    why = _near_tie_refusal(
        d,
        reference_tokens[d],
        candidate_tokens[d],
        ref_gap,
        cand_gap,
        _at(reference_top2, d),
        _at(candidate_top2, d),
        epsilon,
    )
    if why is not None:
        return CoherenceReport(agrees=False, reason=why, **found, **base)
    rest = reference_tokens[d + 1 :]
    if not rest:
        why = f"near tie at token {d}, the last one: nothing follows to force"
        return CoherenceReport(
            agrees=True, outcome="near_tie", reason=why, forcing="not_needed", **found, **base
        )
    if forced_continuation is None:
        why = f"near tie at token {d} not confirmed: no teacher-forced continuation"
        return CoherenceReport(agrees=False, reason=why, forcing="missing", **found, **base)
    if list(forced_continuation) != rest:
        k = next((i for i, (a, b) in enumerate(zip(rest, forced_continuation, strict=False)) if a != b), None)
        at = d + 1 + (k if k is not None else min(len(rest), len(forced_continuation)))
        why = f"near tie at token {d}, but forced through it the candidate diverges again at token {at}"
        return CoherenceReport(agrees=False, reason=why, forcing="diverged", **found, **base)
    pair = f"{reference_tokens[d]}/{candidate_tokens[d]}"
    why = f"near tie at token {d} (tokens {pair} swapped); forced through it, continues identically"
    return CoherenceReport(agrees=True, outcome="near_tie", reason=why, forcing="identical", **found, **base)


__all__ = [
    "CAPACITY_ERROR",
    "DCP_RANK_LOST",
    "PROTOCOL_VERSION",
    "ArenaBufferInfo",
    "BackendInfo",
    "CapacityInfo",
    "CaptureResponse",
    "Census",
    "Choice",
    "CoherenceReport",
    "CompletionRequest",
    "CompletionResponse",
    "Counters",
    "Describe",
    "DcpRankInfo",
    "DeviceInfo",
    "EngineInfo",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "KV_ALIGNMENT",
    "KV_ECHO_MAX_BYTES",
    "KV_PROBE_BYTES",
    "KvDigest",
    "KvEchoRequest",
    "KvFillRequest",
    "KvGroupInfo",
    "KvHandle",
    "KvHandles",
    "KvRankHandles",
    "KvRegion",
    "KvViewInfo",
    "LayoutInfo",
    "ProbeResponse",
    "ReloadRequest",
    "ReloadResponse",
    "SessionClosed",
    "SessionSequence",
    "SessionStartRequest",
    "SessionState",
    "SessionStepRequest",
    "Usage",
    "compare_greedy",
    "dcp_ranks_lost",
    "pattern_bytes",
    "coherence_rule_text",
    "DTYPES",
    "EngineManifest",
    "KDA_STATE_DTYPE",
    "LAUNCH_FLAG",
    "LaunchCapacity",
    "LaunchDocument",
    "LaunchGeometry",
    "LaunchGroup",
    "LaunchView",
    "LaunchWeights",
    "MANIFEST_COMMAND",
    "MAX_MANIFEST_BYTES",
    "ModelDims",
    "SUPPORTED_PROTOCOL_VERSIONS",
    "tree_digest",
    "package_digest",
]
