"""The rule expression language: tokenizer, Pratt parser, type check, compiler to closures.

Rule text is data from a file, so it is parsed by hand and never handed to ``eval``.
Grammar (lowest precedence first)::

    expr     := expr "or" expr | expr "and" expr | "not" expr
              | sum (("<"|"<="|">"|">="|"=="|"!=") sum)*     # chains like Python: 0 < kl < 1
    sum      := sum ("+"|"-") term | term
    term     := term ("*"|"/") unary | unary
    unary    := "-" unary | atom
    atom     := NUMBER | "inf" | "nan" | "step" | METRIC | m("verl/key") | $PARAM | CALL | "(" expr ")"

METRIC is a short name from ``ppo_watchdog.protocol.catalog`` (``kl``, ``vf_loss``, ``reward``) or a
Prometheus name; verl keys contain ``/`` and are written ``m("critic/vf_loss")``. ``step``
is the evaluated training step. Window functions count training steps: ``avg(kl, 10)``
reads the steps in (step-10, step]; an optional third argument shifts the window back:
``median(kl, 5, 1)`` is the median of the 5 steps before this one, the run's own recent
baseline. See :data:`FUNCTIONS` for the full list. ``$name`` is a parameter of the rule pack
(``params:`` in a rule file, overridable by an overlay pack), bound to its number when the
expression is compiled.

Expressions are type checked (number vs condition) and compiled to nested closures
``f(window, at, seq)``: ``at`` is the step evaluated (``count_over`` re-evaluates its
condition at earlier steps), ``seq`` the last event sequence number already seen.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import re
from array import array
from bisect import bisect_left, insort_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ppo_watchdog.core.series import MissingDataError, Window, _Series
from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.events import EVENT_KINDS

MAX_LENGTH = 4000
MAX_DEPTH = 64
"""Deepest expression tree accepted: evaluation recurses once per level, far below Python's limit."""
MAX_COUNT_OVER_READS = 100_000
"""The most values one ``count_over(cond, N)`` may read a step: N times the widest window ``cond`` reads (it
is judged again at each of the N steps). A daemon evaluates it for every run at every step: at 100,000 that
is a few milliseconds a run; ``count_over(reward > slope(reward, 100000), 100000)`` was 10**10, 17 s to replay
a 700-step log."""

NUM, BOOL = "number", "condition"

Fn = Callable[[Window, int, int], Any]


class ExprError(ValueError):
    """An expression does not parse or type check; ``col`` is 1-based within the expression."""

    def __init__(self, col: int, message: str) -> None:
        super().__init__(f"column {col}: {message}")
        self.col = col
        self.message = message


# -- AST -----------------------------------------------------------------------------
# ``col`` is left out of equality so that parse(unparse(ast)) == ast holds.


@dataclass(frozen=True)
class Num:
    value: float
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Str:
    value: str
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Step:
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Param:
    name: str
    """Parameter name, without the ``$``."""
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Metric:
    name: str
    """Catalog short name."""
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Unary:
    op: str
    operand: Node
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Compare:
    ops: tuple[str, ...]
    operands: tuple[Node, ...]
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class BoolOp:
    op: str
    left: Node
    right: Node
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Not:
    operand: Node
    col: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[Node, ...]
    col: int = field(default=0, compare=False)


Node = Num | Str | Step | Param | Metric | Unary | Binary | Compare | BoolOp | Not | Call


# -- tokenizer ------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)  # (0-9: a digit of another script is no number here)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<param>\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<str>"[^"\\\n]*"|'[^'\\\n]*')
  | (?P<op><=|>=|==|!=|[-+*/<>(),])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str
    """num, ident, param, str, op or eof."""
    text: str
    col: int


