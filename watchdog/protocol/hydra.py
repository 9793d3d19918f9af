"""``key=value`` overrides, read and written with Hydra's own override grammar.

verl's command line (``python -m verl.trainer.main_ppo algorithm.kl_ctrl.kl_coef=0.001 ...``),
the embedded trainer's, and every relaunch the watchdog writes speak Hydra's override
language. Hydra (hydra-core, which verl installs too) has the parser; this module is the
only place the product reads or writes an override, so a value the watchdog writes is one
Hydra reads back as that value.

- :func:`parse` one argument into an :class:`Override` (key, kind, typed value);
- :func:`overrides` of a whole command line (the program and its flags skipped, the last
  override of a key winning, as Hydra composes them);
- :func:`format_value` / :func:`format_override` write a value back, verified to round-trip;
- :func:`with_overrides` a command with some keys replaced and others appended.

Sweeps (``a=1,2``, ``range(...)``) are for ``--multirun``; an override the watchdog reads or
writes is a single value, so a sweep is an :class:`OverrideError`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppo_watchdog.protocol.catalog import FORCE_ADD_KEYS


class OverrideError(ValueError):
    """An argument that is not a single-valued Hydra override; the message names it."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"override {text!r}: {reason}")
        self.text = text
        self.reason = reason


@dataclass(frozen=True)
class Override:
    """One parsed ``key=value`` (``+key=`` adds, ``++key=`` adds or changes, ``~key`` deletes)."""

    key: str
    value: Any
    """The value as Hydra reads it: int, float, bool, None, str, list or dict."""
    kind: str
    """``change``, ``add``, ``force_add`` or ``delete`` (Hydra's OverrideType, lower case)."""
    text: str
    """The argument as given."""


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse(text: str) -> Override:
    """One override argument; :class:`OverrideError` when Hydra would not take it as one value."""
    from hydra.errors import HydraException

    try:
        ov = _parser().parse_override(text)
    except HydraException as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OverrideError(text, f"not a Hydra override ({reason})") from None
    if ov.is_sweep_override():
        raise OverrideError(text, "a sweep (several values) where one value belongs; "
                                  "quote a value with commas: key='a,b'")
    return Override(ov.key_or_group, _plain(ov.value()), ov.type.name.lower(), text)


def _plain(value: Any) -> Any:
    """Hydra's parsed value as plain data (its lists and dicts are already plain; strings may be QuotedString)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, str):
        return str(value)
    return value


_KEY = r"[A-Za-z_][\w@/-]*(?:\.[\w@/-]+)*"
_OVERRIDE = re.compile(rf"(?:\+{{1,2}}{_KEY}=|{_KEY}=|~{_KEY}(?:=|$))")


def is_override(arg: str) -> bool:
    """Whether a command-line argument is a Hydra override: a dotted key then ``=`` (``+``, ``++`` or
    ``~`` before it). Not the program, a module, a ``-flag``, or ``python -c`` code that holds an ``=``."""
    return _OVERRIDE.match(arg) is not None


def overrides(command: Iterable[str]) -> dict[str, Override]:
    """The overrides of a command line by key, the last one of a key winning (as Hydra applies them)."""
    out: dict[str, Override] = {}
    for arg in command:
        if is_override(arg):
            ov = parse(arg)
            out.pop(ov.key, None)
            out[ov.key] = ov
    return out


def values(command: Iterable[str]) -> dict[str, Any]:
    """``{key: value}`` of a command line's overrides (deletions left out)."""
    return {k: ov.value for k, ov in overrides(command).items() if ov.kind != "delete"}


def format_value(value: Any) -> str:
    """A value as Hydra's grammar writes it, checked to parse back to the same value.

    Numbers as Python writes them (``1e-06``, ``2.0``), ``true``/``false``/``null``, strings bare
    when Hydra reads them back unchanged and single-quoted otherwise, lists as ``[a,b]``.
    """
    text = _format(value)
    back = parse(f"k={text}").value
    if not _same(back, value):
        raise OverrideError(f"k={text}", f"does not read back as {value!r} (got {back!r})")
    return text


def _format(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_format(v)}" for k, v in value.items()) + "}"
    text = str(value)
    try:
        if _same(parse(f"k={text}").value, text):
            return text
    except OverrideError:
        pass
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(b, tuple):
        b = list(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, Mapping):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    return type(a) is type(b) and a == b


def format_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's grammar (``++key=value`` for a key verl's config does not declare,
    :data:`ppo_watchdog.protocol.catalog.FORCE_ADD_KEYS`)."""
    return f"{'++' if key in FORCE_ADD_KEYS else ''}{key}={format_value(value)}"


def with_overrides(command: Sequence[str], replace: Mapping[str, Any], append: Sequence[str] = ()) -> list[str]:
    """``command`` without its overrides of the keys in ``replace`` (and ``append``), then ``replace``
    written in key order, then the ``append`` arguments as given."""
    keys = set(replace) | {parse(a).key for a in append}
    kept = [a for a in command if not (is_override(a) and parse(a).key in keys)]
    return kept + [format_override(k, v) for k, v in sorted(replace.items())] + list(append)
