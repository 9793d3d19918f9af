"""Replay equals live, across engine rewrites: a digest of everything the engine and its windows say.

The rules engine's hot path (``ppo_watchdog.core.engine``, ``expr``, ``series``) is tuned for speed;
its results must not move by one bit. This replays, and digests step by step:

- every log of bench/corpus*/ and ../shared/testdata/verl-logs/ through
  :func:`ppo_watchdog.core.engine.run_series` with the default pack (decisions with all fields, the
  EngineState's to_json and the sources after every step);
- every case of rules/tests/*.yaml the way ``watchdog rules test`` steps it (unfiltered window);
- a few hundred random expressions of the whole language (every function, lags, ``holds``,
  ``count_over``, ``default``, chains, NaN/inf constants, parameters) evaluated at every step of
  windows with NaN and inf values, gaps, a rewind, events, trimming (a small window) and a metric
  filter, each value or error message and each expression's audit inputs;
- random rule packs (``for``, ``clear``, ``keep_firing_for``, cooldown, repeat, budgets with and
  without progress, disabled rules, rules that error) replayed through ``run_series``;
- each window's observable state after every append (rows, values, best, lowest, since_best,
  events, non-finite steps, sources).

The digests of main are stored in tests/golden/engine_equivalence.json (``--write``);
tests/test_engine_equivalence.py recomputes them on the checkout and names any part that differs.

    python bench/engine_equivalence.py            # compare with the golden file; exit 1 on a difference
    python bench/engine_equivalence.py --write    # regenerate it (only from a commit whose results are right)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "engine_equivalence.json"
TESTDATA = (Path(os.environ["WATCHDOG_TESTDATA"]) if os.environ.get("WATCHDOG_TESTDATA")
            else ROOT.parent / "shared" / "testdata")

sys.path.insert(0, str(ROOT))

from ppo_watchdog.core import actions as act  # noqa: E402
from ppo_watchdog.core import engine  # noqa: E402
from ppo_watchdog.core.expr import ExprError, compile_expr  # noqa: E402
from ppo_watchdog.core.rulefile import Budget, Rule, RuleSet, load_rules  # noqa: E402
from ppo_watchdog.core.ruletest import _read_test_file  # noqa: E402
from ppo_watchdog.core.series import Window  # noqa: E402
from ppo_watchdog.sources import ingest  # noqa: E402


class Digest:
    """A running sha256 over canonical JSON lines, with a count."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, obj: Any) -> None:
        self.h.update(json.dumps(obj, sort_keys=True, default=repr).encode())
        self.h.update(b"\n")
        self.n += 1

    def out(self) -> dict[str, Any]:
        return {"items": self.n, "sha256": self.h.hexdigest()}


def _event_step(e: Mapping[str, Any]) -> int:
    return e["step"] if isinstance(e.get("step"), int) else -1


