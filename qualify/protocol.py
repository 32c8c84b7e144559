"""The engine protocol (DESIGN §5): pydantic messages shared by the harness and the engine, no torch.

Also the coherence rule of two greedy runs (DESIGN §4), implemented once here for both sides.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator

PROTOCOL_VERSION = "1"
CAPACITY_ERROR = "CapacityError"


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


class Describe(_Reply):
    engine: EngineInfo
    config: dict
    config_digest: str
    backend: BackendInfo
    layout: LayoutInfo
    dcp_mode: Literal["folded"] = "folded"
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


# ---------------------------------------------------------------- /qualify/peer-verify


class PeerGroupResult(_Reply):
    name: str
    nbytes_ok: bool
    alignment_ok: bool
    device_ok: bool
    pattern_ok: bool
    ack_ok: bool
    out_of_bounds_refused: bool
    span_ok: bool  # the span the peer derived from block_size/dcp_size equals the registered one


class PeerVerifyResponse(_Reply):
    ok: bool
    layout_seen: list[int]
    groups: list[PeerGroupResult]
    seconds: float
    error: str | None = None


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


# ---------------------------------------------------------------- coherence rule (DESIGN §4)


class CoherenceReport(_Reply):
    agrees: bool
    first_divergence: int | None
    gap: float | None
    rule: str
    epsilon: float


def coherence_rule_text(epsilon: float) -> str:
    return (
        "two greedy runs agree when their tokens are identical, or when at the first differing position "
        f"the reference's top-2 logit gap is below epsilon={epsilon:g} (a near tie); "
        "after a near tie the continuations are not compared"
    )


def compare_greedy(
    reference_tokens: list[int],
    reference_gaps: list[float],
    candidate_tokens: list[int],
    epsilon: float,
) -> CoherenceReport:
    """Coherence of a candidate greedy run against a reference run.

    A length mismatch counts as a difference at the shorter length; there is no reference gap for a
    position the reference never generated, so such a difference cannot be a near tie.
    """
    if epsilon < 0 or math.isnan(epsilon):
        raise ValueError("epsilon must be a non-negative number")
    rule = coherence_rule_text(epsilon)
    n = min(len(reference_tokens), len(candidate_tokens))
    first: int | None = None
    for i in range(n):
        if reference_tokens[i] != candidate_tokens[i]:
            first = i
            break
    if first is None and len(reference_tokens) != len(candidate_tokens):
        first = n
    if first is None:
        return CoherenceReport(agrees=True, first_divergence=None, gap=None, rule=rule, epsilon=epsilon)
    gap = (
        float(reference_gaps[first])
        if first < len(reference_gaps) and first < len(reference_tokens)
        else None
    )
    near_tie = (
        gap is not None and first < len(reference_tokens) and first < len(candidate_tokens) and gap < epsilon
    )
    return CoherenceReport(agrees=near_tie, first_divergence=first, gap=gap, rule=rule, epsilon=epsilon)


__all__ = [
    "CAPACITY_ERROR",
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
    "DeviceInfo",
    "EngineInfo",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "KvGroupInfo",
    "LayoutInfo",
    "PeerGroupResult",
    "PeerVerifyResponse",
    "ProbeResponse",
    "ReloadRequest",
    "ReloadResponse",
    "Usage",
    "compare_greedy",
    "coherence_rule_text",
]
