"""Rule files: YAML parsed into typed, validated rules, every error at once with file:line:col.

Format (``version: 1``)::

    version: 1
    params:                                # named numbers the expressions read as $name
      kl_jump:
        value: 2.0
        description: why this number       # required: the rationale
        calibrate: {stat: "kl / clamp_min(median(kl, 5, 1), 0.05)", margin: 1.25, min: 1.5}
    rules:
      - name: kl_high                      # [a-z][a-z0-9_]*, unique over all files
        description: why this rule exists  # required: the rationale
        expr: avg(kl, 3) > 0.1             # condition (see ppo_watchdog.core.expr)
        summary: "KL {{ avg(kl, 3) }} over 3 steps, above 0.1"   # the decision in words (core.summary)
        for: 3                             # consecutive steps the condition must hold (0 = 1 = at once)
        clear: kl < 0.08                   # hysteresis: a firing rule resolves when this holds (default: not expr)
        keep_firing_for: 0                 # steps the clear condition must hold before resolving
        actions:                           # run in order when the rule fires
          - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.02}
          - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5, grow: true}   # x0.5, x0.25, ...
          - rollback: {skip_batches: 2}
          - checkpoint
          - pause: {reason: "..."}
          - notify: {message: "..."}
        cooldown: 10                       # steps between two fires of this rule
        repeat: true                       # fire again each cooldown while the condition holds
        budget: {max: 3, window: 100, escalate: [pause, notify]}   # more fires -> escalate
        severity: warning                  # info | warning | critical
        labels: {team: rl}
        enabled: true
        divergence: false                  # firing marks checkpoints as not known-good
        urgent: false                      # a relaunch it needs goes at once (else: at the next checkpoint)

An *overlay* pack holds only ``params:`` with new values (``kl_jump: 2.5``) for parameters a
pack loaded before it declares; ``watchdog rules calibrate`` writes one for a family of runs.
A ``budget`` may also say ``progress: N``: every fire is forgotten once the run has trained N
steps since the last one (it recovered), which is also when a growing ``set`` starts over.

YAML is composed to nodes (``yaml.compose`` with the safe loader, no object
construction from tags) so every value keeps its line and column for messages.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppo_watchdog.core import actions as act
from ppo_watchdog.core.expr import BOOL, NUM, Compiled, ExprError, compile_expr
from ppo_watchdog.core.summary import Summary, TemplateError, parse_summary, unknown_reads
from ppo_watchdog.protocol import inputs

RULES_VERSION = 1
SEVERITIES = ("info", "warning", "critical")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_FLOAT = re.compile(r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")


INSTALLED_RULES = "share/ppo-watchdog/rules"
"""Where a wheel installs the default pack, under the environment's prefix (pyproject's data-files)."""
MAX_STEPS = 10_000_000
"""Bound of every step count in a rule file (``for``, ``cooldown``, ``skip_batches``, budgets): more
steps than any run trains, so a larger one is a typo, not a setting."""
RULES_ENV = "WATCHDOG_RULES"
"""Environment variable naming the rule files used when none are given (os.pathsep-separated)."""


DEFAULT_PACK = "default"
"""The name ``--rules`` (and a daemon config's ``rules:``) takes for the shipped default pack, beside file paths."""


def shipped_default_pack() -> Path:
    """The default pack that ships with the watchdog: ``rules/default.yaml`` beside the ``watchdog`` package
    (an editable install or a checkout), else the copy a wheel installs
    (``<prefix>/share/ppo-watchdog/rules/default.yaml``), else ``./rules/default.yaml``.
    FileNotFoundError when none exists."""
    here = Path(__file__).resolve().parents[1]  # the watchdog package
    for cand in (here.parent / "rules" / "default.yaml", Path(sys.prefix) / INSTALLED_RULES / "default.yaml",
                 Path.cwd() / "rules" / "default.yaml"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no default rule pack found (looked beside the package and in ./rules); "
                            f"pass --rules FILE or set {RULES_ENV}")


def default_rules_paths() -> list[Path]:
    """The rule files used when none are given: $WATCHDOG_RULES (os.pathsep-separated), else the shipped
    default pack (:func:`shipped_default_pack`). FileNotFoundError when none exists."""
    env = os.environ.get(RULES_ENV)
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [shipped_default_pack()]


def rule_paths(given: Sequence[str | Path] | None = None, extra: Sequence[str | Path] = ()) -> list[Path]:
    """The rule files a command loads: ``given`` (``--rules``; none: :func:`default_rules_paths`), where the name
    ``default`` is the shipped default pack (a file called ``default`` in the working directory is still that
    file), then ``extra`` (``--extra-rules``), which adds to the pack instead of replacing it."""
    paths: list[Path] = []
    for p in (given or default_rules_paths()):
        paths.append(shipped_default_pack() if str(p) == DEFAULT_PACK and not Path(p).exists() else Path(p))
    return paths + [Path(p) for p in extra]


def packs_text(ruleset: RuleSet) -> str:
    """The packs of a rule set in one line, each with its rule count (an overlay with its parameters):
    ``rules: default.yaml (23 rules), family.yaml (overlay: 2 params)``."""
    rules: dict[str, int] = {}
    for r in ruleset.rules:
        f = r.source.rsplit(":", 1)[0]
        rules[f] = rules.get(f, 0) + 1
    params: dict[str, int] = {}
    for prm in ruleset.params:
        if prm.overridden_by:
            f = prm.overridden_by.rsplit(":", 1)[0]
            params[f] = params.get(f, 0) + 1
    parts = []
    for f in ruleset.sources:
        n = rules.get(f, 0)
        k = params.get(f, 0)
        what = f"{n} rule{'s' * (n != 1)}" if n or not k else f"overlay: {k} param{'s' * (k != 1)}"
        parts.append(f"{Path(f).name} ({what})")
    return "rules: " + ", ".join(parts)


@dataclass(frozen=True)
class RuleError:
    """One problem in a rule (or rule test) file, at a 1-based line and column."""

    file: str
    """Path as given."""
    line: int
    """1-based line."""
    col: int
    """1-based column."""
    message: str
    """What is wrong, naming the key or value."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"


class RuleFileError(ValueError):
    """One or more rule files are invalid; ``errors`` lists every problem found."""

    def __init__(self, errors: Sequence[RuleError]) -> None:
        self.errors = sorted(errors, key=lambda e: (e.file, e.line, e.col))
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Budget:
    """At most ``max`` fires in any ``window`` steps; beyond that the rule escalates."""

    max: int
    """Fires allowed per window."""
    window: int
    """Window in steps."""
    escalate: tuple[act.Action, ...] = (act.PauseAction("budget exhausted"), act.NotifyAction())
    """Actions of an escalation (default: pause and notify a human)."""
    progress: int | None = None
    """Steps trained without a fire after which every earlier fire is forgotten (the run recovered)."""


@dataclass(frozen=True)
class Calibration:
    """How ``watchdog rules calibrate`` proposes a parameter from healthy runs."""

    stat: Compiled
    """A number per step whose largest value on a healthy run the parameter must stay above."""
    when: Compiled | None
    """Steps that count (the rule's own warm-up gate); None: every step where the stat has data."""
    margin: float
    """Proposed value = margin x the largest stat seen on the healthy runs."""
    min: float | None = None
    """The proposal never goes below this (a principle, not a fit: e.g. KL at least doubles)."""
    max: float | None = None
    """The proposal never goes above this."""


@dataclass(frozen=True)
class Param:
    """A named number of a rule pack, read as ``$name`` in expressions."""

    name: str
    """Parameter name."""
    value: float
    """Its value (an overlay's, when one overrode it)."""
    description: str
    """Why this number."""
    calibrate: Calibration | None = None
    """How to propose it from healthy runs; None: not calibrated (a principle, not a noise level)."""
    source: str = ""
    """file:line of the declaration."""
    overridden_by: str = ""
    """file:line of the overlay that set ``value``, if any."""


@dataclass(frozen=True)
class Rule:
    """One validated, compiled rule."""

    name: str
    """Unique name."""
    description: str
    """Why the rule exists and why these numbers."""
    expr: Compiled
    """Condition."""
    actions: tuple[act.Action, ...]
    """Run in order on each fire."""
    for_: int = 0
    """Consecutive steps the condition must hold before firing."""
    clear: Compiled | None = None
    """Resolve condition (hysteresis); None: resolve when ``expr`` is false."""
    keep_firing_for: int = 0
    """Steps the clear condition must hold before the rule resolves."""
    cooldown: int = 0
    """Minimum steps between two fires."""
    repeat: bool = False
    """Fire again after each cooldown while the condition still holds."""
    budget: Budget | None = None
    """Fire budget and escalation."""
    severity: str = "warning"
    """info | warning | critical."""
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form labels (routing, ownership)."""
    enabled: bool = True
    """Disabled rules are loaded and checked but never evaluated."""
    divergence: bool = False
    """While this rule fires, checkpoints taken are not known-good."""
    urgent: bool = False
    """A relaunch this rule's sets need goes at once; otherwise it waits for the next checkpoint
    (divergence rules are always urgent: they roll back)."""
    source: str = ""
    """file:line where the rule is defined."""
    summary: Summary | None = None
    """What it saw, in one sentence with its numbers (``{{ kl }}``); None: the engine's message stands."""

    @property
    def max_window(self) -> int:
        """Steps of history this rule reads."""
        return max(self.expr.max_window, self.clear.max_window if self.clear else 1, self.for_ + 1)

    @property
    def metrics(self) -> frozenset[str]:
        """Short names its condition and clear condition read."""
        return self.expr.metrics | (self.clear.metrics if self.clear is not None else frozenset())


@dataclass(frozen=True)
class RuleSet:
    """Rules from one or more files, in file order."""

    rules: tuple[Rule, ...] = ()
    """The rules."""
    sources: tuple[str, ...] = ()
    """Files they came from."""
    params: tuple[Param, ...] = ()
    """The pack's parameters, after overlays."""

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, name: str) -> Rule | None:
        """The rule called ``name``, or None."""
        return next((r for r in self.rules if r.name == name), None)

    @property
    def names(self) -> list[str]:
        """Rule names in order."""
        return [r.name for r in self.rules]

    @property
    def max_window(self) -> int:
        """Steps of history the whole set reads (a good Window size)."""
        return max((r.max_window for r in self.rules), default=1)

    @functools.cached_property
    def metrics(self) -> frozenset[str]:
        """Short names any rule reads, disabled ones too: the metrics a daemon's windows keep
        (computed once: every window of the daemon shares the one set)."""
        return frozenset().union(*(r.metrics for r in self.rules))

    def only(self, names: Sequence[str]) -> RuleSet:
        """A subset by name (order kept); KeyError naming an unknown one."""
        missing = [n for n in names if self.get(n) is None]
        if missing:
            raise KeyError(f"unknown rule(s): {', '.join(missing)}")
        return RuleSet(tuple(r for r in self.rules if r.name in names), self.sources, self.params)


# -- marked YAML helpers (shared with ruletest) ----------------------------------------

_CONSTRUCTOR = yaml.constructor.SafeConstructor()

#: The most alias references (``*name``) a rule or test file may make. An alias shares a node, and each use
#: is read again: 3,000 uses of a 1 MB description are 3 GB to read (a "billion laughs"). Anchors for a
#: shared action list are a dozen uses, not a hundred.
MAX_ALIASES = 100
#: The largest rule, test or labels file read (the default pack is about 50 KB).
MAX_FILE_BYTES = 4 * 2**20
#: C0 and C1 control characters other than tab and newline: in a name, description or message they would
#: drive the terminal that prints it (clear it, recolour it, rewrite a line).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NUMBER_TAGS = frozenset(("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"))
_YAML11_TRAP = re.compile(r"^[-+]?(?:(?P<sexagesimal>[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)|0[0-7_]+)$")
"""A plain number YAML 1.1 reads in base 60 (``1:30``) or 8 (``010``): refused, with what it would have been."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing more than :data:`MAX_ALIASES` alias references."""

    _aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_ALIASES} aliases (*name): not a rule file (a YAML alias bomb?)",
                    self.peek_event().start_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