def tokenize(text: str) -> list[Token]:
    """Split an expression into tokens; ExprError at the first character that starts none."""
    if len(text) > MAX_LENGTH:
        raise ExprError(1, f"expression longer than {MAX_LENGTH} characters")
    out: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            ch = text[pos]
            hint = " (unterminated string?)" if ch in "\"'" else ""
            hint = hint or (" (verl keys with '/' are written m(\"critic/vf_loss\"))" if ch == "/" else "")
            raise ExprError(pos + 1, f"unexpected character {ch!r}{hint}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append(Token(kind, m.group(), pos + 1))
        pos = m.end()
    out.append(Token("eof", "", len(text) + 1))
    return out


# -- functions ------------------------------------------------------------------------


@dataclass(frozen=True)
class FuncSpec:
    """Signature of a built-in function: argument kinds and result type."""

    args: tuple[str, ...]
    """Argument kinds: metric, window (positive integer), lag (integer >= 0), num, cond, event (string), literal."""
    result: str
    doc: str
    optional: int = 0
    """How many trailing arguments may be left out."""
    variadic: bool = False
    """Any number (0+) of metric arguments."""


_LAGGED = ("metric", "window", "lag")
_LAG_DOC = "; a third argument L ends the window L steps back"

FUNCTIONS: dict[str, FuncSpec] = {
    "avg": FuncSpec(_LAGGED, NUM, "mean over the last N steps" + _LAG_DOC, optional=1),
    "min": FuncSpec(_LAGGED, NUM, "minimum over the last N steps" + _LAG_DOC, optional=1),
    "max": FuncSpec(_LAGGED, NUM, "maximum over the last N steps" + _LAG_DOC, optional=1),
    "std": FuncSpec(_LAGGED, NUM, "population standard deviation over the last N steps" + _LAG_DOC, optional=1),
    "median": FuncSpec(_LAGGED, NUM, "median over the last N steps (robust to one-step spikes)" + _LAG_DOC,
                       optional=1),
    "count": FuncSpec(_LAGGED, NUM, "how many of the last N steps have a value (0 when none)" + _LAG_DOC,
                      optional=1),
    "slope": FuncSpec(("metric", "window"), NUM, "least-squares slope per step over the last N steps"),
    "delta": FuncSpec(("metric", "window"), NUM, "newest minus oldest value within the last N steps"),
    "zscore": FuncSpec(
        ("metric", "window"), NUM, "(value - mean) / std of the N steps before this one (inf when std is 0)"
    ),
    "best": FuncSpec(("metric", "window"), NUM, "best (max) so far over the run, or over the last N steps", optional=1),
    "since_best": FuncSpec(("metric",), NUM, "steps since the metric last reached a new best"),
    "lowest": FuncSpec(("metric",), NUM, "lowest value so far over the run (a rolled-back branch's steps left with it)"),
    "holds": FuncSpec(("cond",), BOOL, "the condition, or false when its data is missing: a signal the run does "
                                       "not log (yet) cannot confirm another"),
    "count_over": FuncSpec(("cond", "window"), NUM, "number of steps in the last N where the condition held"),
    "isnan": FuncSpec(("num",), BOOL, "true when the value is NaN"),
    "isfinite": FuncSpec(("num",), BOOL, "true when the value is a finite number"),
    "nonfinite": FuncSpec(
        ("metric",), BOOL, "true when any given metric (or, with none, any metric) is NaN/inf at this step",
        variadic=True,
    ),
    "event": FuncSpec(("event",), NUM, 'events of a kind since the last evaluation: event("oom")'),
    "event_count": FuncSpec(("event", "window"), NUM, "events of a kind in the last N steps"),
    "abs": FuncSpec(("num",), NUM, "absolute value"),
    "clamp_min": FuncSpec(("num", "num"), NUM, "the value, or the lower bound when below it (PromQL's clamp_min)"),
    "clamp_max": FuncSpec(("num", "num"), NUM, "the value, or the upper bound when above it (PromQL's clamp_max)"),
    "default": FuncSpec(("num", "literal"), NUM, "the value, or the literal when the data is missing"),
}


# -- parser ---------------------------------------------------------------------------

_CMP = ("<", "<=", ">", ">=", "==", "!=")


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> Token:
        return self.toks[self.i]

    def next(self) -> Token:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text: str) -> Token:
        t = self.next()
        if t.text != text or t.kind not in ("op", "ident"):
            raise ExprError(t.col, f"expected {text!r}, found {_describe(t)}")
        return t

    def parse(self) -> Node:
        node = self.expr(0)
        t = self.peek()
        if t.kind != "eof":
            raise ExprError(t.col, f"unexpected {_describe(t)} after a complete expression")
        return node

    # Pratt loop: binding powers or=1, and=2, comparisons=4, +-=5, */=6.
    def expr(self, rbp: int) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ExprError(self.peek().col, f"expression nested deeper than {MAX_DEPTH} levels")
        try:
            left = self.prefix()
            while True:
                t = self.peek()
                lbp = _infix_bp(t)
                if lbp <= rbp:
                    return left
                self.next()
                if t.text in ("or", "and"):
                    left = BoolOp(t.text, left, self.expr(lbp), col=t.col)
                elif t.text in _CMP:
                    ops, operands = [t.text], [left, self.expr(lbp)]
                    while self.peek().kind == "op" and self.peek().text in _CMP:
                        ops.append(self.next().text)
                        operands.append(self.expr(lbp))
                    left = Compare(tuple(ops), tuple(operands), col=t.col)
                else:
                    left = Binary(t.text, left, self.expr(lbp), col=t.col)
        finally:
            self.depth -= 1

    def prefix(self) -> Node:
        t = self.next()
        if t.kind == "num":
            return Num(float(t.text), col=t.col)
        if t.kind == "op" and t.text == "-":
            return Unary("-", self.expr(6), col=t.col)
        if t.kind == "op" and t.text == "(":
            inner = self.expr(0)
            self.expect(")")
            return inner
        if t.kind == "str":
            return Str(t.text[1:-1], col=t.col)
        if t.kind == "param":
            return Param(t.text[1:], col=t.col)
        if t.kind == "ident":
            if t.text == "not":
                return Not(self.expr(3), col=t.col)
            if t.text == "step":
                return Step(col=t.col)
            if t.text in ("inf", "nan"):
                return Num(float(t.text), col=t.col)
            if t.text in ("and", "or"):
                raise ExprError(t.col, f"{t.text!r} needs a condition on its left")
            if self.peek().text == "(" and self.peek().kind == "op":
                return self.call(t)
            nxt = self.peek()
            if nxt.kind == "op" and nxt.text == "/" and catalog.lookup(t.text) is None:
                # ``critic/kl`` reads as a division; point at the quoted form.
                key = t.text + "/" + self.toks[self.i + 1].text
                raise ExprError(t.col, f"unknown metric {t.text!r}: verl keys with '/' are written m(\"{key}\")")
            return _metric(t.text, t.col)
        raise ExprError(t.col, f"expected a number, metric, function or '(', found {_describe(t)}")

    def call(self, name: Token) -> Node:
        self.expect("(")
        args: list[Node] = []
        if not (self.peek().kind == "op" and self.peek().text == ")"):
            while True:
                args.append(self.expr(0))
                if self.peek().kind == "op" and self.peek().text == ",":
                    self.next()
                    continue
                break
        self.expect(")")
        if name.text == "m":
            if len(args) != 1 or not isinstance(args[0], Str):
                raise ExprError(name.col, 'm() takes one quoted metric key, e.g. m("critic/vf_loss")')
            return _metric(args[0].value, args[0].col)
        if name.text not in FUNCTIONS:
            raise ExprError(name.col, f"unknown function {name.text!r}{_suggest(name.text, FUNCTIONS)}")
        return Call(name.text, tuple(args), col=name.col)


def _infix_bp(t: Token) -> int:
    if t.kind == "ident":
        return {"or": 1, "and": 2}.get(t.text, 0)
    if t.kind == "op":
        if t.text in _CMP:
            return 4
        return {"+": 5, "-": 5, "*": 6, "/": 6}.get(t.text, 0)
    return 0


def _describe(t: Token) -> str:
    return "end of expression" if t.kind == "eof" else repr(t.text)


