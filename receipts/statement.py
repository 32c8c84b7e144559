"""In-toto Statement v1 and the qualification predicate a receipt carries (pydantic models, JSON Schema).

Every field an auditor's CEL policy reads is a plain JSON type: strings, numbers, booleans, lists, objects.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from receipts.canonical import canonical_json, loads, sha256_hex
from receipts.errors import VerificationError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://qualify.dev/qualification/v1"

# Lengths of the hex digests in-toto names; other algorithms are accepted as non-empty strings.
_HEX_DIGEST_LENGTHS = {"sha1": 40, "sha224": 56, "sha256": 64, "sha384": 96, "sha512": 128}
_SHA256_REF = r"^sha256:[0-9a-f]{64}$"

CheckStatus = Literal["pass", "fail", "skip", "error"]
Verdict = Literal["qualified", "rejected", "aborted"]
# Where a condition's observation comes from, strongest first: measured by the harness (or a process it
# launched that is not the engine), computed by the harness from observed values, recorded inside the
# engine process by the harness's own monitor (CUPTI: not the engine's code, but its address space), or the
# engine's own word.
Source = Literal["observed", "derived", "monitored", "engine"]
SOURCES: tuple[str, ...] = ("observed", "derived", "monitored", "engine")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _utc(value: datetime | None) -> datetime | None:
    # Normalise every timestamp to UTC so it serialises as ISO 8601 with 'Z'.
    return None if value is None else value.astimezone(UTC)


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 time ('Z' allowed) as an aware datetime, UTC when it names no offset; None when `value`
    is not such a string (readers of stored predicates must not fail on one bad receipt)."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def config_digest(config: dict[str, Any]) -> str:
    """ "sha256:<hex>" of the RFC 8785 bytes of an engine config; what `EngineInfo.config_digest` must be."""
    return "sha256:" + sha256_hex(config)


# --------------------------------------------------------------------------- in-toto Statement v1


class Subject(_Model):
    """An artifact the statement is about: a name and its digests (in-toto ResourceDescriptor subset)."""

    name: str = Field(min_length=1)
    digest: dict[str, str] = Field(min_length=1)

    @field_validator("digest")
    @classmethod
    def _hex_digests(cls, digest: dict[str, str]) -> dict[str, str]:
        for algorithm, value in digest.items():
            length = _HEX_DIGEST_LENGTHS.get(algorithm)
            if length is not None and not re.fullmatch(f"[0-9a-f]{{{length}}}", value):
                raise ValueError(f"{algorithm} digest must be {length} lower-case hex characters")
            if not value:
                raise ValueError(f"{algorithm} digest is empty")
        return digest


# --------------------------------------------------------------------------- qualification predicate


class RequestInfo(_Model):
    """What the operator asked for (the `qualify run` options after validation)."""

    layout: list[PositiveInt] | None = Field(None, description="spans demanded by --layout; null: any")
    kda_backend: Literal["auto", "b12x", "triton", "torch"] = "auto"
    spec: str = Field("none", pattern=r"^(none|mtp:[1-9][0-9]*)$", description='"none" or "mtp:N"')
    preset: str | None = None
    launcher: Literal["local", "docker"] = "local"
    image: str | None = Field(None, description="image reference as given (docker launcher)")
    gpus: str | None = Field(None, description='"all", a comma list of indices, or null for none')
    timeout_s: NonNegativeFloat | None = None
    dcp: PositiveInt | None = Field(None, description="DCP ranks, one process each; null: folded")
    sandbox: bool | None = Field(
        None, description="false: --no-sandbox, the engine ran as the operator's own process; null: older"
    )
    engine_env: dict[str, str] | None = Field(
        None, description="variables the operator added to the engine's environment (--engine-env)"
    )
    fail_fast: bool | None = Field(
        None, description="true: --fail-fast, no check ran after the first that did not pass"
    )


class EngineInfo(_Model):
    """Which engine build was qualified: the identity the subjects carry, plus its configuration."""

    name: str
    version: str | None = None
    image_digest: str | None = Field(None, pattern=_SHA256_REF, description="docker: the image id")
    code_digest: str | None = Field(None, pattern=_SHA256_REF, description="local: installed code + weights")
    code_scope: str | None = Field(
        None, max_length=1000, description="what code_digest covers and who computed it (harness or engine)"
    )
    config_digest: str = Field(pattern=_SHA256_REF, description="sha256 of the RFC 8785 bytes of config")
    config: dict[str, Any] = Field(
        description="the configuration the harness sent the engine (its launch options), digested by it"
    )
    described_config: dict[str, Any] | None = Field(
        None, description="the engine's own account of its full configuration (its word; boot compares it)"
    )
    sandbox: dict[str, Any] | None = Field(
        None,
        description="where the engine ran: tool, identity, namespaces, mounts, writable paths, network, "
        "its whole environment (docs/SANDBOX.md); enabled false with why when it ran unsandboxed",
    )
    protocol_version: str | None = Field(
        None, max_length=16, description="the engine protocol version the engine reported (docs/PROTOCOL.md)"
    )
    launch: dict[str, Any] | None = Field(
        None, description="the launch document the harness wrote and passed (`serve --launch FILE`)"
    )
    launch_digest: str | None = Field(None, pattern=_SHA256_REF, description="sha256 of its RFC 8785 bytes")
    manifest: dict[str, Any] | None = Field(
        None, description="the engine manifest the harness read before boot (`python -m MODULE manifest`)"
    )

    @model_validator(mode="after")
    def _identity(self) -> EngineInfo:
        if self.image_digest is None and self.code_digest is None:
            raise ValueError("engine needs an image_digest (docker) or a code_digest (local)")
        expected = config_digest(self.config)
        if self.config_digest != expected:
            raise ValueError(f"config_digest {self.config_digest} does not match the config ({expected})")
        return self


class BackendInfo(_Model):
    """The KDA backend: requested, resolved once at construction and why, and the kernels seen running."""

    requested: str
    resolved: str | None = None
    reason: str | None = None
    kernel_names: list[str] = Field(default_factory=list)


class LayoutGroup(_Model):
    index: NonNegativeInt
    kind: Literal["kda", "attention"]
    layers: list[NonNegativeInt]
    span: PositiveInt
    nbytes: NonNegativeInt | None = None


class LayoutInfo(_Model):
    """The KV layout the engine registered and the peer's verification of it."""

    spans: list[PositiveInt]
    chunk: PositiveInt
    ratios: list[PositiveInt]
    groups: list[LayoutGroup] = Field(default_factory=list)
    peer_verified: bool


