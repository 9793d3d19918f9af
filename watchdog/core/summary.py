"""Decisions in words: one renderer for every surface a person reads.

A rule's ``summary:`` (Prometheus' annotation convention) is a sentence with ``{{ ... }}`` holes, each an
arithmetic expression over what the rule's condition computed at the step it fired: a metric (``{{ kl }}``),
a function call by its text (``{{ median(kl, 5, 2) }}``), a parameter (``{{ $kl_jump }}``), ``step``, numbers
and ``+ - * /`` (``{{ kl / median(kl, 5, 2) }}``). A hole is parsed by the expression language's own parser
(:func:`ppo_watchdog.core.expr.parse`) and computed by walking its syntax tree over the decision's recorded
inputs, never evaluated as code; a hole reading something the condition does not compute is an error of the
rule file (file:line), so a summary never says "n/a" for a name it misspelled. Numbers are shown to 3
significant digits.

The evidence (the rendered summary) is what the rule saw; the rest of the sentence is what was done about
it, from the journal entries the planner and the actuator wrote: "rolled back to step 55, skipping 2 batches;
lr 1.6e-4 -> 8e-5", "would roll back ..." (advised), "waits for approval: ..." (held for a person). Console,
history, status, report, webhook, Grafana annotations and ``replay`` all say a decision through
:func:`sentence`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppo_watchdog.core.expr import (
    Binary,
    Call,
    ExprError,
    Metric,
    Node,
    Num,
    Param,
    Step,
    Unary,
    parse,
    unparse,
)
from ppo_watchdog.core.vocabulary import ActionStatus, DecisionKind, JournalKind

_HOLE = re.compile(r"\{\{(.*?)\}\}", re.S)
_ARITH = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
MAX_SUMMARY_CHARS = 600
"""A summary is one sentence (its holes spelled out as expressions); a longer template is a paragraph: the
description is for that."""


class TemplateError(ValueError):
    """A summary template does not parse, or reads what its rule does not compute; ``col`` is 1-based."""

    def __init__(self, col: int, message: str) -> None:
        super().__init__(f"column {col}: {message}")
        self.col = col
        self.message = message


@dataclass(frozen=True)
class Summary:
    """A parsed ``summary:`` template."""

    text: str
    """The template as written (whitespace folded)."""
    parts: tuple[str | Node, ...]
    """Literal text and the holes' syntax trees, in order."""

    @property
    def reads(self) -> frozenset[str]:
        """The input labels its holes read (``kl``, ``median(kl, 5, 2)``, ``$kl_jump``)."""
        return frozenset(label for p in self.parts if not isinstance(p, str) for label in _labels(p))


def parse_summary(text: str) -> Summary:
    """Parse a template; TemplateError with the column of what is wrong."""
    text = " ".join(text.split())
    if len(text) > MAX_SUMMARY_CHARS:
        raise TemplateError(1, f"{len(text)} characters: a summary is one sentence of at most {MAX_SUMMARY_CHARS} "
                               "(the description holds the rationale)")
    parts: list[str | Node] = []
    at = 0
    for m in _HOLE.finditer(text):
        parts.append(text[at:m.start()])
        src = m.group(1)
        if not src.strip():
            raise TemplateError(m.start() + 1, "an empty {{ }}")
        try:
            node = parse(src)
        except ExprError as exc:
            raise TemplateError(m.start(1) + exc.col, exc.message) from None
        bad = _first_unsupported(node)
        if bad is not None:
            raise TemplateError(m.start() + 1, f"{{{{{src}}}}}: {bad}: a summary shows numbers (a metric, a "
                                               "function call of the rule's condition, a $param, step, + - * /)")
        parts.append(node)
        at = m.end()
    tail = text[at:]
    for token in ("{{", "}}"):
        if token in tail:
            raise TemplateError(at + tail.index(token) + 1, f"a {token} without its pair")
    parts.append(tail)
    return Summary(text, tuple(p for p in parts if p != ""))


def unknown_reads(summary: Summary, computed: Iterable[str]) -> list[str]:
    """One message per label the template reads that the rule's condition does not compute."""
    have = sorted(set(computed))
    out = []
    for label in sorted(summary.reads - set(have)):
        near = difflib.get_close_matches(label, have, n=1)
        hint = f" (did you mean {near[0]}?)" if near else f" (it computes: {', '.join(have[:8])}{' ...' if len(have) > 8 else ''})"
        out.append(f"{{{{ {label} }}}} is not computed by the rule's expr{hint}")
    return out


def render(summary: Summary, inputs: Mapping[str, Any], step: int) -> str:
    """The template with each hole's value (``n/a`` where a value was missing at that step)."""
    out = []
    for p in summary.parts:
        if isinstance(p, str):
            out.append(p)
            continue
        try:
            out.append(number(_value(p, inputs, step)))
        except (KeyError, ZeroDivisionError, OverflowError, TypeError, ValueError):
            out.append("n/a")
    return "".join(out)