def _suggest(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _metric(name: str, col: int) -> Metric:
    m = catalog.lookup(name)
    if m is None:
        raise ExprError(col, f"unknown metric {name!r}{_suggest(name, catalog.BY_SHORT)}")
    return Metric(m.short, col=col)


def parse(text: str) -> Node:
    """Parse an expression into an AST; raises ExprError with the column."""
    if not isinstance(text, str):
        raise ExprError(1, f"expression must be a string, got {type(text).__name__}")
    try:
        node = _Parser(text).parse()
    except RecursionError:
        raise ExprError(1, f"expression nested deeper than {MAX_DEPTH} levels; split it into rules "
                           "or parameters") from None
    depth = _depth(node)
    if depth > MAX_DEPTH:
        raise ExprError(1, f"expression nested {depth} levels deep (the limit is {MAX_DEPTH}: each level is a "
                           "call when the rule is evaluated); split it, e.g. max(a, b, c) for a chain of maxes")
    return node


def _depth(node: Node) -> int:
    """Depth of an AST (iterative: a tree too deep for recursion is what this measures)."""
    deepest, stack = 0, [(node, 1)]  # (a node, its depth)
    while stack:
        n, d = stack.pop()
        deepest = max(deepest, d)
        for f in dataclasses.fields(n):
            v = getattr(n, f.name)
            for child in (v if isinstance(v, tuple) else (v,)):
                if dataclasses.is_dataclass(child) and not isinstance(child, type):
                    stack.append((cast(Node, child), d + 1))
    return deepest


def unparse(node: Node) -> str:
    """Fully parenthesised source text for an AST (parse(unparse(a)) == a)."""
    if isinstance(node, Num):
        v = node.value
        if not math.isfinite(v):
            return str(v)
        return str(int(v)) if v == int(v) and abs(v) < 1e15 else repr(v)
    if isinstance(node, Str):
        return f'"{node.value}"'
    if isinstance(node, Step):
        return "step"
    if isinstance(node, Param):
        return f"${node.name}"
    if isinstance(node, Metric):
        return node.name
    if isinstance(node, Unary):
        return f"(-{unparse(node.operand)})"
    if isinstance(node, Binary):
        return f"({unparse(node.left)} {node.op} {unparse(node.right)})"
    if isinstance(node, Compare):
        parts = [unparse(node.operands[0])]
        for op, operand in zip(node.ops, node.operands[1:], strict=True):
            parts += [op, unparse(operand)]
        return "(" + " ".join(parts) + ")"
    if isinstance(node, BoolOp):
        return f"({unparse(node.left)} {node.op} {unparse(node.right)})"
    if isinstance(node, Not):
        return f"(not {unparse(node.operand)})"
    return f"{node.func}(" + ", ".join(unparse(a) for a in node.args) + ")"


# -- compiler -------------------------------------------------------------------------


@dataclass(frozen=True)
class Compiled:
    """A compiled expression."""

    source: str
    """The expression text."""
    ast: Node
    """Its syntax tree."""
    fn: Fn
    """``fn(window, at, seq)`` -> bool (conditions) or float."""
    inputs: tuple[tuple[str, Fn], ...]
    """(label, fn) for each metric and function call, to audit a decision's inputs."""
    metrics: frozenset[str]
    """Short names the expression reads."""
    required: frozenset[str]
    """Of them, those read outside ``holds()``: without them the expression cannot be evaluated
    (a metric read only as an optional confirmation does not blind the rule)."""
    max_window: int
    """Largest window (steps) any function in it reads; 1 when none."""

    def __call__(self, window: Window, at: int | None = None, seq: int = 0) -> Any:
        step = window.step if at is None else at
        if step is None:
            raise MissingDataError("the window holds no step yet")
        return self.fn(window, step, seq)

    def input_values(self, window: Window, at: int, seq: int = 0) -> dict[str, float]:
        """Each input's value at ``at`` (NaN where it cannot be computed)."""
        out: dict[str, float] = {}
        for label, fn in self.inputs:
            try:
                out[label] = float(fn(window, at, seq))
            except (MissingDataError, ValueError):
                out[label] = math.nan
        return out


class _Compiler:
    def __init__(self, params: Mapping[str, float]) -> None:
        self.params = params
        self.inputs: dict[str, Fn] = {}
        self.metrics: set[str] = set()
        self.optional_depth = 0
        self.required: set[str] = set()
        self.max_window = 1
        self.in_count_over = False
        self.chains: dict[int, tuple[str, tuple[Fn, ...]]] = {}
        """A compiled and/or chain's operands, by the id of its closure (flattened into its parent's)."""
        self.keep: list[Fn] = []
        self.holds: dict[int, tuple[Fn, str]] = {}
        """A cached holds()'s condition and cache key, by the id of its closure (``not holds`` fuses them)."""

    def compile(self, node: Node) -> tuple[Fn, str]:
        if isinstance(node, Num):
            v = node.value
            return (lambda w, at, seq: v), NUM
        if isinstance(node, Str):
            raise ExprError(node.col, "a string is only allowed as the argument of event() or m()")
        if isinstance(node, Step):
            return (lambda w, at, seq: float(at)), NUM
        if isinstance(node, Param):
            if node.name not in self.params:
                raise ExprError(node.col, f"unknown parameter ${node.name}{_suggest(node.name, self.params)}"
                                          " (declare it under params:)")
            p = float(self.params[node.name])
            self.inputs.setdefault(f"${node.name}", lambda w, at, seq: p)
            return (lambda w, at, seq: p), NUM
        if isinstance(node, Metric):
            return self.metric(node), NUM
        if isinstance(node, Unary):
            f = self.num(node.operand, "'-'")
            c = self.const(node)
            if c is not None:
                return (lambda w, at, seq: c), NUM
            return (lambda w, at, seq: -f(w, at, seq)), NUM
        if isinstance(node, Binary):
            return self.binary(node), NUM
        if isinstance(node, Compare):
            return self.compare(node), BOOL
        if isinstance(node, BoolOp):
            a = self.cond(node.left, f"'{node.op}'")
            b = self.cond(node.right, f"'{node.op}'")
            return self.chain(node.op, a, b), BOOL
        if isinstance(node, Not):
            f = self.cond(node.operand, "'not'")
            held = self.holds.get(id(f))
            if held is not None:
                # ``not holds(...)``, in most rules of the default pack: one closure, the same cache entry.
                cond, key = held

                def not_held(w: Window, at: int, seq: int) -> bool:
                    cache = w.cache
                    if w.cache_at != at:
                        cache.clear()
                        w.cache_at = at
                    else:
                        v = cache.get(key)
                        if v is not None:
                            return not v
                    try:
                        v = bool(cond(w, at, seq))
                    except MissingDataError:
                        v = False
                    cache[key] = v
                    return not v

                return not_held, BOOL
            return (lambda w, at, seq: not f(w, at, seq)), BOOL
        return self.call(node)

    def read(self, name: str) -> None:
        """Note a metric the expression reads (required unless inside ``holds()``)."""
        self.metrics.add(name)
        if not self.optional_depth:
            self.required.add(name)

    def const(self, node: Node) -> float | None:
        """The value of a constant operand (a number, a bound ``$param``, a negated constant), else None."""
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Param) and node.name in self.params:
            return float(self.params[node.name])
        if isinstance(node, Unary):
            c = self.const(node.operand)
            return None if c is None else -c
        return None

    def chain(self, op: str, a: Fn, b: Fn) -> Fn:
        """``a and b`` (``or``) as one closure over the whole chain ``x and y and z ...``: conditions are
        bools, so the chain's value is the first false (true) operand's or the last one's, as Python's."""
        fns = self.chains.get(id(a), (op, (a,)))[1] if self.chains.get(id(a), ("",))[0] == op else (a,)
        fns += self.chains.get(id(b), (op, (b,)))[1] if self.chains.get(id(b), ("",))[0] == op else (b,)
        if op == "and":
            if len(fns) == 2:
                def f(w: Window, at: int, seq: int) -> bool:
                    return a(w, at, seq) and b(w, at, seq)
            elif len(fns) == 3:
                f0, f1, f2 = fns

                def f(w: Window, at: int, seq: int) -> bool:
                    return f0(w, at, seq) and f1(w, at, seq) and f2(w, at, seq)
            else:
                def f(w: Window, at: int, seq: int) -> bool:
                    for g in fns:
                        if not g(w, at, seq):
                            return False
                    return True
        elif len(fns) == 2:
            def f(w: Window, at: int, seq: int) -> bool:
                return a(w, at, seq) or b(w, at, seq)
        elif len(fns) == 3:
            f0, f1, f2 = fns

            def f(w: Window, at: int, seq: int) -> bool:
                return f0(w, at, seq) or f1(w, at, seq) or f2(w, at, seq)
        else:
            def f(w: Window, at: int, seq: int) -> bool:
                for g in fns:
                    if g(w, at, seq):
                        return True
                return False
        self.chains[id(f)] = (op, fns)
        self.keep.append(f)  # ids stay unique while compiling
        return f

    def num(self, node: Node, where: str) -> Fn:
        f, t = self.compile(node)
        if t != NUM:
            raise ExprError(_col(node), f"{where} needs a number, got a condition")
        return f

    def cond(self, node: Node, where: str) -> Fn:
        f, t = self.compile(node)
        if t != BOOL:
            raise ExprError(_col(node), f"{where} needs a condition (e.g. a comparison), got a number")
        return f

    def metric(self, node: Metric) -> Fn:
        name = node.name
        self.read(name)

        def get(w: Window, at: int, seq: int) -> float:
            if at == w.step:  # the newest step, where rules read: its values without a bisection
                v = w.now.get(name)
                if v is not None:
                    return v
            return w.value(name, at)

        self.inputs.setdefault(name, get)
        return get

    def binary(self, node: Binary) -> Fn:
        a = self.num(node.left, f"'{node.op}'")
        b = self.num(node.right, f"'{node.op}'")
        # A constant operand (``$kl_jump * clamp_min(...)``) is read from the closure, not called:
        # the same float in the same operation, one call fewer per evaluation.
        ca, cb = self.const(node.left), self.const(node.right)
        if node.op == "+":
            if cb is not None:
                return lambda w, at, seq: a(w, at, seq) + cb
            if ca is not None:
                return lambda w, at, seq: ca + b(w, at, seq)
            return lambda w, at, seq: a(w, at, seq) + b(w, at, seq)
        if node.op == "-":
            if cb is not None:
                return lambda w, at, seq: a(w, at, seq) - cb
            if ca is not None:
                return lambda w, at, seq: ca - b(w, at, seq)
            return lambda w, at, seq: a(w, at, seq) - b(w, at, seq)
        if node.op == "*":
            if cb is not None:
                return lambda w, at, seq: a(w, at, seq) * cb
            if ca is not None:
                return lambda w, at, seq: ca * b(w, at, seq)
            return lambda w, at, seq: a(w, at, seq) * b(w, at, seq)
        if cb is not None and cb != 0:  # NaN too: x / nan is nan, no exception
            return lambda w, at, seq: a(w, at, seq) / cb

        def div(w: Window, at: int, seq: int) -> float:
            x, y = a(w, at, seq), b(w, at, seq)
            try:
                return x / y
            except ZeroDivisionError:
                # IEEE semantics rather than an exception: 0/0 is NaN, x/0 is +-inf.
                return math.nan if x == 0 or math.isnan(x) else math.copysign(math.inf, x)

        return div

    def compare(self, node: Compare) -> Fn:
        fns = [self.num(o, f"'{node.ops[0]}'") for o in node.operands]
        ops = [_CMP_FN[o] for o in node.ops]
        if len(ops) == 1:
            # The common shapes, one closure each (the default pack is evaluated for thousands of
            # runs per tick): against a constant (``kl > 0.1``), a metric against a constant (its
            # value read inline), two computed sides.
            f0, f1 = fns
            left, right = node.operands
            op = node.ops[0]
            c = self.const(right)
            cmp = _CMP_OP[op]
            if c is not None and isinstance(left, Metric):
                name = left.name

                def metric_const(w: Window, at: int, seq: int) -> bool:
                    if at == w.step:  # Window.now: the newest step's values (as in metric())
                        v = w.now.get(name)
                        if v is not None:
                            return cmp(v, c)  # type: ignore[no-any-return]
                    return cmp(w.value(name, at), c)  # type: ignore[no-any-return]

                return metric_const
            if c is not None and isinstance(left, Step):
                return {
                    "<": lambda w, at, seq: float(at) < c,
                    "<=": lambda w, at, seq: float(at) <= c,
                    ">": lambda w, at, seq: float(at) > c,
                    ">=": lambda w, at, seq: float(at) >= c,
                    "==": lambda w, at, seq: float(at) == c,
                    "!=": lambda w, at, seq: float(at) != c,
                }[op]
            if c is not None and isinstance(left, Call) and left.func == "count":
                return _count_compare(left, cmp, c)  # ``count(kl, 5, 1) >= 1``, the guard of most rules
            if c is not None:
                return {
                    "<": lambda w, at, seq: f0(w, at, seq) < c,
                    "<=": lambda w, at, seq: f0(w, at, seq) <= c,
                    ">": lambda w, at, seq: f0(w, at, seq) > c,
                    ">=": lambda w, at, seq: f0(w, at, seq) >= c,
                    "==": lambda w, at, seq: f0(w, at, seq) == c,
                    "!=": lambda w, at, seq: f0(w, at, seq) != c,
                }[op]
            if isinstance(left, Metric):
                name = left.name

                def metric_fn(w: Window, at: int, seq: int) -> bool:
                    v = w.now.get(name) if at == w.step else None
                    if v is None:
                        v = w.value(name, at)  # (its error first: the left side is read first)
                    return cmp(v, f1(w, at, seq))  # type: ignore[no-any-return]

                return metric_fn
            return {
                "<": lambda w, at, seq: f0(w, at, seq) < f1(w, at, seq),
                "<=": lambda w, at, seq: f0(w, at, seq) <= f1(w, at, seq),
                ">": lambda w, at, seq: f0(w, at, seq) > f1(w, at, seq),
                ">=": lambda w, at, seq: f0(w, at, seq) >= f1(w, at, seq),
                "==": lambda w, at, seq: f0(w, at, seq) == f1(w, at, seq),
                "!=": lambda w, at, seq: f0(w, at, seq) != f1(w, at, seq),
            }[op]

        def chain(w: Window, at: int, seq: int) -> bool:
            left = fns[0](w, at, seq)
            for op, f in zip(ops, fns[1:], strict=True):
                right = f(w, at, seq)
                if not op(left, right):
                    return False
                left = right
            return True

        return chain

    def call(self, node: Call) -> tuple[Fn, str]:
        spec = FUNCTIONS[node.func]
        args = node.args
        lo = len(spec.args) - spec.optional
        if spec.variadic:
            if not all(isinstance(a, Metric) for a in args):
                raise ExprError(node.col, f"{node.func}() takes metric names only")
        elif not lo <= len(args) <= len(spec.args):
            want = f"{lo} to {len(spec.args)}" if spec.optional else str(len(spec.args))
            raise ExprError(node.col, f"{node.func}() takes {want} argument(s), got {len(args)}")
        kinds = spec.args if not spec.variadic else ("metric",) * len(args)
        for a, kind in zip(args, kinds, strict=False):
            self.check_arg(node.func, a, kind)
        if spec.args == _LAGGED and len(args) == 3:
            self.max_window = max(self.max_window, int(args[1].value) + int(args[2].value))  # type: ignore[union-attr]
        label = unparse(node)
        fn = _BUILD[node.func](self, node)
        if node.func not in ("default", "holds"):
            self.inputs.setdefault(label, fn)
        return fn, spec.result

    def check_arg(self, func: str, a: Node, kind: str) -> None:
        if kind == "metric" and not isinstance(a, Metric):
            raise ExprError(_col(a), f"{func}() takes a metric name here, e.g. {func}(kl, 10)")
        if kind == "window":
            if not isinstance(a, Num) or not 1 <= a.value <= 100_000 or a.value != int(a.value):
                raise ExprError(_col(a), f"{func}() takes a whole number of steps (1..100000) here")
            self.max_window = max(self.max_window, int(a.value))
        if kind == "lag":
            if not isinstance(a, Num) or not 0 <= a.value <= 100_000 or a.value != int(a.value):
                raise ExprError(_col(a), f"{func}() takes a whole number of steps back (0..100000) here")
        if kind == "event":
            if not isinstance(a, Str):
                raise ExprError(_col(a), f'{func}() takes a quoted event kind, e.g. {func}("oom")')
            if a.value not in EVENT_KINDS:
                raise ExprError(
                    _col(a), f"unknown event kind {a.value!r}{_suggest(a.value, EVENT_KINDS)}"
                )
        if kind == "literal" and not (
            isinstance(a, Num) or (isinstance(a, Unary) and isinstance(a.operand, Num))
        ):
            raise ExprError(_col(a), f"{func}() takes a number here")