def log_files() -> list[Path]:
    """Run directories of bench/corpus*/ and the verl logs of the testdata, sorted."""
    out = sorted(p.parent for p in ROOT.glob("bench/corpus*/*/metrics.jsonl"))
    vl = TESTDATA / "verl-logs"
    if vl.is_dir():
        out += sorted(p for p in vl.iterdir() if p.suffix in (".txt", ".jsonl", ".log"))
    return out


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records and events (sorted by step, as ``watchdog eval`` does) of one log or run directory."""
    res = ingest.read_run(path)
    events = [dict(e) for e in res.events]
    if path.is_dir() and (path / "events.jsonl").exists():
        events += [dict(e) for e in ingest.read_events(path)]
    return res.records, sorted(events, key=_event_step)


def digest_series(rules: RuleSet | tuple[Rule, ...], records: list[dict[str, Any]],
                  events: list[dict[str, Any]], d: Digest, size: int | None = None) -> int:
    """Digest a run_series replay; returns the number of decisions."""
    n = 0
    for sr in engine.run_series(rules, records, events, size=size):
        # Key order too (to_json sorts): a decision's inputs are shown in order, firing() lists in order.
        d.add([sr.step, [[x.to_json(), list(x.inputs)] for x in sr.decisions], sr.state.to_json(),
               list(sr.state.rules), dict(sr.sources)])
        n += len(sr.decisions)
    return n


def part_logs(rules: RuleSet) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in log_files():
        records, events = read_log(path)
        d = Digest()
        n = digest_series(rules, records, events, d)
        name = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path("testdata") / path.relative_to(TESTDATA))
        out[name] = {**d.out(), "decisions": n}
    return out


def part_rule_tests() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted((ROOT / "rules" / "tests").glob("*.yaml")):
        rules, tests, errors = _read_test_file(path)
        if errors or rules is None:
            out[path.name] = {"errors": [str(e) for e in errors]}
            continue
        d = Digest()
        for test in tests:
            # ppo_watchdog.core.ruletest.run_test's loop, with every state digested.
            rs = rules.only(test["only"]) if test["only"] else rules
            length = max((len(v) for v in test["series"].values()), default=0)
            last_event = max((int(e["step"]) for e in test["events"]), default=test["start"] - 1)
            last = max(test["start"] + length - 1, last_event)
            w = Window(rs.max_window + 1)
            st = engine.EngineState()
            for i, step in enumerate(range(test["start"], last + 1)):
                row = {k: v[i] for k, v in test["series"].items() if i < len(v) and v[i] is not None}
                w.append(step, row)
                w.add_events(e for e in test["events"] if int(e["step"]) == step)
                got, st = engine.evaluate(rs, w, st, step)
                d.add([test["name"], step, [[x.to_json(), list(x.inputs)] for x in got], st.to_json(), list(st.rules)])
        out[path.name] = d.out()
    return out


# -- random expressions -------------------------------------------------------------------

METRICS = ["kl", "reward", "entropy", "vf_loss", "response_length", "grad_norm", "reward_max", "reward_min",
           "aborted_ratio", "kl_coef", "pg_loss"]  # pg_loss: logged by no window below
LAGGED = ["avg", "min", "max", "std", "median", "count"]
CMP = ["<", "<=", ">", ">=", "==", "!="]
PARAMS = {"a": 0.05, "b": 2.0, "z": 0.0}


class ExprGen:
    """Random, mostly well-typed expressions of the rule language."""

    def __init__(self, rnd: random.Random) -> None:
        self.r = rnd

    def metric(self) -> str:
        return self.r.choice(METRICS)

    def const(self) -> str:
        return self.r.choice(["0", "1", "2", "0.05", "0.5", "10", "1e-9", "inf", "nan", "3", "1.25", "0.001"])

    def win(self) -> int:
        return self.r.choice([1, 2, 3, 5, 10, 20])

    def num(self, depth: int, in_co: bool = False) -> str:
        r = self.r
        if depth <= 0:
            return r.choice([self.const(), self.metric(), self.metric(), "step", f"${r.choice(list(PARAMS))}",
                             f"{r.choice(LAGGED)}({self.metric()}, {self.win()})"])
        k = r.randrange(17)
        if k == 0:
            return self.const()
        if k == 1:
            return self.metric()
        if k in (2, 3, 4):
            lag = f", {r.choice([0, 1, 2, 3, 5, 10])}" if r.random() < 0.6 else ""
            return f"{r.choice(LAGGED)}({self.metric()}, {self.win()}{lag})"
        if k == 5:
            return f"{r.choice(['slope', 'delta', 'zscore'])}({self.metric()}, {self.win()})"
        if k == 6:
            return r.choice([f"best({self.metric()})", f"best({self.metric()}, {self.win()})",
                             f"since_best({self.metric()})", f"lowest({self.metric()})"])
        if k == 7 and not in_co:
            return f"count_over({self.cond(depth - 1, True)}, {self.win()})"
        if k == 8:
            return (f'event("{r.choice(["oom", "nan", "rollback"])}")' if not in_co else
                    f'event_count("{r.choice(["oom", "rollback"])}", {self.win()})')
        if k == 9:
            return f'event_count("{r.choice(["oom", "nan", "rollback"])}", {self.win()})'
        if k == 10:
            return f"abs({self.num(depth - 1, in_co)})"
        if k == 11:
            return f"{r.choice(['clamp_min', 'clamp_max'])}({self.num(depth - 1, in_co)}, {self.num(depth - 1, in_co)})"
        if k == 12:
            return f"default({self.num(depth - 1, in_co)}, {r.choice(['0', '-1', '1.5', '-0.5'])})"
        if k == 13:
            return f"-{self.num(depth - 1, in_co)}"
        if k == 14:
            return "step"
        return f"({self.num(depth - 1, in_co)} {r.choice('+-*/')} {self.num(depth - 1, in_co)})"

    def cond(self, depth: int, in_co: bool = False) -> str:
        r = self.r
        k = r.randrange(10) if depth > 0 else 0
        if k in (0, 1, 2, 3):
            n = r.choice([1, 1, 1, 2]) + 1
            parts = [self.num(depth - 1, in_co)]
            for _ in range(n - 1):
                parts += [r.choice(CMP), self.num(depth - 1, in_co)]
            return " ".join(parts)
        if k == 4:
            return f"({self.cond(depth - 1, in_co)} {r.choice(['and', 'or'])} {self.cond(depth - 1, in_co)})"
        if k == 5:
            return f"not {self.cond(depth - 1, in_co)}"
        if k == 6:
            return f"holds({self.cond(depth - 1, in_co)})"
        if k == 7:
            return f"{r.choice(['isnan', 'isfinite'])}({self.num(depth - 1, in_co)})"
        if k == 8:
            ms = ", ".join(self.metric() for _ in range(r.randrange(3)))
            return f"nonfinite({ms})"
        return f"({self.cond(depth - 1, in_co)} and {self.cond(depth - 1, in_co)})"


def base_records() -> list[dict[str, float]]:
    """Short-name rows of a real verl run (or a random walk without the testdata)."""
    from ppo_watchdog.protocol import catalog

    p = TESTDATA / "verl-logs" / "verl_ppo_gemma2b_gsm8k_healthy.txt"
    rows: list[dict[str, float]] = []
    if p.exists():
        rows = [catalog.to_short(r["data"]) for r in ingest.read_records(p)][:70]
    if not rows:
        rnd = random.Random(1)
        rows = [{m: rnd.random() for m in METRICS[:-1]} for _ in range(70)]
    return rows


def scenario(rows: list[dict[str, float]], seed: int) -> Iterator[tuple[int, dict[str, float], list[dict[str, Any]]]]:
    """(step, row, events) with NaN, inf, gaps, repeated values, a rewind and events mixed in."""
    rnd = random.Random(seed)
    step = 0
    for i, base in enumerate(rows):
        step += 1 if rnd.random() < 0.9 else 2  # a skipped step now and then
        if i == 45:
            step -= 12  # a rewind (a rollback re-trains earlier steps)
        row = dict(base)
        for m in list(row):
            x = rnd.random()
            if x < 0.04:
                row[m] = math.nan
            elif x < 0.06:
                row[m] = rnd.choice([math.inf, -math.inf])
            elif x < 0.12:
                del row[m]  # a gap
            elif x < 0.16:
                row[m] = 0.0
        if rnd.random() < 0.15:
            row["reward_max"] = row["reward_min"] = 0.5  # equal: ``==`` comparisons hold sometimes
        if 30 <= i < 36:
            row.pop("entropy", None)  # a longer gap: the series goes its own way, then realigns
        row["aborted_ratio"] = rnd.choice([0.0, 0.0, 0.0, 0.2, 0.6])
        evs = []
        if rnd.random() < 0.2:
            evs.append({"kind": rnd.choice(["oom", "nan", "rollback"]), "step": step})
        if rnd.random() < 0.03:
            evs.append({"kind": "rollback"})  # no step
        if rnd.random() < 0.02:
            evs.append({"kind": "oom", "step": step - 0.5})  # a step that is not an int
        yield step, row, evs


WINDOWS: list[tuple[int | None, frozenset[str] | None]] = [
    (None, None), (8, None), (25, frozenset(["kl", "reward", "entropy", "vf_loss", "reward_max"])),
]


def window_view(w: Window) -> list[Any]:
    """What readers can observe of a window."""
    view: list[Any] = [w.step, w.names(), w.steps(), w.steps(5), w.row(), w.event_seq, w.events_since(0),
                       sorted(w.nonfinite_steps), dict(w.sources)]
    for m in w.names():
        view.append([m, list(w.values(m, 7)), [list(x) for x in w.points(m, 4)], list(w.values(m, 3, (w.step or 0) - 2))])
        for fn in (w.best, w.since_best):
            try:
                view.append(fn(m))
            except Exception as exc:  # noqa: BLE001 - the error is part of the observable behaviour
                view.append(f"{type(exc).__name__}: {exc}")
        try:
            view.append(w.lowest(m))
        except Exception as exc:  # noqa: BLE001
            view.append(f"{type(exc).__name__}: {exc}")
    for kind in ("oom", "nan", "rollback"):
        view.append([w.count_events(kind, 0), w.count_events(kind, w.event_seq - 2), w.count_events_in(kind, 5)])
    return view


def part_exprs(n_exprs: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    gen = ExprGen(rnd)
    compiled = []
    d_compile = Digest()
    for i in range(n_exprs):
        text = gen.cond(rnd.choice([1, 2, 3, 3, 4])) if i % 3 else gen.num(rnd.choice([1, 2, 3]))
        want = "condition" if i % 3 else "number"
        try:
            c = compile_expr(text, want, PARAMS)
        except ExprError as exc:
            d_compile.add([text, str(exc)])
            continue
        d_compile.add([text, sorted(c.metrics), sorted(c.required), c.max_window, [k for k, _ in c.inputs]])
        compiled.append(c)
    out: dict[str, Any] = {"compile": {**d_compile.out(), "compiled": len(compiled)}}
    rows = base_records()
    for wi, (size, keep) in enumerate(WINDOWS):
        d_eval, d_win = Digest(), Digest()
        w = Window(size, keep)
        seq = 0
        for step, row, evs in scenario(rows, seed + wi):
            w.append(step, row)
            for e in evs:
                w.add_event(e)
            d_win.add(window_view(w))
            for at in (step, step - 3):
                for c in compiled:
                    try:
                        v: Any = c.fn(w, at, seq)
                        v = repr(v) if isinstance(v, float) else v
                    except Exception as exc:  # noqa: BLE001 - the error is part of the observable behaviour
                        v = f"{type(exc).__name__}: {exc}"
                    d_eval.add(v)
            for c in compiled[::5]:
                d_eval.add({k: repr(x) for k, x in c.input_values(w, step, seq).items()})
            seq = w.event_seq
        out[f"window {wi} eval"] = d_eval.out()
        out[f"window {wi} view"] = d_win.out()
    return out


def random_rules(rnd: random.Random, n: int) -> tuple[Rule, ...]:
    gen = ExprGen(rnd)
    rules = []
    while len(rules) < n:
        try:
            expr = compile_expr(gen.cond(rnd.choice([1, 2, 2, 3])), "condition", PARAMS)
            clear = compile_expr(gen.cond(rnd.choice([1, 2])), "condition", PARAMS) if rnd.random() < 0.3 else None
        except ExprError:
            continue
        budget = None
        if rnd.random() < 0.5:
            budget = Budget(rnd.choice([1, 2, 3]), rnd.choice([10, 30, 200]),
                            progress=rnd.choice([None, 5, 15]),
                            **({"escalate": (act.NotifyAction(""), act.PauseAction("x"))} if rnd.random() < 0.5 else {}))
        rules.append(Rule(
            name=f"r{len(rules)}", description="", expr=expr,
            actions=(act.NotifyAction(""),) if rnd.random() < 0.5 else (act.RollbackAction(), act.NotifyAction("n")),
            for_=rnd.choice([0, 0, 1, 2, 5]), clear=clear, keep_firing_for=rnd.choice([0, 0, 2, 4]),
            cooldown=rnd.choice([0, 1, 3, 10]), repeat=rnd.random() < 0.6, budget=budget,
            severity=rnd.choice(["info", "warning", "critical"]), enabled=rnd.random() < 0.9,
            divergence=rnd.random() < 0.3, urgent=rnd.random() < 0.2,
        ))
    return tuple(rules)


def part_random_packs(n_packs: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    rows = base_records()
    d = Digest()
    n_dec = 0
    for k in range(n_packs):
        rules = random_rules(rnd, rnd.choice([3, 8, 15]))
        records, events = [], []
        for step, row, evs in scenario(rows, seed * 100 + k):
            records.append({"step": step, "data": {_verl_key(m): v for m, v in row.items()}})
            events += evs
        n_dec += digest_series(rules, records, events, d, size=rnd.choice([None, 12]))
    return {**d.out(), "decisions": n_dec}


def _verl_key(short: str) -> str:
    from ppo_watchdog.protocol import catalog

    return catalog.BY_SHORT[short].key


def compute() -> dict[str, Any]:
    """Every part's digests."""
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    return {
        "logs": part_logs(rules),
        "rule_tests": part_rule_tests(),
        "exprs": part_exprs(600, 7),
        "random_packs": part_random_packs(30, 11),
    }