class YamlReader:
    """Reads a composed YAML node tree and collects errors with positions instead of raising."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.errors: list[RuleError] = []

    def error(self, node: yaml.Node | None, message: str, col_offset: int = 0) -> None:
        line, col = (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (1, 1)
        self.errors.append(RuleError(self.file, line, col + col_offset, message))

    def compose(self, text: str) -> yaml.Node | None:
        """Compose YAML text to nodes; a syntax error is recorded and None returned."""
        try:
            return yaml.compose(text, Loader=_Loader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            self.errors.append(RuleError(self.file, line, col, f"YAML syntax error: {exc.problem or exc}"))
        except yaml.YAMLError as exc:
            self.errors.append(RuleError(self.file, 1, 1, f"YAML error: {exc}"))
        except RecursionError:  # PyYAML's scanner and composer recurse once per nesting level
            self.errors.append(RuleError(self.file, 1, 1, "YAML nested too deeply (hundreds of levels): "
                                                          "not a rule file"))
        return None

    def mapping(
        self, node: yaml.Node, where: str, allowed: Sequence[str], required: Sequence[str] = ()
    ) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """A mapping's entries by key (key node, value node); unknown, duplicate and missing keys are errors."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where} must be a mapping, got {_kind(node)}")
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if not isinstance(key, str):
                self.error(k, f"{where}: keys must be strings")
                continue
            if key in out:
                self.error(k, f"{where}: duplicate key {key!r}")
                continue
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.error(k, f"{where}: unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")
                continue
            out[key] = (k, v)
        for key in required:
            if key not in out:
                self.error(node, f"{where}: missing required key {key!r}")
        return out

    def scalar(self, node: yaml.Node) -> Any:
        """A scalar's Python value (safe constructor); lists/maps are returned as the node. A scalar that is no
        value (``!!int abc``, ``1:30``) is an error, and None."""
        return self._scalar(node)[0]

    def _scalar(self, node: yaml.Node) -> tuple[Any, bool]:
        """(:meth:`scalar`, False when it recorded an error): the typed readers say nothing more of that node."""
        if not isinstance(node, yaml.ScalarNode):
            return node, True
        try:
            value = _CONSTRUCTOR.construct_object(node)
        except (yaml.YAMLError, ValueError, OverflowError, TypeError) as exc:  # (!!int abc, !!float x, a bad date)
            self.error(node, f"bad scalar {inputs.short_repr(node.value, 40)}: {exc}")
            return None, False
        if node.style is None and node.tag in _NUMBER_TAGS and (trap := _YAML11_TRAP.match(node.value)):
            # YAML 1.1 (PyYAML) reads `for: 1:30` as 90 and `cooldown: 010` as 8; nobody means either.
            how = "a base-60 number" if trap.group("sexagesimal") else "an octal number"
            self.error(node, f"{node.value} is {how} in YAML 1.1 ({value!r}): write the number in decimal, without "
                             "':' or a leading 0")
            return None, False
        return value, True

    def string(self, node: yaml.Node, where: str, allow_empty: bool = False) -> str | None:
        v, ok = self._scalar(node)
        if not ok:
            return None
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            self.error(node, f"{where} must be a {'non-empty ' if not allow_empty else ''}string, got {_show(v)}")
            return None
        if (bad := _CONTROL.search(v)) is not None:
            self.error(node, f"{where} holds a control character (U+{ord(bad.group()):04X}): only tab and newline are "
                             "allowed")
            return None
        return v

    def integer(self, node: yaml.Node, where: str, minimum: int = 0, maximum: int = MAX_STEPS) -> int | None:
        v, ok = self._scalar(node)
        if not ok:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.error(node, f"{where} must be a whole number >= {minimum}, got {_show(v)}")
            return None
        if v > maximum:
            self.error(node, f"{where} must be a whole number <= {maximum:,}, got {_show(v)}")
            return None
        return v

    def number(self, node: yaml.Node, where: str) -> float | None:
        v, ok = self._scalar(node)
        if not ok:
            return None
        # PyYAML (YAML 1.1) reads 1e-3 as a string; a rule author means the number.
        if isinstance(v, str) and _FLOAT.match(v.strip()):
            v = float(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.error(node, f"{where} must be a number, got {_show(v)}")
            return None
        if isinstance(v, int) and abs(v) > sys.float_info.max or not math.isfinite(v):  # (an int no float holds)
            self.error(node, f"{where} must be a finite number, got {_show(v)}")
            return None
        return float(v)

    def boolean(self, node: yaml.Node, where: str) -> bool | None:
        v, ok = self._scalar(node)
        if not ok:
            return None
        if not isinstance(v, bool):
            self.error(node, f"{where} must be true or false, got {_show(v)}")
            return None
        return v

    def sequence(self, node: yaml.Node, where: str) -> list[yaml.Node] | None:
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, f"{where} must be a list, got {_kind(node)}")
            return None
        return list(node.value)


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value) if isinstance(node, yaml.ScalarNode) else "nothing"