def _col(node: Node) -> int:
    col = node.col
    if isinstance(node, (Binary, Compare, BoolOp)):
        first = node.operands[0] if isinstance(node, Compare) else node.left
        col = _col(first)
    return max(col, 1)


_CMP_OP: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}

_CMP_FN: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _window_fn(kind: str) -> Callable[[_Compiler, Call], Fn]:
    def build(c: _Compiler, node: Call) -> Fn:
        name = node.args[0].name  # type: ignore[union-attr]
        n = int(node.args[1].value)  # type: ignore[union-attr]
        lag = int(node.args[2].value) if len(node.args) > 2 else 0  # type: ignore[union-attr]
        c.read(name)
        reduce = _REDUCERS[kind]
        where = f"in the last {n} steps" if not lag else f"in the {n} steps ending {lag} back"
        empty = f"{kind}({name}, {n}{f', {lag}' if lag else ''}): no values {where}"
        # The window's cache holds results at one evaluated step (``Window.cache_at``), keyed by a
        # string built here once: its hash is cached, where a tuple's is recomputed at every lookup.
        # Where the window lies is cached too (``span``: ``Window.locate``'s series and index range, and
        # their list once one is made): count, median and std of one window
        # (``count(kl, 5, 1) >= 1 and kl > median(kl, 5, 1)``) bisect it once.
        key = f"{kind}({name}, {n}, {lag})"
        span = f"({name}, {n}, {lag})"
        # Each kind below opens with the same cache lookup, written out in each closure on purpose: a shared
        # helper would be one more call per window function per rule per step (the engine's hot path).

        if kind == "count":
            def count(w: Window, at: int, seq: int) -> float:
                cache = w.cache
                if w.cache_at != at:
                    cache.clear()
                    w.cache_at = at
                    sp = None
                else:
                    v = cache.get(key)
                    if v is not None:
                        return v  # type: ignore[no-any-return]
                    sp = cache.get(span)
                if sp is None:
                    sp = cache[span] = [*w.locate(name, at, n, lag), None]
                v = cache[key] = float(sp[2] - sp[1])
                return v

            return count

        if kind in ("median", "min", "max"):
            median, low = kind == "median", kind == "min"
            if n < _SLIDE_MIN:
                def order(w: Window, at: int, seq: int) -> float:
                    cache = w.cache
                    if w.cache_at != at:
                        cache.clear()
                        w.cache_at = at
                        sp = None
                    else:
                        v = cache.get(key)
                        if v is not None:
                            return v  # type: ignore[no-any-return]
                        sp = cache.get(span)
                    if sp is None:
                        sp = cache[span] = [*w.locate(name, at, n, lag), None]
                    vals = sp[3]
                    if vals is None:
                        s = sp[0]
                        vals = sp[3] = s.values[sp[1]:sp[2]].tolist() if s is not None else []
                    if not vals:
                        raise MissingDataError(empty)
                    t = sum(vals)
                    if t != t and any(map(_isnan, vals)):  # a NaN: NaN, as _median, _min and _max give
                        v = math.nan
                    elif median:
                        srt = sorted(vals)
                        mid = len(srt) // 2
                        v = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
                    else:
                        v = min(vals) if low else max(vals)
                    cache[key] = v
                    return v

                return order

            # A window of 20 steps or more: its sorted values carried from one evaluated step to the next
            # (``Window.slides``, see _slide): the window moves by a step between evaluations, so one value
            # leaves and one enters instead of a sort (measured: a sort of fewer values costs less).
            def slid(w: Window, at: int, seq: int) -> float:
                cache = w.cache
                if w.cache_at != at:
                    cache.clear()
                    w.cache_at = at
                    sp = None
                else:
                    v = cache.get(key)
                    if v is not None:
                        return v  # type: ignore[no-any-return]
                    sp = cache.get(span)
                if sp is None:
                    sp = cache[span] = [*w.locate(name, at, n, lag), None]
                s, i, j, _ = sp
                if i == j:
                    raise MissingDataError(empty)
                sl = _slide(w, span, s, i, j)
                if sl[4]:  # a NaN in the window: NaN, as the plain median, min and max give
                    v = math.nan
                else:
                    srt = sl[3]
                    if median:
                        mid = len(srt) // 2
                        v = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
                    elif low:
                        v = srt[0]  # the first of equal minima (0.0 and -0.0), as min() returns
                    else:
                        v = srt[-1]
                        v = srt[bisect_left(srt, v)]  # the first of equal maxima, as max() returns
                cache[key] = v
                return v

            return slid

        sloping = kind == "slope"

        def f(w: Window, at: int, seq: int) -> float:
            cache = w.cache
            if w.cache_at != at:
                cache.clear()
                w.cache_at = at
            else:
                v = cache.get(key)
                if v is not None:
                    return v  # type: ignore[no-any-return]
            end = at - lag * w.cadence
            sp = cache.get(span)
            if sp is None:
                sp = cache[span] = [*w.locate(name, at, n, lag), None]
            vals = sp[3]
            if vals is None:
                s, i, j = sp[0], sp[1], sp[2]
                vals = sp[3] = s.values[i:j].tolist() if s is not None else []  # boxed once for every reduction
            if not vals:
                raise MissingDataError(empty)
            if sloping:
                s, i, j = sp[0], sp[1], sp[2]
                if s.steps is None:
                    a = s.row0 - w._lo
                    steps = w._rows[a + i:a + j]
                else:
                    steps = s.steps[i:j]
                v = cache[key] = _slope(vals, steps, name, n)
                return v
            v = cache[key] = reduce(vals, w, name, n, end)
            return v

        return f

    return build