def diff(want: Mapping[str, Any], got: Mapping[str, Any], path: str = "") -> list[str]:
    """The parts whose digests differ (by path)."""
    out: list[str] = []
    for k in sorted(set(want) | set(got)):
        a, b = want.get(k), got.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping) and "sha256" not in a:
            out += diff(a, b, f"{path}{k} / ")
        elif a != b:
            out.append(f"{path}{k}: golden {a}, now {b}")
    return out


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write the golden file instead of comparing")
    ap.add_argument("--golden", type=Path, default=GOLDEN)
    args = ap.parse_args(list(argv) if argv is not None else None)
    t0 = time.perf_counter()
    got = compute()
    if args.write:
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.golden} in {time.perf_counter() - t0:.1f} s")
        return 0
    want = json.loads(args.golden.read_text())
    bad = diff(want, got)
    for line in bad:
        print("DIFFERS:", line)
    n = sum(1 for _ in _leaves(got))
    print(f"{n - len(bad)}/{n} parts identical to {args.golden.name} ({time.perf_counter() - t0:.1f} s)")
    return 1 if bad else 0


def _leaves(doc: Mapping[str, Any]) -> Iterator[Any]:
    for v in doc.values():
        if isinstance(v, Mapping) and "sha256" not in v:
            yield from _leaves(v)
        else:
            yield v


if __name__ == "__main__":
    raise SystemExit(main())
