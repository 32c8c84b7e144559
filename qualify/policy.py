"""Rollout policies: the pydantic model and the TOML/YAML/JSON loader (bounded in size and depth, duplicate
keys refused) whose errors name line and column; the CEL conditions are compiled by qualify.cel."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from qualify.cel import Budget, CelCompileError, Condition, CostLimitError, compile_condition
from qualify.errors import UsageError
from qualify.limits import MAX_POLICY_BYTES, read_text_limited
from receipts.canonical import MAX_DEPTH, loads, nesting_depth, sha256_hex

__all__ = [
    "Budget",
    "CelCompileError",
    "Condition",
    "CostLimitError",
    "LoadedPolicy",
    "Policy",
    "PolicyError",
    "compile_condition",
    "load_policy",
    "load_policy_data",
    "parse_policy_text",
]

# Units a max_age may use; compound values ("1d12h") add up.
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^(?:\d+[smhdw])+$")
_KEYID = re.compile(r"^[0-9a-f]{64}$")
_CONDITION_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# No receipt is trusted for longer than ten years; longer ages are typos (and overflow a timedelta).
MAX_AGE_DAYS = 3650
MAX_HOSTS = 10_000
# The settings that judge a receipt; a policy must state at least one (`name` and `mode` judge nothing).
REQUIREMENTS = (
    "verdict",
    "conditions",
    "max_age",
    "min_hosts",
    "trusted_keyids",
    "require_observed",
    "require_monitored",
)
# "check.condition" with shell wildcards on either side, e.g. "layout.peer_*" or "generation.*"
_OBSERVED_PATTERN = re.compile(r"^[A-Za-z0-9_*?\[\]!-]+\.[A-Za-z0-9_*?\[\]!-]+$")


class PolicyError(UsageError):
    """A policy that does not parse, validate or compile; the message names the place (line, column)."""


def parse_duration(text: str) -> timedelta:
    """'7d', '12h', '90m', '1w', '1d12h', '3600s' -> timedelta; ValueError for anything else."""
    text = text.strip()
    shown = text if len(text) <= 40 else text[:40] + "…"
    if not _DURATION.match(text):
        raise ValueError(f"duration {shown!r} must look like 7d, 12h, 30m, 1w or 1d12h (units s m h d w)")
    parts = re.findall(r"(\d+)([smhdw])", text)
    too_long = ValueError(f"duration {shown!r} is longer than {MAX_AGE_DAYS}d (ten years)")
    if any(len(number) > 12 for number, _ in parts):
        raise too_long
    seconds = sum(int(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"duration {shown!r} must be longer than zero")
    if seconds > MAX_AGE_DAYS * 86400:
        raise too_long
    return timedelta(seconds=seconds)


class Policy(BaseModel):
    """A rollout policy. Every field is optional except at least one way to judge a receipt."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=200, description="a label for people; not used in the decision")
    verdict: Literal["qualified", "rejected", "aborted"] = Field(
        "qualified", description="the verdict a receipt must carry to count"
    )
    conditions: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict,
        max_length=100,
        description="name -> CEL expression over `receipt` (the receipt's predicate); each must be true",
    )
    max_age: str | None = Field(
        None,
        description="receipts older than this (by finished_at) do not count: 7d, 12h, 30m, 1w, 1d12h",
    )
    min_hosts: PositiveInt = Field(
        1,
        le=MAX_HOSTS,
        description="how many qualifying receipts from distinct hosts (host.hostname) are needed",
    )
    trusted_keyids: list[str] | None = Field(
        None,
        max_length=100,
        description="signer key ids (hex sha256) whose receipts count; null: any key the log trusts",
    )
    mode: Literal["enforce", "warn"] = Field(
        "enforce", description="warn: a denial is reported and recorded as 'warn' but does not block"
    )
    require_observed: list[Annotated[str, Field(max_length=200)]] = Field(
        default_factory=list,
        max_length=100,
        description='"check.condition" shell patterns (e.g. "layout.peer_*"): each must match a condition '
        "in the receipt, and every condition it matches must hold with source `observed`",
    )
    require_monitored: list[Annotated[str, Field(max_length=200)]] = Field(
        default_factory=list,
        max_length=100,
        description='"check.condition" shell patterns (e.g. "monitor.capture_*"): each must match a '
        "condition in the receipt, and every condition it matches must hold with source `monitored` "
        "(recorded inside the engine process by the harness's CUDA activity monitor) or `observed`",
    )

    @field_validator("max_age")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @field_validator("conditions")
    @classmethod
    def _condition_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, expr in value.items():
            if not _CONDITION_NAME.match(name):
                raise ValueError(f"condition name {name!r} may use only letters, digits, '_', '.', '-'")
            if not expr.strip():
                raise ValueError(f"condition {name!r} is empty")
        return value

    @field_validator("require_observed", "require_monitored")
    @classmethod
    def _observed_patterns(cls, value: list[str], info: Any) -> list[str]:
        for pattern in value:
            if not _OBSERVED_PATTERN.match(pattern):
                raise ValueError(
                    f"{info.field_name} pattern {pattern!r} must look like check.condition "
                    "(letters, digits, '_', '-', and the wildcards * ? [ ] !)"
                )
        return value

    @field_validator("trusted_keyids")
    @classmethod
    def _keyids(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for keyid in value:
            if not _KEYID.match(keyid):
                raise ValueError(f"trusted key id {keyid!r} must be 64 lower-case hex characters")
        if not value:
            raise ValueError("trusted_keyids is empty, so no receipt could count; omit it to trust the log")
        return value

    @property
    def max_age_delta(self) -> timedelta | None:
        return None if self.max_age is None else parse_duration(self.max_age)

    def digest(self) -> str:
        """'sha256:<hex>' of the RFC 8785 bytes of the policy: the same for a TOML, YAML or JSON spelling."""
        data = self.model_dump(mode="json")
        for optional in ("require_observed", "require_monitored"):
            if not data[optional]:
                del data[optional]  # a policy without it keeps the digest it had before the field existed
        return "sha256:" + sha256_hex(data)


def policy_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a policy file."""
    schema = Policy.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedPolicy:
    """A validated policy with its compiled conditions and digest."""

    policy: Policy
    conditions: tuple[Condition, ...]
    source: str  # where it came from, for messages

    @property
    def digest(self) -> str:
        return self.policy.digest()


def _locate(text: str, needle: str) -> tuple[int, int] | None:
    """1-based (line, column) of the first verbatim occurrence of `needle` in `text`."""
    offset = text.find(needle)
    if offset < 0:
        return None
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


def _cel_location(text: str, name: str, expr: str, err: CelCompileError) -> str:
    # Point into the file when the expression appears there verbatim (the usual case with TOML literal
    # strings); otherwise name the condition's key line and the column within the expression.
    start = _locate(text, expr) if text else None
    if start is not None:
        line = start[0] + err.line - 1
        column = (start[1] if err.line == 1 else 1) + err.column - 1
        return f"line {line}, column {column}"
    key = _locate(text, name) if text else None
    where = f"line {key[0]}, " if key else ""
    return f"{where}column {err.column} of the expression"


def _validation_message(source: str, text: str, exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        loc = ".".join(str(p) for p in error["loc"]) or "(top)"
        msg = error["msg"].removeprefix("Value error, ")
        key = _locate(text, str(error["loc"][-1])) if text and error["loc"] else None
        where = f" (line {key[0]}, column {key[1]})" if key else ""
        parts.append(f"{loc}{where}: {msg}")
    more = f" (and {len(exc.errors()) - 3} more)" if len(exc.errors()) > 3 else ""
    return f"policy {source} is invalid: " + "; ".join(parts) + more


_SET_ONE = (
    "set at least one of conditions, verdict, max_age, min_hosts or trusted_keyids "
    "(an empty policy would approve any build with a receipt)"
)


def load_policy_data(data: Any, source: str = "policy", text: str = "") -> LoadedPolicy:
    """Validate a parsed policy (a dict) and compile its conditions; PolicyError names line and column.
    A policy must state at least one requirement (REQUIREMENTS): an empty one is bad input."""
    if data is None:
        raise PolicyError(f"policy {source} is empty; {_SET_ONE}")
    if not isinstance(data, dict):
        raise PolicyError(f"policy {source} must be a table/mapping of settings, got {type(data).__name__}")
    if nesting_depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise PolicyError(f"policy {source} is nested more than {MAX_DEPTH} deep")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(_validation_message(source, text, exc)) from None
    if not any(key in data for key in REQUIREMENTS if key != "conditions") and not policy.conditions:
        raise PolicyError(f"policy {source} states no requirement; {_SET_ONE}")
    compiled = []
    for name, expr in policy.conditions.items():
        try:
            compiled.append(compile_condition(name, expr))
        except CelCompileError as err:
            where = _cel_location(text, name, expr, err)
            raise PolicyError(
                f"policy {source} {where}: condition {name!r} does not compile: {err.message}"
            ) from None
    return LoadedPolicy(policy=policy, conditions=tuple(compiled), source=source)


class _StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a repeated key (not last-wins) and aliases (no expansion bombs)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a policy", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class refuses it with its place
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _json_pairs(text: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                found = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
                line = f" at line {text.count(chr(10), 0, found[1]) + 1}" if len(found) > 1 else ""
                raise ValueError(f"duplicate key {key!r}{line}")
            result[key] = value
        return result

    return no_duplicates


def parse_policy_text(
    text: str, fmt: Literal["toml", "yaml", "json"], source: str = "policy"
) -> LoadedPolicy:
    """Parse policy text in the given format, then validate and compile it. Refused (PolicyError, one line):
    empty text, repeated keys, values nested more than MAX_DEPTH deep and integers over 4300 digits."""
    if not text.strip():
        raise PolicyError(f"policy {source} is empty; {_SET_ONE}")
    try:
        if fmt == "toml":
            data: Any = tomllib.loads(text)
        elif fmt == "yaml":
            data = yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
        else:
            data = loads(text, object_pairs_hook=_json_pairs(text))
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy {source} is not valid TOML: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PolicyError(f"policy {source} is not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"policy {source} is not valid YAML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"policy {source} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise PolicyError(f"policy {source} is nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:  # JSON duplicates, NaN, long integers; TOML/YAML integers over 4300 digits
        line = str(exc).splitlines()[0][:200]
        raise PolicyError(f"policy {source} is not a valid {fmt.upper()} policy: {line}") from None
    return load_policy_data(data, source=source, text=text)


def load_policy(path: str | Path) -> LoadedPolicy:
    """Read a policy file (.toml, .yaml/.yml or .json by suffix; TOML otherwise), at most MAX_POLICY_BYTES."""
    path = Path(path)
    try:
        text = read_text_limited(path, MAX_POLICY_BYTES, "policy file")
    except UsageError as exc:
        raise PolicyError(str(exc)) from None
    suffix = path.suffix.lower()
    fmt: Literal["toml", "yaml", "json"] = (
        "yaml" if suffix in (".yaml", ".yml") else "json" if suffix == ".json" else "toml"
    )
    return parse_policy_text(text, fmt, source=str(path))