def _count_compare(node: Call, cmp: Callable[[Any, Any], Any], c: float) -> Fn:
    """``count(x, n, lag) <op> c`` as one closure: the count from the window's index range (shared with the
    other functions of that window at the step, as ``count`` itself), no result cached under its own key."""
    name = node.args[0].name  # type: ignore[union-attr]
    n = int(node.args[1].value)  # type: ignore[union-attr]
    lag = int(node.args[2].value) if len(node.args) > 2 else 0  # type: ignore[union-attr]
    span = f"({name}, {n}, {lag})"

    def f(w: Window, at: int, seq: int) -> bool:
        cache = w.cache
        sp: Any
        if w.cache_at != at:
            cache.clear()
            w.cache_at = at
            sp = cache[span] = [*w.locate(name, at, n, lag), None]
        else:
            sp = cache.get(span)
            if sp is None:
                sp = cache[span] = [*w.locate(name, at, n, lag), None]
        return cmp(float(sp[2] - sp[1]), c)  # type: ignore[no-any-return]

    return f


_SLIDE_MIN = 20
"""Windows of ``median``, ``min`` and ``max`` this many steps long or longer keep their sorted values across
steps (``Window.slides``); shorter ones sort again, which measured as cheap (callgrind's instruction count
over the default pack: the same at 10 and 20, more below) and keeps nothing per run between steps."""


