"""Rollout policies: the pydantic model, the TOML/YAML/JSON loader whose errors name line and column, and the
CEL conditions over a receipt's predicate (exposed to CEL as `receipt`)."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import celpy
import yaml
from celpy import celtypes
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from qualify.errors import UsageError
from receipts.canonical import sha256_hex

# Units a max_age may use; compound values ("1d12h") add up.
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^(?:\d+[smhdw])+$")
_KEYID = re.compile(r"^[0-9a-f]{64}$")
_CONDITION_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# "check.condition" with shell wildcards on either side, e.g. "layout.peer_*" or "generation.*"
_OBSERVED_PATTERN = re.compile(r"^[A-Za-z0-9_*?\[\]!-]+\.[A-Za-z0-9_*?\[\]!-]+$")
# CEL macros whose first argument names a new variable (`xs.all(x, ...)`), so `x` is not undeclared.
_BINDING_MACROS = {"all", "exists", "exists_one", "map", "filter"}
CEL_VARIABLE = "receipt"


class PolicyError(UsageError):
    """A policy that does not parse, validate or compile; the message names the place (line, column)."""


def parse_duration(text: str) -> timedelta:
    """'7d', '12h', '90m', '1w', '1d12h', '3600s' -> timedelta; ValueError for anything else."""
    text = text.strip()
    if not _DURATION.match(text):
        raise ValueError(f"duration {text!r} must look like 7d, 12h, 30m, 1w or 1d12h (units s m h d w)")
    seconds = sum(int(n) * _UNITS[u] for n, u in re.findall(r"(\d+)([smhdw])", text))
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be longer than zero")
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
        1, description="how many qualifying receipts from distinct hosts (host.hostname) are needed"
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

    @field_validator("require_observed")
    @classmethod
    def _observed_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not _OBSERVED_PATTERN.match(pattern):
                raise ValueError(
                    f"require_observed pattern {pattern!r} must look like check.condition "
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
        if not data["require_observed"]:
            del data[
                "require_observed"
            ]  # a policy without it keeps the digest it had before the field existed
        return "sha256:" + sha256_hex(data)


def policy_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a policy file."""
    schema = Policy.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --------------------------------------------------------------------------- CEL


@dataclass(frozen=True)
class Condition:
    """A compiled CEL condition."""

    name: str
    expr: str
    program: Any  # celpy Runner

    def evaluate(self, predicate: dict[str, Any]) -> str | None:
        """None when the condition holds for this predicate, else why not (false, or an evaluation error)."""
        try:
            result = self.program.evaluate({CEL_VARIABLE: celpy.json_to_cel(predicate)})
        except celpy.CELEvalError as exc:
            return f"could not be evaluated: {_cel_message(exc)}"
        except Exception as exc:  # noqa: BLE001 - an author's expression must never crash a decision
            return f"could not be evaluated: {type(exc).__name__}: {_cel_message(exc)}"
        if isinstance(result, celpy.CELEvalError):
            return f"could not be evaluated: {_cel_message(result)}"
        if not isinstance(result, celtypes.BoolType | bool):
            return f"is not true or false (it gave {type(result).__name__} {result!r})"
        return None if bool(result) else "is false"


def _cel_message(exc: BaseException) -> str:
    first = exc.args[0] if exc.args else exc
    text = str(first).splitlines()[0] if str(first) else type(exc).__name__
    return text[:200]


class CelCompileError(Exception):
    """A CEL expression that does not compile; line and column are 1-based within the expression."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


def compile_condition(name: str, expr: str) -> Condition:
    """Compile `expr`; CelCompileError on a syntax error or a name other than `receipt`."""
    env = celpy.Environment()
    try:
        ast = env.compile(expr)
    except celpy.CELParseError as exc:
        line, column = exc.line or 1, exc.column or 1
        lines = expr.splitlines() or [""]
        near = lines[min(line, len(lines)) - 1][column - 1 : column + 19]
        raise CelCompileError(
            f"syntax error near {near!r}" if near else "syntax error", line, column
        ) from None
    except RecursionError:
        raise CelCompileError("expression is nested too deeply", 1, 1) from None
    _check_names(ast)
    return Condition(name=name, expr=expr, program=env.program(ast))


def _check_names(ast: Any) -> None:
    # celpy resolves names only when evaluating; refuse a misspelt variable now, where the author sees it.
    bound: set[str] = set()
    for tree in ast.iter_subtrees():
        if tree.data == "member_dot_arg" and len(tree.children) >= 3:
            method, args = tree.children[1], tree.children[2]
            if str(method) in _BINDING_MACROS and getattr(args, "children", None):
                idents = [t for t in args.children[0].iter_subtrees() if t.data == "ident"]
                if len(idents) == 1:
                    bound.add(str(idents[0].children[0]))
    for tree in ast.iter_subtrees():
        if tree.data == "ident":
            token = tree.children[0]
            if str(token) not in bound and str(token) != CEL_VARIABLE:
                raise CelCompileError(
                    f"unknown name {str(token)!r}; conditions read the receipt predicate as `{CEL_VARIABLE}`",
                    getattr(token, "line", 1) or 1,
                    getattr(token, "column", 1) or 1,
                )


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


def load_policy_data(data: Any, source: str = "policy", text: str = "") -> LoadedPolicy:
    """Validate a parsed policy (a dict) and compile its conditions; PolicyError names line and column."""
    if not isinstance(data, dict):
        raise PolicyError(f"policy {source} must be a table/mapping of settings, got {type(data).__name__}")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(_validation_message(source, text, exc)) from None
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


def parse_policy_text(
    text: str, fmt: Literal["toml", "yaml", "json"], source: str = "policy"
) -> LoadedPolicy:
    """Parse policy text in the given format, then validate and compile it."""
    try:
        if fmt == "toml":
            data: Any = tomllib.loads(text)
        elif fmt == "yaml":
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
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
    return load_policy_data(data, source=source, text=text)


def load_policy(path: str | Path) -> LoadedPolicy:
    """Read a policy file (.toml, .yaml/.yml or .json by suffix; TOML otherwise)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc}") from None
    suffix = path.suffix.lower()
    fmt: Literal["toml", "yaml", "json"] = (
        "yaml" if suffix in (".yaml", ".yml") else "json" if suffix == ".json" else "toml"
    )
    return parse_policy_text(text, fmt, source=str(path))
