"""The validated `qualify run` request: option parsing that refuses bad input before anything boots.

The engine's layer pattern facts live in a small table here (the harness never imports the engine):
they bound how many KV groups, and so how many --layout spans, an engine of a preset can register.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qualify.errors import UsageError
from qualify.run.geometry import GEOMETRY

KDA_BACKENDS = ("auto", "b12x", "triton", "torch")
LAUNCHERS = ("local", "docker")
PRESETS = ("tiny", "proxy")

# preset -> (layer pattern, layers per KV group): the geometry the harness asks for.
PATTERN_FACTS: dict[str, tuple[str, int]] = {p: (g.layer_pattern, g.group_size) for p, g in GEOMETRY.items()}

MAX_SPEC = 8  # the engine's num_spec bound
# No engine registers a KV span this long (the proxy's largest is 9216 tokens); beyond it is a typo.
MAX_SPAN = 1 << 20


def max_groups(preset: str) -> int:
    """KV groups an engine of `preset` registers: each kind's layers split into groups of group_size."""
    pattern, group = PATTERN_FACTS[preset]
    return sum(-(-pattern.count(kind) // group) for kind in "KA" if pattern.count(kind))


def parse_layout(text: str | None, preset: str) -> list[int] | None:
    """`2304,2304,2304,9216` -> [2304, 2304, 2304, 9216]; UsageError (one line) for anything else."""
    if text is None:
        return None
    if not text.strip():
        raise UsageError("--layout is empty; give comma-separated positive spans, e.g. 2304,2304,2304,9216")
    spans: list[int] = []
    for i, part in enumerate(text.split(","), start=1):
        p = part.strip()
        if not p:
            raise UsageError(f"--layout {text!r}: span {i} is empty; give comma-separated positive integers")
        if not re.fullmatch(r"[+-]?\d+", p):
            raise UsageError(f"--layout {text!r}: span {i} ({p!r}) is not an integer")
        v = int(p)
        if v <= 0:
            raise UsageError(f"--layout {text!r}: span {i} is {v}; spans must be positive integers")
        if v > MAX_SPAN:
            raise UsageError(
                f"--layout: span {i} ({p[:24]}{'…' if len(p) > 24 else ''}) is beyond any engine's KV span "
                f"(at most {MAX_SPAN} tokens)"
            )
        spans.append(v)
    bound = max_groups(preset)
    if len(spans) > bound:
        pattern, group = PATTERN_FACTS[preset]
        raise UsageError(
            f"--layout has {len(spans)} spans but a {preset} engine ({pattern}, groups of {group}) "
            f"registers at most {bound} KV groups"
        )
    return spans


def backend_refusal(kda_backend: str, target: str, launcher: str, env: dict[str, str]) -> str | None:
    """Why an explicit --kda-backend cannot run on this run's target, known before boot (None: it may).
    b12x needs CUDA; triton on a CPU needs the Triton interpreter (TRITON_INTERPRET=1), which a local
    engine inherits from this environment (a container's own environment is the image's to say)."""
    if target != "cpu":
        return None
    if kda_backend == "b12x":
        return "--kda-backend b12x needs a CUDA GPU and this run's target is the CPU; use auto or torch"
    interpreting = env.get("TRITON_INTERPRET", "") == "1"
    if kda_backend == "triton" and launcher == "local" and not interpreting:
        return (
            "--kda-backend triton needs a CUDA GPU or the Triton interpreter, and this run's target is the "
            "CPU without TRITON_INTERPRET=1; use auto or torch, or set TRITON_INTERPRET=1"
        )
    return None


def parse_spec(text: str) -> int:
    """`none` -> 0, `mtp:N` -> N (1..MAX_SPEC)."""
    t = text.strip().lower()
    if t == "none":
        return 0
    m = re.fullmatch(r"mtp:(\d+)", t)
    if m is None:
        raise UsageError(f"--spec {text!r} is not valid; use none or mtp:N (e.g. mtp:2)")
    n = int(m.group(1))
    if not 1 <= n <= MAX_SPEC:
        raise UsageError(f"--spec {text!r}: N must be between 1 and {MAX_SPEC}")
    return n


def parse_gpus(text: str | None) -> str | None:
    """`all` or comma-separated GPU indices (`0,1`)."""
    if text is None:
        return None
    t = text.strip()
    if t == "all":
        return t
    parts = t.split(",")
    if not t or any(not re.fullmatch(r"\d+", p.strip()) for p in parts):
        raise UsageError(f"--gpus {text!r} is not valid; use all or comma-separated indices such as 0,1")
    idx = [int(p) for p in parts]
    if len(set(idx)) != len(idx):
        raise UsageError(f"--gpus {text!r} names a GPU twice")
    return ",".join(str(i) for i in idx)


def parse_timeout(value: float | None) -> float | None:
    if value is None:
        return None
    if not value > 0 or value != value or value == float("inf"):
        raise UsageError(f"--timeout {value} is not valid; give a positive number of seconds")
    return float(value)


def parse_mem_limit(text: str | None) -> str | None:
    if text is None:
        return None
    if not re.fullmatch(r"[1-9]\d*[bkmg]?", text.strip().lower()):
        raise UsageError(f"--mem-limit {text!r} is not valid; use a size such as 2g or 512m")
    return text.strip().lower()


MAX_DCP = 8  # ranks one qualify run may ask for (one GPU each on a GPU host)


def parse_dcp(value: int | None) -> int | None:
    """--dcp N: run the DCP shards as N engine ranks (N >= 2); None folds them into one process."""
    if value is None:
        return None
    if not 2 <= value <= MAX_DCP:
        raise UsageError(
            f"--dcp {value}: give 2..{MAX_DCP} ranks (leave it out to fold DCP into one process)"
        )
    return value


@dataclass(frozen=True)
class RunRequest:
    """What the operator asked for, validated. `spec` keeps the operator's spelling for the receipt."""

    layout: list[int] | None
    kda_backend: str
    spec: str
    num_spec: int
    preset: str
    launcher: str
    image: str | None
    gpus: str | None
    timeout_s: float
    mem_limit: str | None
    db_url: str
    key_path: str
    json_output: bool
    dcp: int | None = None  # DCP ranks (one process each); None: folded into one process
    sandbox: bool = True  # False: --no-sandbox (the engine runs as the operator's own process)
    engine_env: tuple[tuple[str, str], ...] = ()  # --engine-env K=V, given to the engine and recorded
    fail_fast: bool = False  # --fail-fast: the checks after the first that does not pass are not run

    def request_info(self) -> dict:
        """The predicate's `request` object (receipts.statement.RequestInfo fields)."""
        return {
            "layout": self.layout,
            "kda_backend": self.kda_backend,
            "spec": self.spec,
            "preset": self.preset,
            "launcher": self.launcher,
            "image": self.image,
            "gpus": self.gpus,
            "timeout_s": self.timeout_s,
            "dcp": self.dcp,
            "sandbox": self.sandbox,
            "engine_env": dict(self.engine_env) or None,
            "fail_fast": self.fail_fast or None,
        }