def _show(v: Any) -> str:
    if isinstance(v, yaml.Node):
        return _kind(v)
    return inputs.short_repr(v)


# -- rules ----------------------------------------------------------------------------

_RULE_KEYS = (
    "name", "description", "expr", "for", "clear", "keep_firing_for", "actions", "cooldown", "repeat",
    "budget", "severity", "labels", "enabled", "divergence", "urgent", "summary",
)


def _expr(r: YamlReader, node: yaml.Node, where: str, params: dict[str, float] | None = None,
          want: str = BOOL) -> Compiled | None:
    text = r.scalar(node)
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str) or not text.strip():
        r.error(node, f"{where} must be an expression string, got {_show(text)}")
        return None
    try:
        return compile_expr(text, want, params or {})
    except ExprError as exc:
        # A plain or quoted one-line scalar maps expression columns onto file columns.
        style = getattr(node, "style", None)
        one_line = node.start_mark.line == node.end_mark.line and "\n" not in text.strip()
        if one_line and style in (None, "'", '"'):
            r.error(node, f"{where}: {exc.message}", col_offset=exc.col - 1 + (1 if style else 0))
        else:
            r.error(node, f"{where}: column {exc.col} of the expression: {exc.message}")
        return None


def _set_action(r: YamlReader, node: yaml.Node, where: str) -> act.Action | None:
    m = r.mapping(node, where, ("key", "scale", "add", "to", "min", "max", "grow"), required=("key",))
    if m is None:
        return None
    key = r.string(m["key"][1], f"{where}.key") if "key" in m else None
    if key is not None and key not in act.TUNABLE_KEYS:
        close = difflib.get_close_matches(key, list(act.TUNABLE_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        r.error(m["key"][1], f"{where}.key: {key!r} is not a tunable key{hint}")
        key = None
    ops = [o for o in act.SET_OPS if o in m]
    if len(ops) != 1:
        r.error(node, f"{where}: give exactly one of scale, add, to (got {', '.join(ops) or 'none'})")
        return None
    op = ops[0]
    value = r.number(m[op][1], f"{where}.{op}")
    lo = r.number(m["min"][1], f"{where}.min") if "min" in m else None
    hi = r.number(m["max"][1], f"{where}.max") if "max" in m else None
    if value is not None and op == "scale" and value <= 0:
        r.error(m[op][1], f"{where}.scale must be > 0, got {value:g}")
        return None
    if lo is not None and hi is not None and lo > hi:
        r.error(m["min"][1], f"{where}: min {lo:g} is above max {hi:g}")
        return None
    grow = r.boolean(m["grow"][1], f"{where}.grow") if "grow" in m else False
    if grow and op != "scale":
        r.error(m["grow"][1], f"{where}.grow compounds a scale (x0.5, then x0.25, ...); it needs scale, not {op}")
        return None
    if key is None or value is None or grow is None or ("min" in m and lo is None) or ("max" in m and hi is None):
        return None
    # What the set can produce must be a value the key may hold (a NaN, a negative batch, a clip range
    # above 1 never reaches a trainer).
    for name, v in (("to", value if op == "to" else None), ("min", lo), ("max", hi)):
        problem = act.value_problem(key, v) if v is not None else None
        if problem:
            r.error(m[name][1], f"{where}.{name}: {problem}")
            return None
    return act.SetAction(key, op, value, lo, hi, grow=grow)


def _action(r: YamlReader, node: yaml.Node, where: str) -> act.Action | None:
    if isinstance(node, yaml.ScalarNode):
        kind, body = r.scalar(node), None
        if kind == "set":
            r.error(node, f"{where}: 'set' needs a mapping: set: {{key: ..., scale: ...}}")
            return None
    else:
        m = r.mapping(node, where, act.ACTION_KINDS)
        if m is None:
            return None
        if len(m) != 1:
            if m:
                r.error(node, f"{where}: one action per list item, got {', '.join(m)}")
            elif not node.value:
                r.error(node, f"{where}: empty action")
            return None
        kind, (_, body) = next(iter(m.items()))
        if isinstance(body, yaml.ScalarNode) and body.tag.endswith(":null"):
            body = None
    if kind not in act.ACTION_KINDS:
        r.error(node, f"{where}: unknown action {kind!r}; known: {', '.join(act.ACTION_KINDS)}")
        return None
    w = f"{where}.{kind}"
    if kind == "set":
        return _set_action(r, body, w)  # type: ignore[arg-type]
    if body is None:
        bare: dict[str, act.Action] = {
            "rollback": act.RollbackAction(), "checkpoint": act.CheckpointAction(),
            "pause": act.PauseAction(), "notify": act.NotifyAction(),
            "restart": act.RestartAction(), "stop": act.StopAction(),
        }
        return bare[kind]
    if kind == "rollback":
        m = r.mapping(body, w, ("skip_batches",))
        if m is None:
            return None
        skip = r.integer(m["skip_batches"][1], f"{w}.skip_batches") if "skip_batches" in m else 0
        return act.RollbackAction(skip) if skip is not None else None
    if kind == "checkpoint":
        r.mapping(body, w, ())
        return act.CheckpointAction()
    field_name = "message" if kind == "notify" else "reason"
    m = r.mapping(body, w, (field_name,))
    if m is None:
        return None
    text = r.string(m[field_name][1], f"{w}.{field_name}") if field_name in m else ""
    if text is None:
        return None
    made: dict[str, type[act.PauseAction | act.StopAction | act.RestartAction | act.NotifyAction]] = {
        "pause": act.PauseAction, "stop": act.StopAction, "restart": act.RestartAction, "notify": act.NotifyAction}
    return made[kind](text)


def _actions(r: YamlReader, node: yaml.Node, where: str) -> tuple[act.Action, ...] | None:
    items = r.sequence(node, where)
    if items is None:
        return None
    if not items:
        r.error(node, f"{where}: needs at least one action (use notify for an alert-only rule)")
        return None
    out = [_action(r, item, f"{where}[{i}]") for i, item in enumerate(items)]
    if any(a is None for a in out):
        return None
    return tuple(a for a in out if a is not None)


def _budget(r: YamlReader, node: yaml.Node, where: str) -> Budget | None:
    m = r.mapping(node, where, ("max", "window", "escalate", "progress"), required=("max", "window"))
    if m is None or "max" not in m or "window" not in m:
        return None
    mx = r.integer(m["max"][1], f"{where}.max", minimum=1)
    win = r.integer(m["window"][1], f"{where}.window", minimum=1)
    esc = _actions(r, m["escalate"][1], f"{where}.escalate") if "escalate" in m else Budget.escalate
    progress = r.integer(m["progress"][1], f"{where}.progress", minimum=1) if "progress" in m else None
    if mx is None or win is None or esc is None or ("progress" in m and progress is None):
        return None
    return Budget(mx, win, esc, progress)


_PARAM_KEYS = ("value", "description", "calibrate")
_CALIBRATE_KEYS = ("stat", "when", "margin", "min", "max")


def _params(r: YamlReader, node: yaml.Node) -> list[tuple[str, yaml.Node, float, dict[str, Any] | None]]:
    """``params:`` entries as (name, node, value, declaration or None for a value-only override)."""
    m = r.mapping(node, "params", _AnyKeys())
    out: list[tuple[str, yaml.Node, float, dict[str, Any] | None]] = []
    for name, (knode, vnode) in (m or {}).items():
        where = f"params.{name}"
        if not _NAME.match(name):
            r.error(knode, f"{where}: a parameter name must match [a-z][a-z0-9_]*")
            continue
        if not isinstance(vnode, yaml.MappingNode):
            value = r.number(vnode, where)
            if value is not None and _finite(r, vnode, where, value):
                out.append((name, knode, value, None))
            continue
        pm = r.mapping(vnode, where, _PARAM_KEYS, required=("value",))
        if pm is None or "value" not in pm:
            continue
        value = r.number(pm["value"][1], f"{where}.value")
        if value is None or not _finite(r, pm["value"][1], f"{where}.value", value):
            continue
        decl: dict[str, Any] | None = None
        if "description" in pm or "calibrate" in pm:
            desc = r.string(pm["description"][1], f"{where}.description") if "description" in pm else None
            if desc is None:
                r.error(vnode, f"{where}: a declared parameter needs a description (why this number)")
                continue
            decl = {"description": " ".join(desc.split()), "calibrate": pm.get("calibrate", (None, None))[1]}
        out.append((name, knode, value, decl))
    return out


def _finite(r: YamlReader, node: yaml.Node, where: str, value: float) -> bool:
    if value != value or value in (float("inf"), float("-inf")):
        r.error(node, f"{where} must be a finite number, got {value}")
        return False
    return True


def _calibration(r: YamlReader, node: yaml.Node, where: str, params: dict[str, float]) -> Calibration | None:
    m = r.mapping(node, where, _CALIBRATE_KEYS, required=("stat", "margin"))
    if m is None or "stat" not in m or "margin" not in m:
        return None
    stat = _expr(r, m["stat"][1], f"{where}.stat", params, want=NUM)
    when = _expr(r, m["when"][1], f"{where}.when", params) if "when" in m else None
    margin = r.number(m["margin"][1], f"{where}.margin")
    if margin is not None and margin <= 0:
        r.error(m["margin"][1], f"{where}.margin must be > 0, got {margin:g}")
        margin = None
    lo = r.number(m["min"][1], f"{where}.min") if "min" in m else None
    hi = r.number(m["max"][1], f"{where}.max") if "max" in m else None
    if lo is not None and hi is not None and lo > hi:
        r.error(m["min"][1], f"{where}: min {lo:g} is above max {hi:g}")
        return None
    if stat is None or margin is None or ("min" in m and lo is None) or ("max" in m and hi is None) \
            or ("when" in m and when is None):
        return None
    return Calibration(stat, when, margin, lo, hi)


def _rule(r: YamlReader, node: yaml.Node, index: int, params: dict[str, float] | None = None) -> Rule | None:
    where = f"rules[{index}]"
    if isinstance(node, yaml.MappingNode):
        # Name the rule in every message, even those found before its name is validated.
        for k, v in node.value:
            if getattr(k, "value", None) == "name" and isinstance(v, yaml.ScalarNode) and _NAME.match(v.value):
                where = f"rule {v.value!r}"
    m = r.mapping(node, where, _RULE_KEYS, required=("name", "description", "expr", "actions"))
    if m is None:
        return None
    name = r.string(m["name"][1], f"{where}.name") if "name" in m else None
    if name is not None and not _NAME.match(name):
        r.error(m["name"][1], f"{where}.name {name!r} must match [a-z][a-z0-9_]*")
        name = None
    if name:
        where = f"rule {name!r}"
    ok = name is not None
    desc = r.string(m["description"][1], f"{where}: description") if "description" in m else None
    expr = _expr(r, m["expr"][1], f"{where}: expr", params) if "expr" in m else None
    clear = _expr(r, m["clear"][1], f"{where}: clear", params) if "clear" in m else None
    summary = _summary(r, m["summary"][1], f"{where}: summary", expr) if "summary" in m and expr else None
    actions = _actions(r, m["actions"][1], f"{where}: actions") if "actions" in m else None
    ints: dict[str, int | None] = {
        k: r.integer(m[k][1], f"{where}: {k}") if k in m else 0 for k in ("for", "keep_firing_for", "cooldown")
    }
    bools: dict[str, bool | None] = {
        k: r.boolean(m[k][1], f"{where}: {k}") if k in m else default
        for k, default in (("repeat", False), ("enabled", True), ("divergence", False), ("urgent", False))
    }
    budget = _budget(r, m["budget"][1], f"{where}: budget") if "budget" in m else None
    severity = "warning"
    if "severity" in m:
        sev = r.scalar(m["severity"][1])
        if sev not in SEVERITIES:
            r.error(m["severity"][1], f"{where}: severity must be one of {', '.join(SEVERITIES)}, got {_show(sev)}")
            ok = False
        else:
            severity = sev
    labels: dict[str, str] = {}
    if "labels" in m:
        lm = r.mapping(m["labels"][1], f"{where}: labels", _AnyKeys())
        for k, (_, v) in (lm or {}).items():
            val = r.scalar(v)
            if isinstance(val, (str, int, float)) and not isinstance(val, bool):
                labels[k] = str(val)
            else:
                r.error(v, f"{where}: label {k!r} must be a string, got {_show(val)}")
                ok = False
    if bools["repeat"] and ints["cooldown"] == 0:
        r.error(m["repeat"][1], f"{where}: repeat needs a cooldown >= 1 (else the rule fires every step)")
        ok = False
    if (
        not ok or desc is None or expr is None or actions is None or ("clear" in m and clear is None)
        or ("budget" in m and budget is None) or ("summary" in m and summary is None)
        or any(v is None for v in ints.values()) or any(v is None for v in bools.values())
    ):
        return None
    return Rule(
        name=name,  # type: ignore[arg-type]
        description=" ".join(desc.split()),
        expr=expr,
        actions=actions,
        for_=ints["for"],  # type: ignore[arg-type]
        clear=clear,
        keep_firing_for=ints["keep_firing_for"],  # type: ignore[arg-type]
        cooldown=ints["cooldown"],  # type: ignore[arg-type]
        repeat=bool(bools["repeat"]),
        budget=budget,
        severity=severity,
        labels=labels,
        enabled=bool(bools["enabled"]),
        divergence=bool(bools["divergence"]),
        urgent=bool(bools["urgent"]),
        source=f"{r.file}:{node.start_mark.line + 1}",
        summary=summary,
    )


def _summary(r: YamlReader, node: yaml.Node, where: str, expr: Compiled) -> Summary | None:
    """A rule's ``summary:`` template, its holes reading only what ``expr`` computes."""
    text = r.string(node, where)
    if text is None:
        return None
    try:
        summary = parse_summary(text)
    except TemplateError as exc:
        one_line = node.start_mark.line == node.end_mark.line
        style = getattr(node, "style", None)
        if one_line and style in (None, "'", '"'):
            r.error(node, f"{where}: {exc.message}", col_offset=exc.col - 1 + (1 if style else 0))
        else:
            r.error(node, f"{where}: column {exc.col} of the summary: {exc.message}")
        return None
    problems = unknown_reads(summary, (label for label, _ in expr.inputs))
    for problem in problems:
        r.error(node, f"{where}: {problem}")
    return None if problems else summary


class _AnyKeys(tuple):  # type: ignore[type-arg]
    """An ``allowed`` that admits every key (labels are free-form)."""

    def __contains__(self, item: object) -> bool:
        return True


def _compose_pack(r: YamlReader, text: str) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
    """The top-level entries of one rule file (version checked); None when nothing is usable."""
    root = r.compose(text)
    if root is None:
        if not r.errors:
            r.error(None, "empty rule file: expected 'version: 1' and 'rules:'")
        return None
    m = r.mapping(root, "rule file", ("version", "params", "rules"), required=("version",))
    if m is None:
        return None
    if "version" in m:
        v = r.scalar(m["version"][1])
        if type(v) is not int or v != RULES_VERSION:  # (not true, nor 1.0: both equal 1 in Python)
            r.error(m["version"][1], f"unsupported version {_show(v)} (this watchdog reads version {RULES_VERSION})")
    if "rules" not in m and "params" not in m:
        r.error(root, "rule file: missing required key 'rules' (an overlay pack has 'params' instead)")
        return None
    return m


def _pack_rules(r: YamlReader, m: dict[str, tuple[yaml.Node, yaml.Node]], params: dict[str, float]) -> list[Rule]:
    rules: list[Rule] = []
    items = r.sequence(m["rules"][1], "rules") if "rules" in m else None
    seen: dict[str, int] = {}
    for i, item in enumerate(items or []):
        rule = _rule(r, item, i, params)
        if rule is None:
            continue
        if rule.name in seen:
            r.error(item, f"rule {rule.name!r} is defined twice (first at line {seen[rule.name]})")
            continue
        seen[rule.name] = item.start_mark.line + 1
        rules.append(rule)
    return rules


class _ParamTable:
    """Parameters over the files of one load: declarations, then overlays' values, in file order."""

    def __init__(self) -> None:
        self.decl: dict[str, tuple[YamlReader, yaml.Node, dict[str, Any], str]] = {}
        self.values: dict[str, float] = {}
        self.overlays: dict[str, tuple[YamlReader, yaml.Node]] = {}
        """Per parameter an overlay set: the overlay's reader and key node (the last overlay's)."""

    def add(self, r: YamlReader, m: dict[str, tuple[yaml.Node, yaml.Node]]) -> None:
        if "params" not in m:
            return
        for name, knode, value, decl in _params(r, m["params"][1]):
            at = f"{r.file}:{knode.start_mark.line + 1}"
            if decl is not None:
                if name in self.decl:
                    r.error(knode, f"params.{name} is already declared at {self.decl[name][3]}")
                    continue
                self.decl[name] = (r, knode, decl, at)
                self.values.setdefault(name, value)
            elif name not in self.decl:
                close = difflib.get_close_matches(name, list(self.decl), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                r.error(knode, f"params.{name}: no pack loaded before this overlay declares it{hint}")
            else:
                self.values[name] = value
                self.overlays[name] = (r, knode)

    def build(self) -> tuple[Param, ...]:
        out = []
        for name, (r, _knode, decl, at) in self.decl.items():
            cal = decl.get("calibrate")
            calibration = _calibration(r, cal, f"params.{name}.calibrate", self.values) if cal is not None else None
            overlay = self.overlays.get(name)
            if calibration is not None and overlay is not None:
                # The pack's floor and ceiling are principles (KL at least doubles): an overlay moves a value
                # within them, as a calibration does, and never past them (kl_jump 0 rolls back every step).
                v, lo, hi = self.values[name], calibration.min, calibration.max
                if (lo is not None and v < lo) or (hi is not None and v > hi):
                    overlay[0].error(overlay[1], f"params.{name}: {v:g} is outside what its pack allows "
                                       f"({'-inf' if lo is None else f'{lo:g}'} to {'inf' if hi is None else f'{hi:g}'}, "
                                       f"params.{name}.calibrate at {at})")
            out.append(Param(name, self.values[name], decl["description"], calibration, at,
                             f"{overlay[0].file}:{overlay[1].start_mark.line + 1}" if overlay is not None else ""))
        return tuple(out)


def parse_rules(text: str, file: str = "<string>") -> tuple[list[Rule], list[RuleError]]:
    """Parse one rule file's text (its own ``params`` bound); returns the valid rules and every error found."""
    r = YamlReader(file)
    m = _compose_pack(r, text)
    if m is None:
        return [], r.errors
    table = _ParamTable()
    table.add(r, m)
    table.build()
    return _pack_rules(r, m, table.values), r.errors


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out += sorted(x for x in p.iterdir() if x.suffix in (".yaml", ".yml") and x.is_file())
        else:
            out.append(p)
    return out


def load_rules(paths: Sequence[str | Path]) -> RuleSet:
    """Load and validate rule files (directories: their *.yaml); RuleFileError lists every error."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = _expand(paths)
    errors: list[RuleError] = []
    rules: list[Rule] = []
    where: dict[str, str] = {}
    packs: list[tuple[YamlReader, dict[str, tuple[yaml.Node, yaml.Node]]]] = []
    table = _ParamTable()
    for f in files:
        try:
            text = inputs.read_text(f, MAX_FILE_BYTES, stream_ok=True)
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(RuleError(str(f), 1, 1, f"cannot read rule file: {inputs.reason(exc)}"))
            continue
        r = YamlReader(str(f))
        m = _compose_pack(r, text)
        if m is not None:
            table.add(r, m)
            packs.append((r, m))
        else:
            errors += r.errors
    params = table.build()  # every overlay's values are in before any expression is compiled
    for r, m in packs:
        got = _pack_rules(r, m, table.values)
        errors += r.errors
        for rule in got:
            if rule.name in where:
                line = int(rule.source.rsplit(":", 1)[1])
                errors.append(RuleError(r.file, line, 1, f"rule {rule.name!r} is already defined at {where[rule.name]}"))
                continue
            where[rule.name] = rule.source
            rules.append(rule)
    if not files:
        errors.append(RuleError("<none>", 1, 1, "no rule files given"))
    if errors:
        raise RuleFileError(errors)
    return RuleSet(tuple(rules), tuple(str(f) for f in files), params)
