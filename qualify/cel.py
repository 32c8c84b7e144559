"""CEL conditions over a receipt's predicate (as `receipt`): compiled with a cost bound (macro nesting),
evaluated under a step and time budget, and explained in terms of the receipt's fields when they fail."""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy import celtypes
from celpy.evaluation import Evaluator

CEL_VARIABLE = "receipt"
# CEL macros whose first argument names a new variable (`xs.all(x, ...)`), so `x` is not undeclared.
_BINDING_MACROS = {"all", "exists", "exists_one", "map", "filter"}
# A macro's body runs once per list element, so nested macros multiply: depth 2 over a receipt's lists is
# at most a few thousand steps; depth 3 over 40 items took 44 s per decision. Deeper nesting is refused.
MAX_MACRO_DEPTH = 2
# Every evaluation of one decision shares one budget: at most this many AST steps and seconds, enough for
# the example policy over thousands of receipts; a policy that spends it is refused, nothing is recorded.
DECISION_STEPS = 2_000_000
DECISION_SECONDS = 20.0
# Field paths read from the receipt, e.g. `receipt.faults.oom.container` (a following "(" is a method).
_PATH = re.compile(r"\breceipt((?:\.[A-Za-z_]\w*(?![\w(]))+)")
_STRING = re.compile(r"'''.*?'''|\"\"\".*?\"\"\"|'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"", re.DOTALL)


class CelCompileError(Exception):
    """A CEL expression that does not compile; line and column are 1-based within the expression."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


class CostLimitError(Exception):
    """A decision's conditions spent their step or time budget."""


@dataclass
class Budget:
    """Steps and wall-clock time one decision's condition evaluations may spend together."""

    steps: int = DECISION_STEPS
    seconds: float = DECISION_SECONDS
    deadline: float = field(default=0.0, init=False)
    spent: int = field(default=0, init=False)
    exhausted: bool = field(default=False, init=False)
    # Outcomes of conditions already evaluated in this decision, by expression and the fields it read.
    memo: dict[tuple[str, str], str | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def spend(self) -> None:
        self.spent += 1
        if (
            self.exhausted
            or self.spent > self.steps
            or (self.spent % 256 == 0 and time.monotonic() > self.deadline)
        ):
            self.exhausted = True
            raise CostLimitError(f"more than {self.steps} steps or {self.seconds:g} s")

    def describe(self) -> str:
        return f"{self.steps} evaluation steps or {self.seconds:g} s"


class _BudgetedEvaluator(Evaluator):
    """celpy's interpreter, charging every node visit (macro bodies included) to a shared budget."""

    def __init__(self, ast: Any, activation: Any, budget: Budget) -> None:
        super().__init__(ast, activation)
        self.budget = budget

    def sub_evaluator(self, ast: Any) -> Evaluator:
        return _BudgetedEvaluator(ast, self.activation, self.budget)

    def visit(self, tree: Any) -> Any:
        self.budget.spend()
        return super().visit(tree)

    def visit_children(self, tree: Any) -> Any:
        self.budget.spend()
        return super().visit_children(tree)


@dataclass(frozen=True)
class Condition:
    """A compiled CEL condition."""

    name: str
    expr: str
    ast: Any
    runner: Any  # celpy Runner: provides the activation (functions, types)

    @property
    def reads(self) -> frozenset[str] | None:
        """The top-level receipt fields the expression can read, or None when it may read the whole
        receipt (e.g. `receipt["x"]`, `receipt.size()`, or `receipt` on its own)."""
        return _top_fields(self.expr)

    def evaluate(self, predicate: dict[str, Any], budget: Budget | None = None) -> str | None:
        """None when the condition holds for this predicate, else why not (false, or which field it lacked).

        Raises CostLimitError when `budget` (default: a fresh decision budget) is spent. CEL has no side
        effects and no clock, so within one budget (one decision) the result for the same fields read is
        reused: a fleet's receipts mostly agree on what a policy reads, and converting and walking each
        whole predicate again cost milliseconds per receipt."""
        budget = budget or Budget()
        reads = self.reads
        value = predicate if reads is None else {k: predicate[k] for k in reads if k in predicate}
        try:
            memo_key: tuple[str, str] | None = (self.expr, json.dumps(value, sort_keys=True, default=repr))
        except (TypeError, ValueError, RecursionError):
            memo_key = None
        if memo_key is not None and memo_key in budget.memo:
            return budget.memo[memo_key]
        outcome = self._evaluate(predicate, value, budget)
        if memo_key is not None:
            budget.memo[memo_key] = outcome
        return outcome

    def _evaluate(self, predicate: dict[str, Any], value: dict[str, Any], budget: Budget) -> str | None:
        evaluator = _BudgetedEvaluator(self.ast, self.runner.new_activation(), budget)
        try:
            result = evaluator.evaluate({CEL_VARIABLE: celpy.json_to_cel(value)})
        except CostLimitError:
            raise
        except RecursionError:
            return "could not be evaluated: its values are nested too deeply"
        except Exception as exc:  # noqa: BLE001 - an author's expression must never crash a decision
            if budget.exhausted:
                raise CostLimitError(budget.describe()) from None
            return self._unevaluable(predicate, exc)
        if budget.exhausted:
            raise CostLimitError(budget.describe())
        if isinstance(result, celpy.CELEvalError):
            return self._unevaluable(predicate, result)
        if not isinstance(result, celtypes.BoolType | bool):
            missing = missing_field(self.expr, predicate)
            if missing:
                return f"could not be evaluated: {missing}"
            return f"is not true or false (it gave {type(result).__name__} {result!r})"
        return None if bool(result) else "is false"

    def _unevaluable(self, predicate: dict[str, Any], exc: BaseException) -> str:
        missing = missing_field(self.expr, predicate)
        return f"could not be evaluated: {missing or _cel_message(exc)}"


def _cel_message(exc: BaseException) -> str:
    first = exc.args[0] if exc.args else exc
    text = str(first).splitlines()[0] if str(first) else type(exc).__name__
    # celpy names its own classes ("applied to '(<class 'celpy.evaluation.CELEvalError'>, ...)"): drop them.
    text = re.sub(r"\s*applied to .*$", "", text)
    return text[:200]


_RECEIPT = re.compile(r"\breceipt\b")
_MEMBER = re.compile(r"\s*\.\s*([A-Za-z_]\w*)\b(?!\s*\()")


@functools.lru_cache(maxsize=256)
def _top_fields(expr: str) -> frozenset[str] | None:
    """Top-level fields read as `receipt.<name>`; None if `receipt` is used any other way."""
    text = _STRING.sub('""', expr)
    names: set[str] = set()
    for match in _RECEIPT.finditer(text):
        member = _MEMBER.match(text, match.end())
        if member is None:
            return None
        names.add(member.group(1))
    return frozenset(names)


def missing_field(expr: str, predicate: dict[str, Any]) -> str | None:
    """The first `receipt.<path>` the expression reads that the predicate lacks, said plainly; else None."""
    for match in _PATH.finditer(_STRING.sub('""', expr)):
        value: Any = predicate
        walked = CEL_VARIABLE
        for name in match.group(1).lstrip(".").split("."):
            if not isinstance(value, dict):
                kind = "null" if value is None else f"a {type(value).__name__}, not an object"
                return f"the receipt's field {walked} is {kind}, so {walked}.{name} cannot be read"
            if name not in value:
                return f"the receipt has no field {walked}.{name}"
            value, walked = value[name], f"{walked}.{name}"
    return None


def _macro_depth(tree: Any) -> int:
    """How deeply comprehension macros nest in their bodies (a chained receiver does not nest)."""
    if not hasattr(tree, "children"):
        return 0
    if tree.data == "member_dot_arg" and len(tree.children) >= 3 and str(tree.children[1]) in _BINDING_MACROS:
        receiver, _, args = tree.children[:3]
        return max(_macro_depth(receiver), 1 + _macro_depth(args))
    return max((_macro_depth(child) for child in tree.children), default=0)


def compile_condition(name: str, expr: str) -> Condition:
    """Compile `expr`; CelCompileError on a syntax error, a name other than `receipt`, or nesting of
    comprehension macros deeper than MAX_MACRO_DEPTH (its cost could not be bounded)."""
    env = celpy.Environment()
    try:
        ast = env.compile(expr)
        depth = _macro_depth(ast)
    except celpy.CELParseError as exc:
        line, column = exc.line or 1, exc.column or 1
        lines = expr.splitlines() or [""]
        near = lines[min(line, len(lines)) - 1][column - 1 : column + 19]
        raise CelCompileError(
            f"syntax error near {near!r}" if near else "syntax error", line, column
        ) from None
    except RecursionError:
        raise CelCompileError("expression is nested too deeply", 1, 1) from None
    if depth > MAX_MACRO_DEPTH:
        raise CelCompileError(
            f"it nests comprehension macros (.all/.exists/.map/.filter) {depth} deep; at most "
            f"{MAX_MACRO_DEPTH} are allowed, since each level multiplies the cost by a list's length",
            1,
            1,
        )
    _check_names(ast)
    return Condition(name=name, expr=expr, ast=ast, runner=env.program(ast))


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