class Condition(_Model):
    """One thing a check demands, whether it held, and how the harness knows (its source)."""

    holds: bool
    source: Source = Field(
        description="observed (harness-measured) | derived (from observed) | monitored (recorded inside the "
        "engine process by the harness's CUDA activity monitor) | engine (its word)"
    )
    detail: str | None = Field(None, max_length=2000, description="what was seen, e.g. what differed")


class CheckResult(_Model):
    """One check's outcome, its conditions (each with its source), its evidence (plain JSON) and wall time."""

    name: str = Field(min_length=1)
    status: CheckStatus
    conditions: dict[str, Condition] = Field(
        default_factory=dict, description="condition name -> holds, source, detail"
    )
    evidence: dict[str, Any] = Field(default_factory=dict)
    seconds: NonNegativeFloat
    reason: str | None = Field(None, description="why it failed, errored or was skipped")

    @model_validator(mode="after")
    def _status_follows_conditions(self) -> CheckResult:
        if self.status == "pass":
            broken = [name for name, c in self.conditions.items() if not c.holds]
            if broken:
                raise ValueError(f"check {self.name} passed with conditions that do not hold: {broken}")
        return self


class XidEvent(_Model):
    code: int
    fatal: bool
    source: str = Field(description='"nvml" or "kmsg"')
    line: str | None = Field(None, description="the kernel-log line, when read from one")
    time: AwareDatetime | None = None

    @field_validator("time")
    @classmethod
    def _time_in_utc(cls, value: datetime | None) -> datetime | None:
        return _utc(value)


class OomInfo(_Model):
    container: bool = Field(False, description="the container was killed for memory (docker)")
    cuda_oom_count: NonNegativeInt = 0
    # Optional (added after 0.1.0 receipts): a SIGKILLed local engine looks the same whether the kernel's OOM
    # killer or a person sent the signal; only the kernel's own record tells them apart.
    kernel: Literal["observed", "unknown"] | None = Field(
        None,
        description="an engine was killed by signal 9: observed = the kernel's OOM-kill record (kernel log "
        "or cgroup memory.events) names it; unknown = no such record; null = no engine was SIGKILLed",
    )