def _slide(w: Window, span: str, s: _Series, i: int, j: int) -> list[Any]:
    """The sorted non-NaN values ``s.values[i:j]`` and their NaN count, as ``Window.slides[span]``:
    ``[series, first value number, end value number, sorted values, NaN count]``.

    The sorted values (an ``array('d')``: unboxed, one block a window) are ``sorted()`` of the values in
    window order, kept so from one evaluation to the next: the
    values that left the window (the oldest) are removed at ``bisect_left`` (among equal values, 0.0 and
    -0.0, the oldest is the first, as a stable sort puts it) and those that entered (the newest) inserted
    at ``bisect_right`` (after their equals). So they are the very list a sort of the window gives, element
    for element, and any value read from them is the same float. A window that moved back, jumped past the last
    one, lost values to a trim or belongs to another series object is sorted again.
    """
    base = s.base
    lo, hi = base + i, base + j
    sl = w.slides.get(span)
    if sl is not None and sl[0] is s:
        lo0, hi0 = sl[1], sl[2]
        if lo0 + 1 == lo and hi0 + 1 == hi and base <= lo0 and lo <= hi0:
            # One step on (nearly always): the oldest value leaves, the newest enters.
            vals, srt = s.values, sl[3]
            x = vals[i - 1]
            if x == x:
                del srt[bisect_left(srt, x)]
            else:
                sl[4] -= 1
            x = vals[j - 1]
            if x == x:
                insort_right(srt, x)
            else:
                sl[4] += 1
            sl[1], sl[2] = lo, hi
            return sl
        if lo0 == lo and hi0 == hi:
            return sl
        if base <= lo0 <= lo <= hi0 <= hi:
            vals, srt = s.values, sl[3]
            for k in range(lo0 - base, i):
                x = vals[k]
                if x == x:
                    del srt[bisect_left(srt, x)]
                else:
                    sl[4] -= 1
            for k in range(hi0 - base, j):
                x = vals[k]
                if x == x:
                    insort_right(srt, x)
                else:
                    sl[4] += 1
            sl[1], sl[2] = lo, hi
            return sl
    got = s.values[i:j].tolist()
    t = sum(got)
    srt = array("d", sorted([x for x in got if x == x] if t != t else got))  # t != t: a NaN (or inf and -inf)
    sl = w.slides[span] = [s, lo, hi, srt, len(got) - len(srt)]
    return sl


_isnan = math.isnan


def _has_nan(vals: Sequence[float]) -> bool:
    # A sum is NaN when a value is NaN (or +inf and -inf meet): one C loop, and a closer look only then.
    t = sum(vals)
    return t != t and any(map(math.isnan, vals))


def _fsum(vals):  # type: ignore[no-untyped-def]
    """math.fsum, but inf + -inf gives nan (as float addition does) instead of raising ValueError."""
    try:
        return math.fsum(vals)
    except ValueError:
        return float("nan")


def _avg(vals: Sequence[float], *_: Any) -> float:
    try:
        return math.fsum(vals) / len(vals)
    except ValueError:  # inf + -inf: _fsum's nan
        return math.nan