def number(v: Any) -> str:
    """A number to 3 significant digits as a person writes it: 5.87, 0.074, 1.6e-4, 62."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "n/a"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    text = f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}"  # 1.6e-4, not 0.00016
    if "e" in text:
        mant, exp = text.split("e")
        mant = mant.rstrip("0").rstrip(".") if "." in mant else mant
        text = f"{mant}e{int(exp)}"
    return text


def _labels(node: Node) -> list[str]:
    if isinstance(node, (Param, Metric, Call)):
        return [unparse(node)]
    if isinstance(node, Unary):
        return _labels(node.operand)
    if isinstance(node, Binary):
        return _labels(node.left) + _labels(node.right)
    return []


def _first_unsupported(node: Node) -> str | None:
    if isinstance(node, (Num, Step, Param, Metric, Call)):
        return None
    if isinstance(node, Unary):
        return _first_unsupported(node.operand)
    if isinstance(node, Binary):
        return _first_unsupported(node.left) or _first_unsupported(node.right)
    return f"{unparse(node)} is a condition"


def _value(node: Node, inputs: Mapping[str, Any], step: int) -> float:
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Step):
        return float(step)
    if isinstance(node, (Param, Metric, Call)):
        return float(inputs[unparse(node)])
    if isinstance(node, Unary):
        return -_value(node.operand, inputs, step)
    if isinstance(node, Binary):
        return _ARITH[node.op](_value(node.left, inputs, step), _value(node.right, inputs, step))
    raise TypeError(f"not a number: {unparse(node)}")


# -- a decision's evidence -------------------------------------------------------------


def evidence(rule: Any, kind: str, step: int, inputs: Mapping[str, Any], fallback: str) -> str:
    """What ``rule`` saw at ``step``, in words: its rendered summary for a fire or an escalation (with the budget
    that was spent); "no longer holds" for a resolve; ``fallback`` (the engine's message) for a rule without one."""
    if kind == DecisionKind.RESOLVE:
        return f"{getattr(rule, 'name', 'the rule')} no longer holds at step {step}"
    summary = getattr(rule, "summary", None)
    if summary is None:
        return fallback
    text = render(summary, inputs, step)
    budget = getattr(rule, "budget", None)
    if kind == DecisionKind.ESCALATE and budget is not None:
        text += f" ({budget.max} fires within {budget.window} steps: its remedy did not hold)"
    return text


# -- what was done about it --------------------------------------------------------------

_KEY_WORDS = {
    "actor_rollout_ref.actor.optim.lr": "lr",
    "critic.optim.lr": "critic lr",
    "algorithm.kl_ctrl.kl_coef": "kl_coef",
    "actor_rollout_ref.actor.kl_loss_coef": "kl_coef",
}


def key_word(key: str) -> str:
    """A config key as a person names it: ``lr`` for the actor's optimizer lr, ``kl_coef``, else its last part,
    after ``critic`` or ``rollout`` where the key is theirs (the actor's and the critic's micro batch apart)."""
    if key in _KEY_WORDS:
        return _KEY_WORDS[key]
    last = key.rsplit(".", 1)[-1]
    for owner in ("critic", "rollout", "ref"):
        if key.startswith(f"{owner}.") or f".{owner}." in key:
            return f"{owner} {last}"
    return last


def sets_text(sets: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> str:
    """``lr 1.6e-4 -> 8e-5, kl_coef 0.001 -> 0.002``."""
    old = old or {}
    return ", ".join(f"{key_word(k)} {number(old[k])} -> {number(v)}" if old.get(k) is not None
                     else f"{key_word(k)} -> {number(v)}" for k, v in sets.items())


def _skipping(payload: Mapping[str, Any]) -> str:
    n = int(payload.get("skip_batches") or 0)
    return f", skipping {n} batch{'es' if n != 1 else ''}" if n else ""


def _field(entry: Any, name: str) -> Any:
    return entry.get(name) if isinstance(entry, Mapping) else getattr(entry, name, None)


#: Where a rollback goes before its checkpoint is chosen (a replay, an entry not driven yet).
KNOWN_GOOD = "the last known-good checkpoint"


def resume_where(payload: Mapping[str, Any]) -> str:
    """Where a rollback or relaunch resumes, in words: ``step 55``, the start, or the last known-good checkpoint
    while none is chosen yet."""
    if payload.get("resume") == "scratch":
        return "the start (the initial weights)"
    step = payload.get("resume_step", payload.get("chosen_step"))
    if step is not None:
        return f"step {step}"
    if "resume_path" in payload:  # resolved, and there was none
        return "the start (the initial weights)"
    return KNOWN_GOOD if "skip_batches" in payload else "the latest checkpoint"


def action_phrase(kind: str, payload: Mapping[str, Any], done: bool = True) -> str:
    """One journal entry's action in words, done ("rolled back to step 55, skipping 2 batches; lr ...") or to do
    ("roll back to step 55 ...")."""
    sets = payload.get("set") or {}
    changes = sets_text(sets, payload.get("from") or {})
    where = resume_where(payload)
    if kind == JournalKind.ROLLBACK or (kind == JournalKind.RESTART and "skip_batches" in payload):
        return f"{'rolled' if done else 'roll'} back to {where}{_skipping(payload)}" + (f"; {changes}" if changes else "")
    if kind == JournalKind.RESTART:
        why = str(payload.get("reason") or "")
        why = why.split(": ", 1)[1] if ": " in why and why.startswith(str(payload.get("rule", "")) + ":") else why
        text = f"{'relaunched' if done else 'relaunch'} from {where}" + (f" with {changes}" if changes else "")
        return text + (f" ({why})" if why and not changes else "")
    if kind == JournalKind.LIVE_SET:
        return changes or ("set nothing" if done else "set nothing")
    if kind in (JournalKind.COMMAND, JournalKind.RESUME):
        cmd = str((payload.get("command") or {}).get("kind") or kind)
        words = {"pause": ("paused the run for a person", "pause the run for a person"),
                 "resume": ("resumed the run", "resume the run"),
                 "checkpoint": ("asked the trainer for a checkpoint", "ask the trainer for a checkpoint"),
                 "stop": ("asked the trainer to save and stop", "ask the trainer to save and stop")}
        return words.get(cmd, (f"sent {cmd}", f"send {cmd}"))[0 if done else 1]
    if kind == JournalKind.STOP:
        return "stopped the run" if done else "stop the run"
    if kind == JournalKind.NOTIFY:
        # The rule's own words (an alert's advice), not the decision's sentence said again.
        text = str(payload.get("summary") or "").removeprefix(f"{payload.get('rule', '')}: ")
        said = f": {text}" if text and text != payload.get("description") else ""
        return ("told a person" if done else "tell a person") + said
    return f"{'carried out' if done else 'carry out'} a {kind}"


def entry_words(entry: Any) -> str:
    """A journal entry (a store row or an ActionRecord) in words, as far as it has got."""
    kind, status = str(_field(entry, "kind")), str(_field(entry, "status"))
    payload: Mapping[str, Any] = _field(entry, "payload") or {}
    result: Mapping[str, Any] = _field(entry, "result") or {}
    if status == ActionStatus.ADVISED:
        return str(result.get("outcome") or f"would {action_phrase(kind, payload, done=False)}")
    if status == ActionStatus.AWAITING:
        return f"waits for approval: {result.get('would') or action_phrase(kind, payload, done=False)}"
    if status == ActionStatus.DENIED:
        return str(result.get("outcome") or f"denied: {action_phrase(kind, payload, done=False)}")
    if status == ActionStatus.FAILED:
        why = result.get("error") or result.get("outcome") or "no reason recorded"
        return f"could not {action_phrase(kind, payload, done=False)}: {why}"
    if status == ActionStatus.DROPPED:
        return f"did not {action_phrase(kind, payload, done=False)}: {result.get('outcome') or 'dropped'}"
    if status == ActionStatus.WAITING:
        return f"will {action_phrase(kind, payload, done=False)} at the next checkpoint"
    if status in (ActionStatus.INTENT, ActionStatus.SENT):
        return f"about to {action_phrase(kind, payload, done=False)}"
    if kind == JournalKind.ROLLBACK and result.get("handed_to") is None and "resume_step" not in payload:
        return str(result.get("outcome") or "rolled back")
    if kind == JournalKind.NOTIFY and str(result.get("outcome", "")).startswith("webhook failed"):
        return f"told a person on the console only ({result['outcome']})"
    return action_phrase(kind, payload)


def actions_text(journal: Sequence[Any]) -> str:
    """What a decision's journal entries did, in words, joined by "; ": an entry handed on to another (a
    rollback carried out by relaunch) is said by the one it was handed to, and the sets a rollback carried are
    said once (with the rollback, not again with the live set that applied them after the restore)."""
    said: list[str] = []
    carried: set[str] = set()
    for e in journal:
        result = _field(e, "result") or {}
        if result.get("handed_to") is not None and str(_field(e, "status")) == ActionStatus.DONE:
            continue
        payload = _field(e, "payload") or {}
        if str(_field(e, "kind")) == JournalKind.LIVE_SET and payload.get("set") and set(payload["set"]) <= carried:
            continue
        if str(_field(e, "kind")) in (JournalKind.ROLLBACK, JournalKind.RESTART):
            carried |= set(payload.get("set") or {})
        words = entry_words(e)
        if words and words not in said:
            said.append(words)
    return "; ".join(said)


def sentence(decision: Mapping[str, Any]) -> str:
    """A stored decision (``Store.decisions``: with its ``journal``) as one sentence: what the rule saw, then what
    was done, advised or held about it, or why nothing was."""
    seen = str(decision.get("message") or f"{decision.get('rule')} at step {decision.get('step')}")
    done = actions_text(decision.get("journal") or [])
    if not done and decision.get("kind") != DecisionKind.RESOLVE:
        outcome = str(decision.get("outcome") or "")
        done = "" if outcome in ("", "no action", "resolved") or outcome in seen else outcome
    return f"{seen}: {done}" if done else seen


__all__ = [
    "KNOWN_GOOD", "MAX_SUMMARY_CHARS", "Summary", "resume_where", "TemplateError", "action_phrase", "actions_text", "entry_words", "evidence",
    "key_word", "number", "parse_summary", "render", "sentence", "sets_text", "unknown_reads",
]