# Exit statuses of an engine the harness stopped: none recorded, a clean exit, or death by the signal the
# harness sent (SIGTERM, then SIGKILL after the grace period), as Popen (negative) or docker (128+n) reports.
CLEAN_STOP_EXIT_CODES: frozenset[int | None] = frozenset({None, 0, -15, 143, -9, 137})


class Faults(_Model):
    restart_count: NonNegativeInt = 0
    xid_events: list[XidEvent] = Field(default_factory=list)
    # active: a live source (NVML registered on every GPU, or the kernel log being read) watched the whole
    # run; replayed: a recorded kernel log was read (tests and CPU targets only, never a live watch);
    # not_applicable: no NVIDIA GPU on the host; unavailable: a GPU host where no live source was watched,
    # or the one that was failed mid-run (a GPU target cannot qualify unless the watch is active)
    xid_watch: Literal["active", "replayed", "not_applicable", "unavailable"]
    xid_watch_reason: str | None = Field(None, description="why the Xid watcher could not run, if so")
    xid_watch_lost_at: AwareDatetime | None = Field(
        None, description="when a live Xid source failed mid-run (unavailable from then on)"
    )
    oom: OomInfo = Field(default_factory=OomInfo)
    engine_dead: bool = False
    # Optional (added after 0.1.0 receipts): how each engine incarnation ended, in words.
    engine_exits: list[str] = Field(
        default_factory=list, description='e.g. "killed by signal 9 (SIGKILL)", "exited with code 3"'
    )
    stop_exit_code: int | None = Field(
        None,
        description="the engine's exit status when the harness stopped it; 0, or death by the harness's "
        "SIGTERM/SIGKILL (-15/143, -9/137), is a clean stop; anything else is a fault",
    )

    @field_validator("xid_watch_lost_at")
    @classmethod
    def _lost_in_utc(cls, value: datetime | None) -> datetime | None:
        return _utc(value)

    def blocking(self, target: str) -> list[str]:
        """The faults that keep a run from qualifying, in words; empty when none. The one place that says
        what the faults block forbids: the run's verdict and the receipt validator both ask it."""
        out: list[str] = []
        if self.restart_count:
            out.append(f"engine restarted {self.restart_count} time(s)")
        fatal = sorted({e.code for e in self.xid_events if e.fatal})
        if fatal:
            out.append("fatal Xid " + ", ".join(str(c) for c in fatal))
        if self.oom.container:
            out.append("container killed for memory (OOM)")
        if self.oom.cuda_oom_count:
            out.append(f"CUDA out of memory {self.oom.cuda_oom_count} time(s)")
        if self.engine_dead:
            out.append("engine dead before the run ended")
        if self.stop_exit_code not in CLEAN_STOP_EXIT_CODES:
            out.append(
                f"engine exited with status {self.stop_exit_code} when stopped, not by its stop signal"
            )
        if target == "gpu" and self.xid_watch != "active":
            out.append(f"Xid watch {self.xid_watch} on a gpu target")
        return out


class HostInfo(_Model):
    hostname: str
    os: str
    kernel: str
    arch: str | None = None


class GpuInfo(_Model):
    name: str
    index: NonNegativeInt | None = None
    uuid: str | None = None
    memory_mib: NonNegativeInt | None = None
    compute_capability: str | None = None


class QualificationPredicate(_Model):
    """The body of a receipt. Parts the run never reached (an aborted boot) are null, never invented."""

    request: RequestInfo
    engine: EngineInfo
    backend: BackendInfo | None = None
    layout: LayoutInfo | None = None
    checks: list[CheckResult] = Field(default_factory=list)
    faults: Faults
    verdict: Verdict
    target: Literal["cpu", "gpu"]
    host: HostInfo
    gpu: list[GpuInfo] = Field(default_factory=list)
    driver: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    started_at: AwareDatetime
    finished_at: AwareDatetime
    qualify_version: str

    @field_validator("started_at", "finished_at")
    @classmethod
    def _times_in_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @model_validator(mode="after")
    def _consistent(self) -> QualificationPredicate:
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")
        names = [check.name for check in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"check names repeat: {names}")
        if self.verdict == "qualified":
            # A qualified receipt with a failed check would be a harness bug that a policy could miss.
            bad = [check.name for check in self.checks if check.status in ("fail", "error")]
            if not self.checks or bad:
                raise ValueError(f"verdict qualified needs checks and none failed (failed: {bad})")
            faults = self.faults.blocking(self.target)
            if faults:
                raise ValueError(f"verdict qualified disagrees with the faults block: {'; '.join(faults)}")
        return self