def _min(vals: Sequence[float], *_: Any) -> float:
    return math.nan if _has_nan(vals) else min(vals)


def _max(vals: Sequence[float], *_: Any) -> float:
    return math.nan if _has_nan(vals) else max(vals)


def _std(vals: Sequence[float], *_: Any) -> float:
    m = _fsum(vals) / len(vals)
    return math.sqrt(_fsum([(v - m) ** 2 for v in vals]) / len(vals))


def _median(vals: Sequence[float], *_: Any) -> float:
    t = sum(vals)
    if t != t and any(map(math.isnan, vals)):
        return math.nan
    srt = sorted(vals)
    mid = len(srt) // 2
    return srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2


def _count(vals: Sequence[float], *_: Any) -> float:
    return float(len(vals))


def _delta(vals: Sequence[float], *_: Any) -> float:
    return vals[-1] - vals[0]


def _slope(ys: Sequence[float], steps: Sequence[int], name: str, n: int) -> float:
    """Least-squares slope of ``ys`` over ``steps`` (Window.points of the window)."""
    if len(ys) < 2:
        raise MissingDataError(f"slope({name}, {n}): needs 2 values, has {len(ys)}")
    k = len(steps)
    first = steps[0]
    my = _fsum(ys) / len(ys)
    if steps[-1] - first == k - 1 and -_EXACT < first < _EXACT:
        # Consecutive steps (nearly always): x - mean(x) is exactly i - (k - 1) / 2 (halves of small
        # integers, exact in floats, as is the correctly rounded int mean), so those and their sum
        # of squares are computed once per length: the same floats, the same sums, as below.
        dx, sxx = _centred(k)
    else:
        mx = sum(steps) / k
        dx = [x - mx for x in steps]
        sxx = sum([d ** 2 for d in dx])
    return _fsum([d * (y - my) for d, y in zip(dx, ys, strict=True)]) / sxx


_EXACT = 2**50
"""Steps below this in magnitude are exact in floats with room for the half of a centred mean."""


@functools.lru_cache(maxsize=64)
def _centred(k: int) -> tuple[list[float], float]:
    mx = sum(range(k)) / k  # the mean of 0..k-1; of first..first+k-1 it is first + this, exactly
    dx = [i - mx for i in range(k)]
    return dx, sum([d ** 2 for d in dx])


def _zscore(vals: list[float], w: Window, name: str, n: int, at: int) -> float:
    x = w.value(name, at)
    prev = w.values(name, n, at - 1)
    if len(prev) < 2:
        raise MissingDataError(f"zscore({name}, {n}): needs 2 earlier values, has {len(prev)}")
    m = _fsum(prev) / len(prev)
    sd = _std(prev)
    if sd == 0:
        return 0.0 if x == m else math.copysign(math.inf, x - m)
    return (x - m) / sd


_REDUCERS: dict[str, Callable[..., float]] = {
    "avg": _avg, "min": _min, "max": _max, "std": _std, "median": _median, "count": _count,
    "delta": _delta, "slope": _delta, "zscore": _zscore,  # slope: computed in _window_fn (steps needed)
}


def _build_best(c: _Compiler, node: Call) -> Fn:
    name = node.args[0].name  # type: ignore[union-attr]
    c.read(name)
    if len(node.args) == 2:
        n = int(node.args[1].value)  # type: ignore[union-attr]

        def best_n(w: Window, at: int, seq: int) -> float:
            vals = [v for v in w.values(name, n, at) if v == v]
            if not vals:
                raise MissingDataError(f"best({name}, {n}): no finite values in the last {n} steps")
            return max(vals)

        return best_n
    return lambda w, at, seq: w.best(name, at)


def _build_since_best(c: _Compiler, node: Call) -> Fn:
    name = node.args[0].name  # type: ignore[union-attr]
    c.read(name)
    return lambda w, at, seq: float(w.since_best(name, at))


def _build_lowest(c: _Compiler, node: Call) -> Fn:
    name = node.args[0].name  # type: ignore[union-attr]
    c.read(name)
    return lambda w, at, seq: w.lowest(name)


def _build_holds(c: _Compiler, node: Call) -> Fn:
    c.optional_depth += 1
    try:
        cond = c.cond(node.args[0], "holds()")
    finally:
        c.optional_depth -= 1

    if _reads_seq(node):
        def f(w: Window, at: int, seq: int) -> bool:
            try:
                return bool(cond(w, at, seq))
            except MissingDataError:
                return False

        return f

    # A confirmation is often shared by many rules (``not holds(aborted_ratio > ...)`` in eight of the
    # default pack), and often fails on a metric the run does not log: its value at a step is cached
    # with the window functions', under a text naming every parameter's value (packs evaluated on
    # one window may differ in them). Not when it reads events since the last evaluation (``seq``).
    key = "holds:" + _key(node.args[0], c.params)

    def held(w: Window, at: int, seq: int) -> bool:
        cache = w.cache
        if w.cache_at != at:
            cache.clear()
            w.cache_at = at
        else:
            v = cache.get(key)
            if v is not None:
                return v  # type: ignore[no-any-return]
        try:
            v = bool(cond(w, at, seq))
        except MissingDataError:
            v = False
        cache[key] = v
        return v

    c.holds[id(held)] = (cond, key)
    c.keep.append(held)  # ids stay unique while compiling
    return held


def _reads_seq(node: Node) -> bool:
    """True when the expression calls ``event()`` (its value depends on the evaluation's ``seq``)."""
    if isinstance(node, Call):
        return node.func == "event" or any(_reads_seq(a) for a in node.args)
    if isinstance(node, (Unary, Not)):
        return _reads_seq(node.operand)
    if isinstance(node, (Binary, BoolOp)):
        return _reads_seq(node.left) or _reads_seq(node.right)
    if isinstance(node, Compare):
        return any(_reads_seq(o) for o in node.operands)
    return False


def _key(node: Node, params: Mapping[str, float]) -> str:
    """Exact text of an expression for a cache key: fully parenthesised, numbers by repr, and each
    ``$param`` with its value (two expressions with one key compute the same)."""
    if isinstance(node, Num):
        return repr(node.value)
    if isinstance(node, Param):
        return f"${node.name}={float(params[node.name])!r}"
    if isinstance(node, Str):
        return repr(node.value)
    if isinstance(node, Step):
        return "step"
    if isinstance(node, Metric):
        return node.name
    if isinstance(node, Unary):
        return f"(-{_key(node.operand, params)})"
    if isinstance(node, (Binary, BoolOp)):
        return f"({_key(node.left, params)} {node.op} {_key(node.right, params)})"
    if isinstance(node, Compare):
        parts = [_key(node.operands[0], params)]
        for op, operand in zip(node.ops, node.operands[1:], strict=True):
            parts += [op, _key(operand, params)]
        return "(" + " ".join(parts) + ")"
    if isinstance(node, Not):
        return f"(not {_key(node.operand, params)})"
    return f"{node.func}(" + ", ".join(_key(a, params) for a in node.args) + ")"


def _build_count_over(c: _Compiler, node: Call) -> Fn:
    if c.in_count_over:
        raise ExprError(node.col, "count_over() cannot be nested")
    c.in_count_over = True
    outer, c.max_window = c.max_window, 1
    try:
        cond = c.cond(node.args[0], "count_over()")
    finally:
        c.in_count_over = False
        inner = c.max_window
    n = int(node.args[1].value)  # type: ignore[union-attr]
    if n * inner > MAX_COUNT_OVER_READS:
        raise ExprError(node.col, f"count_over() judges its condition at each of its {n:,} steps, and the condition "
                                  f"reads {inner:,} steps back: {n * inner:,} values a step, more than "
                                  f"{MAX_COUNT_OVER_READS:,}; shorten one of the windows")
    # Its reach: the condition is judged n - 1 steps back too, and reads its own windows from there (sized by
    # max(n, inner) alone, a window trimmed in halves held too few of those steps, and a median(kl, 20) judged
    # 9 steps back was taken over 12 values, silently).
    c.max_window = max(outer, n - 1 + inner)

    def f(w: Window, at: int, seq: int) -> float:
        k = 0
        for s in w.steps(n, at):
            try:
                if cond(w, s, seq):
                    k += 1
            except MissingDataError:
                pass  # a step without the data simply does not count
        return float(k)

    return f


def _build_isnan(c: _Compiler, node: Call) -> Fn:
    f = c.num(node.args[0], "isnan()")
    return lambda w, at, seq: math.isnan(f(w, at, seq))


def _build_isfinite(c: _Compiler, node: Call) -> Fn:
    f = c.num(node.args[0], "isfinite()")
    return lambda w, at, seq: math.isfinite(f(w, at, seq))


def _build_nonfinite(c: _Compiler, node: Call) -> Fn:
    names = [a.name for a in node.args]  # type: ignore[union-attr]
    for n in names:
        c.read(n)
    if not names:
        return lambda w, at, seq: at in w.nonfinite_steps

    def f(w: Window, at: int, seq: int) -> bool:
        for name in names:
            try:
                if not math.isfinite(w.value(name, at)):
                    return True
            except MissingDataError:
                continue  # a metric this run does not log cannot be non-finite
        return False

    return f


def _build_event(c: _Compiler, node: Call) -> Fn:
    if c.in_count_over:
        raise ExprError(node.col, "event() counts events since the last evaluation; it cannot be used in count_over()")
    kind = str(node.args[0].value)  # type: ignore[union-attr]
    return lambda w, at, seq: float(w.count_events(kind, seq))


def _build_event_count(c: _Compiler, node: Call) -> Fn:
    kind = str(node.args[0].value)  # type: ignore[union-attr]
    n = int(node.args[1].value)  # type: ignore[union-attr]
    return lambda w, at, seq: float(w.count_events_in(kind, n, at))


def _build_abs(c: _Compiler, node: Call) -> Fn:
    f = c.num(node.args[0], "abs()")
    return lambda w, at, seq: abs(f(w, at, seq))


def _build_clamp(op: Callable[[float, float], float], name: str) -> Callable[[_Compiler, Call], Fn]:
    def build(c: _Compiler, node: Call) -> Fn:
        f = c.num(node.args[0], f"{name}()")
        b = c.num(node.args[1], f"{name}()")

        bound = c.const(node.args[1])
        if bound is not None and not math.isnan(bound):
            # A constant bound (``clamp_min(median(kl, 5, 1), $kl_floor)``), the builtin inlined:
            # max(x, bound) is x unless bound > x, min(x, bound) x unless bound < x.
            if op is max:
                def lo(w: Window, at: int, seq: int) -> float:
                    x = f(w, at, seq)
                    return math.nan if x != x else (bound if bound > x else x)  # x != x: NaN

                return lo

            def hi(w: Window, at: int, seq: int) -> float:
                x = f(w, at, seq)
                return math.nan if x != x else (bound if bound < x else x)

            return hi

        def g(w: Window, at: int, seq: int) -> float:
            x, bound = f(w, at, seq), b(w, at, seq)
            return math.nan if math.isnan(x) or math.isnan(bound) else op(x, bound)

        return g

    return build


def _build_default(c: _Compiler, node: Call) -> Fn:
    f = c.num(node.args[0], "default()")
    lit = node.args[1]
    fallback = lit.value if isinstance(lit, Num) else -float(lit.operand.value)  # type: ignore[union-attr]

    def g(w: Window, at: int, seq: int) -> float:
        try:
            return f(w, at, seq)
        except MissingDataError:
            return fallback

    return g


_BUILD: dict[str, Callable[[_Compiler, Call], Fn]] = {
    **{k: _window_fn(k) for k in _REDUCERS},
    "best": _build_best,
    "since_best": _build_since_best,
    "lowest": _build_lowest,
    "holds": _build_holds,
    "count_over": _build_count_over,
    "isnan": _build_isnan,
    "isfinite": _build_isfinite,
    "nonfinite": _build_nonfinite,
    "event": _build_event,
    "event_count": _build_event_count,
    "abs": _build_abs,
    "clamp_min": _build_clamp(max, "clamp_min"),
    "clamp_max": _build_clamp(min, "clamp_max"),
    "default": _build_default,
}


def compile_expr(text: str, want: str = BOOL, params: Mapping[str, float] | None = None) -> Compiled:
    """Parse, type check and compile an expression; ``want`` is the required result type.

    ``params``: the rule pack's parameters (``$name`` in the text), bound as constants here.
    """
    node = parse(text)
    c = _Compiler(params or {})
    fn, typ = c.compile(node)
    if typ != want:
        hint = ' (compare it, e.g. event("oom") > 0)' if want == BOOL else ""
        raise ExprError(_col(node), f"expression must be a {want}, got a {typ}{hint}")
    return Compiled(text, node, fn, tuple(c.inputs.items()), frozenset(c.metrics), frozenset(c.required),
                    c.max_window)