class Statement(_Model):
    """in-toto Statement v1. For our predicate type, `predicate` is a `QualificationPredicate`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type_: Literal["https://in-toto.io/Statement/v1"] = Field(STATEMENT_TYPE, alias="_type")
    subject: list[Subject] = Field(min_length=1)
    predicateType: str = Field(min_length=1)  # the in-toto field name, camelCase
    predicate: dict[str, Any] | QualificationPredicate

    @model_validator(mode="before")
    @classmethod
    def _typed_predicate(cls, data: Any) -> Any:
        # The predicate's model depends on predicateType, a sibling field, so pick it here; errors keep
        # their path under "predicate." so a person can find the bad field.
        if not isinstance(data, dict):
            return data
        ours = data.get("predicateType") == PREDICATE_TYPE
        predicate = data.get("predicate")
        if ours and isinstance(predicate, dict):
            try:
                predicate = QualificationPredicate.model_validate(predicate)
            except ValidationError as exc:
                raise ValidationError.from_exception_data(
                    cls.__name__,
                    [
                        {
                            "type": error["type"],
                            "loc": ("predicate", *error["loc"]),
                            "input": error["input"],
                            "ctx": error.get("ctx", {}),
                        }
                        for error in exc.errors()
                    ],
                ) from None
            return {**data, "predicate": predicate}
        if not ours and isinstance(predicate, QualificationPredicate):
            raise ValueError(f"a qualification predicate needs predicateType {PREDICATE_TYPE}")
        return data

    @property
    def qualification(self) -> QualificationPredicate:
        """The typed predicate; VerificationError if this statement is not a qualification receipt."""
        if not isinstance(self.predicate, QualificationPredicate):
            raise VerificationError(
                f"statement has predicateType {self.predicateType}, not a qualification ({PREDICATE_TYPE})"
            )
        return self.predicate

    def to_json(self) -> dict[str, Any]:
        """Plain JSON value, by alias (`_type`), timestamps as ISO 8601 'Z'."""
        return self.model_dump(mode="json", by_alias=True)


# --------------------------------------------------------------------------- helpers


def build_statement(predicate: QualificationPredicate, subjects: list[Subject]) -> Statement:
    """A Statement of our predicate type about `subjects` (engine image/code digest, config digest)."""
    return Statement(subject=subjects, predicateType=PREDICATE_TYPE, predicate=predicate)


def statement_bytes(statement: Statement) -> bytes:
    """The RFC 8785 bytes of a statement: the DSSE payload a receipt signs."""
    return canonical_json(statement.to_json())


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two JSON parsers may keep different copies of a repeated key; a signed payload must mean one thing.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _summarise(exc: ValidationError, limit: int = 3) -> str:
    errors = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in errors[:limit]]
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(parts) + more


def parse_statement(payload: bytes | str) -> Statement:
    """Parse and validate a statement payload; VerificationError (one line) on anything malformed."""
    return parse_statement_data(payload)[0]


def parse_statement_data(payload: bytes | str) -> tuple[Statement, dict[str, Any]]:
    """parse_statement, and the JSON object it validated (left as parsed: the signed values)."""
    try:
        data = loads(payload, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise VerificationError(f"statement is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise VerificationError("statement must be a JSON object (an in-toto Statement v1)")
    try:
        return Statement.model_validate(data), data
    except ValidationError as exc:
        raise VerificationError(f"statement is not a valid in-toto Statement v1: {_summarise(exc)}") from exc


def _with_meta(schema: dict[str, Any], schema_id: str) -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema_id, **schema}


def predicate_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of the qualification predicate; its $id is the predicate type."""
    return _with_meta(QualificationPredicate.model_json_schema(by_alias=True), PREDICATE_TYPE)


def statement_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a receipt statement; our predicate type requires our predicate schema."""
    schema = Statement.model_json_schema(by_alias=True)
    schema["allOf"] = [
        {
            "if": {"properties": {"predicateType": {"const": PREDICATE_TYPE}}, "required": ["predicateType"]},
            "then": {"properties": {"predicate": {"$ref": "#/$defs/QualificationPredicate"}}},
        }
    ]
    return _with_meta(schema, STATEMENT_TYPE)
