"""The expression language: parsing, errors with columns, window-function math, and properties."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_watchdog.core import expr as E
from ppo_watchdog.core.expr import ExprError, compile_expr, parse, unparse
from ppo_watchdog.core.series import MissingDataError, Window, window_steps


def window(**series: list[float | None]) -> Window:
    """Steps 1..N; None leaves a metric out at that step."""
    w = Window(200)
    n = max(len(v) for v in series.values())
    for i in range(n):
        w.append(i + 1, {k: v[i] for k, v in series.items() if i < len(v) and v[i] is not None})
    return w


def val(text: str, w: Window, want: str = E.NUM) -> float:
    return compile_expr(text, want)(w)


def test_precedence_and_chained_comparisons_follow_python() -> None:
    w = window(kl=[0.2])
    assert val("1 + 2 * 3 - 4 / 2", w) == 5.0
    assert val("-2 * -3", w) == 6.0
    assert val("0.1 < kl < 0.3", w, E.BOOL) is True
    assert val("0.1 < kl < 0.15", w, E.BOOL) is False
    assert val("not kl > 1 and kl > 0.1 or kl > 5", w, E.BOOL) is True
    assert unparse(parse("kl > 0.1 or kl_std > 0.02 and step > 3")) == "((kl > 0.1) or ((kl_std > 0.02) and (step > 3)))"


def test_verl_keys_aliases_and_prometheus_names_resolve_to_short_names() -> None:
    for text in ('m("actor/reward_kl_penalty")', 'm("critic/kl")', "ppo_kl_mean", "kl"):
        assert parse(text) == E.Metric("kl")
    assert parse('m("actor/entropy_loss")') == E.Metric("entropy")


@pytest.mark.parametrize(
    "text,col,message",
    [
        ("kl > 0.1 and foo < 2", 14, "unknown metric 'foo'"),
        ("avgg(kl, 3) > 1", 1, "unknown function 'avgg' (did you mean 'avg'?)"),
        ("critic/kl > 1", 1, 'written m("critic/kl")'),
        ('event("boom") > 0', 7, "unknown event kind 'boom'"),
        ("avg(kl, 2.5) > 1", 9, "whole number of steps"),
        ("avg(kl, 1e999) > 1", 9, "whole number of steps"),
        ("avg(kl, nan) > 1", 9, "whole number of steps"),
        ("avg(kl + 1, 3) > 1", 5, "takes a metric name"),
        ("(kl > 1) + 1 > 0", 2, "'+' needs a number, got a condition"),
        ("kl and kl_std", 1, "needs a condition"),
        ("kl >", 5, "found end of expression"),
        ("kl > 0.1)", 9, "unexpected ')'"),
        ("kl > $", 6, "unexpected character '$'"),
        ('event("oom")', 1, "must be a condition, got a number"),
        ("count_over(event(\"oom\") > 0, 5) > 1", 12, "cannot be used in count_over"),
        ("avg(kl) > 1", 1, "avg() takes 2 to 3 argument(s), got 1"),
    ],
)
def test_errors_name_the_problem_and_its_column(text: str, col: int, message: str) -> None:
    with pytest.raises(ExprError) as info:
        compile_expr(text)
    assert info.value.col == col, str(info.value)
    assert message in info.value.message


def test_window_functions_match_an_independent_computation() -> None:
    rng = np.random.default_rng(3)
    xs = [float(x) for x in rng.normal(0.1, 0.03, size=40)]
    w = window(kl=xs)
    last10 = xs[-10:]
    assert val("avg(kl, 10)", w) == pytest.approx(statistics.fmean(last10))
    assert val("min(kl, 10)", w) == min(last10)
    assert val("max(kl, 10)", w) == max(last10)
    assert val("std(kl, 10)", w) == pytest.approx(statistics.pstdev(last10))
    assert val("delta(kl, 10)", w) == pytest.approx(last10[-1] - last10[0])
    assert val("slope(kl, 10)", w) == pytest.approx(np.polyfit(np.arange(31, 41), last10, 1)[0])
    prev = xs[-11:-1]
    assert val("zscore(kl, 10)", w) == pytest.approx((xs[-1] - statistics.fmean(prev)) / statistics.pstdev(prev))
    assert val("best(kl)", w) == max(xs)
    assert val("best(kl, 5)", w) == max(xs[-5:])
    assert val("since_best(kl)", w) == 40 - (xs.index(max(xs)) + 1)
    assert val("count_over(kl > 0.1, 10)", w) == sum(x > 0.1 for x in last10)
    assert val("abs(-kl)", w) == xs[-1]


def test_windows_count_steps_not_samples_when_a_metric_is_missing() -> None:
    w = window(kl=[1.0, None, None, 4.0], reward=[0.1, 0.2, 0.3, 0.4])
    assert val("avg(kl, 2)", w) == 4.0  # steps 3..4: only step 4 has kl
    assert val("avg(kl, 4)", w) == 2.5
    with pytest.raises(MissingDataError):
        compile_expr("kl > 0")(w, at=3)
    assert val("default(kl, -1) + 0", Window.from_records([{"step": 1, "data": {}}])) == -1


def test_finiteness_and_events() -> None:
    w = window(vf_loss=[0.1, math.nan], kl=[0.0, 0.01])
    assert val("isnan(vf_loss)", w, E.BOOL) is True
    assert val("isfinite(kl)", w, E.BOOL) is True
    assert val("nonfinite()", w, E.BOOL) is True
    assert val("nonfinite(kl, lr)", w, E.BOOL) is False  # lr is not logged: cannot be non-finite
    assert val("max(vf_loss, 2) > 0", w, E.BOOL) is False  # NaN poisons a window, comparisons are false
    w.add_event({"kind": "oom", "step": 2})
    w.add_event({"kind": "oom", "step": 2})
    seq_after_first = 1
    c = compile_expr('event("oom")', E.NUM)
    assert c(w, seq=0) == 2 and c(w, seq=seq_after_first) == 1 and c(w, seq=w.event_seq) == 0
    assert compile_expr('event_count("oom", 5)', E.NUM)(w) == 2


def test_division_by_zero_gives_ieee_values_not_exceptions() -> None:
    w = window(kl=[0.0])
    assert val("1 / kl", w) == math.inf
    assert math.isnan(val("kl / kl", w))


def test_window_rewinds_when_a_step_is_rewritten() -> None:
    w = window(reward=[0.1, 0.9, 0.2, 0.3])
    assert val("best(reward)", w) == 0.9
    w.append(2, {"reward": 0.15})  # a rollback re-trains step 2: steps 2.. are replaced
    assert w.step == 2 and val("best(reward)", w) == 0.15
    assert val("avg(reward, 10)", w) == pytest.approx(0.125)


def test_best_so_far_survives_trimming_of_the_window() -> None:
    w = Window(5)
    for s in range(1, 40):
        w.append(s, {"reward": 1.0 if s == 3 else 0.5})
    assert val("best(reward)", w) == 1.0
    assert val("since_best(reward)", w) == 36


# -- properties --------------------------------------------------------------------

METRICS = st.sampled_from(["kl", "kl_std", "reward", "vf_loss", "entropy", "lr"])
NUMS = st.floats(min_value=0, max_value=1e6, allow_nan=False).map(lambda x: E.Num(x))
WIN = st.integers(1, 50).map(lambda n: E.Num(float(n)))


def _num_trees() -> st.SearchStrategy[E.Node]:
    leaves = st.one_of(NUMS, METRICS.map(E.Metric), st.just(E.Step()))
    calls = st.one_of(
        st.tuples(st.sampled_from(["avg", "min", "max", "std", "slope", "delta", "zscore"]), METRICS, WIN).map(
            lambda t: E.Call(t[0], (E.Metric(t[1]), t[2]))
        ),
        METRICS.map(lambda m: E.Call("best", (E.Metric(m),))),
        st.sampled_from(sorted(["oom", "nan", "rollback"])).map(lambda k: E.Call("event", (E.Str(k),))),
    )
    return st.recursive(
        st.one_of(leaves, calls),
        lambda inner: st.one_of(
            st.tuples(st.sampled_from("+-*/"), inner, inner).map(lambda t: E.Binary(t[0], t[1], t[2])),
            inner.map(lambda x: E.Unary("-", x)),
            inner.map(lambda x: E.Call("abs", (x,))),
        ),
        max_leaves=8,
    )


def _cond_trees() -> st.SearchStrategy[E.Node]:
    base = st.tuples(st.sampled_from(["<", ">", "<=", ">=", "==", "!="]), _num_trees(), _num_trees()).map(
        lambda t: E.Compare((t[0],), (t[1], t[2]))
    )
    return st.recursive(
        base,
        lambda inner: st.one_of(
            st.tuples(st.sampled_from(["and", "or"]), inner, inner).map(lambda t: E.BoolOp(t[0], t[1], t[2])),
            inner.map(E.Not),
        ),
        max_leaves=5,
    )


@settings(max_examples=150, deadline=None)
@given(_cond_trees())
def test_unparse_then_parse_gives_back_the_same_tree(tree: E.Node) -> None:
    assert parse(unparse(tree)) == tree


@settings(max_examples=60, deadline=None)
@given(_cond_trees(), st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=30))
def test_compiled_expressions_return_a_bool_or_raise_only_missing_data(tree: E.Node, xs: list[float]) -> None:
    c = compile_expr(unparse(tree))
    w = window(kl=xs, reward=xs[::-1], kl_std=xs, vf_loss=xs, entropy=xs)
    try:
        assert isinstance(c(w), bool)
    except MissingDataError:
        pass  # e.g. lr is not in this window, or too few points for slope


ALPHABET = st.sampled_from(list("kl_avgminstep()0123456789.,+-*/<>=! \"'andornotmvf") + ["and", "or", "not", "kl", "avg("])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(ALPHABET, max_size=30).map("".join)))
def test_random_text_either_compiles_or_raises_expr_error(text: str) -> None:
    try:
        compile_expr(text)
    except ExprError as exc:
        assert 1 <= exc.col <= len(text) + 1


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    with pytest.raises(ExprError, match="nested deeper"):
        compile_expr("(" * 500 + "kl" + ")" * 500 + " > 1")
    with pytest.raises(ExprError, match="nested deeper"):
        compile_expr("-" * 500 + "kl > 1")


def test_from_records_in_file_order_drops_a_rolled_back_branch() -> None:
    recs = [{"step": s, "data": {"critic/score/mean": 0.1 * s}} for s in range(1, 7)]
    recs += [{"step": s, "data": {"critic/score/mean": 0.0}} for s in (4, 5)]  # rolled back to 3
    w = Window.from_records(recs, events=[{"kind": "rollback", "step": 6}])
    assert w.step == 5 and w.steps() == [1, 2, 3, 4, 5]
    assert val("best(reward)", w) == pytest.approx(0.3)
    assert w.event_seq == 1 and w.events_since(0)[0]["kind"] == "rollback"


def test_a_rewritten_step_forgets_that_it_was_non_finite() -> None:
    w = window(kl=[0.1, 0.1, math.inf])
    assert val("nonfinite()", w, E.BOOL) is True
    w.append(3, {"kl": 0.1})  # the step re-trained after a rollback is finite
    assert val("nonfinite()", w, E.BOOL) is False


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["critic/kl", "actor/reward_kl_penalty", "actor/kl_loss", "actor/entropy_loss", "actor/entropy",
                     "val/test_score/openai/gsm8k", "timing/gen", "critic/score/mean", "flag"]),
    st.one_of(st.floats(allow_nan=False), st.booleans(), st.text(max_size=3)),
))
def test_the_kl_signal_is_the_best_ranked_key_the_record_carries(data: dict) -> None:
    from ppo_watchdog.protocol import catalog

    sources: dict[str, str] = {}
    out = catalog.to_short(data, sources)
    numeric = {k for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    want = next((k for k in ("actor/reward_kl_penalty", "critic/kl", "actor/kl_loss") if k in numeric), None)
    assert sources.get("kl") == want
    if want is not None:
        assert out["kl"] == float(data[want])
    assert ("kl_loss" in out) == ("actor/kl_loss" in numeric)


# -- the hot path's shortcuts (issue 22): each gives what the plain evaluation gives -------------


def test_a_holds_shared_by_two_packs_is_not_shared_when_their_parameters_differ() -> None:
    # holds() is cached per step under its text; the text must carry the parameters' values.
    w = window(kl=[0.5])
    low = compile_expr("holds(kl > $t)", E.BOOL, {"t": 0.1})
    high = compile_expr("holds(kl > $t)", E.BOOL, {"t": 1.0})
    assert low(w) is True
    assert high(w) is False
    assert low(w) is True


def test_a_holds_that_reads_events_is_evaluated_again_for_another_seq() -> None:
    w = window(kl=[0.5])
    w.add_event({"kind": "oom", "step": 1})
    c = compile_expr('holds(event("oom") > 0)', E.BOOL)
    assert c(w, 1, 0) is True
    assert c(w, 1, 1) is False  # the event was seen by the last evaluation


def test_a_window_function_cached_at_one_step_is_not_read_at_another() -> None:
    w = window(kl=[1.0, 2.0, 4.0, 8.0, 16.0])
    avg2 = compile_expr("avg(kl, 2)", E.NUM)
    med3 = compile_expr("median(kl, 3, 1)", E.NUM)
    assert avg2(w, 5) == 12.0 and avg2(w, 3) == 3.0 and avg2(w, 5) == 12.0
    assert med3(w, 5) == 4.0 and med3(w, 4) == 2.0
    w.append(6, {"kl": 32.0})  # new data: nothing cached survives
    assert avg2(w, 6) == 24.0 and med3(w, 6) == 8.0


def test_count_median_and_min_of_one_window_share_its_values_and_agree_with_the_plain_math() -> None:
    vals = [3.0, -0.0, 0.0, 7.0, 1.0, math.nan, 2.0, 5.0]
    w = window(kl=vals)
    for at in range(1, len(vals) + 1):
        recent = vals[max(0, at - 1 - 4):at - 1]  # the 4 steps before ``at``
        c = compile_expr("count(kl, 4, 1) + median(kl, 4, 1) + min(kl, 4, 1)", E.NUM)
        if not recent:
            with pytest.raises(MissingDataError, match=r"median\(kl, 4, 1\): no values"):
                c(w, at)
            continue
        want = len(recent) + (math.nan if any(map(math.isnan, recent)) else
                              statistics.median(recent) + min(recent))
        got = c(w, at)
        assert (math.isnan(got) and math.isnan(want)) or got == want


def test_slope_over_consecutive_steps_is_bit_for_bit_the_least_squares_formula() -> None:
    rnd = np.random.default_rng(3)
    for start in (1, 10**12):  # far steps too: the centred steps must stay exact
        ys = [float(x) for x in rnd.normal(0.0, 1.0, 30)]
        w = Window(100)
        for i, y in enumerate(ys):
            w.append(start + i, {"reward": y})
        steps = list(range(start, start + 30))
        mx = sum(steps) / 30
        my = math.fsum(ys) / 30
        want = math.fsum((x - mx) * (y - my) for x, y in zip(steps, ys, strict=True)) / sum((x - mx) ** 2 for x in steps)
        assert compile_expr("slope(reward, 30)", E.NUM)(w).hex() == want.hex()


def test_and_or_chains_stop_at_the_first_deciding_condition_as_python_does() -> None:
    w = window(kl=[0.5])  # vf_loss is never logged: reading it raises
    assert val("kl > 1 and kl > 0 and vf_loss > 0 and kl > 0", w, E.BOOL) is False
    assert val("kl > 0 or vf_loss > 0 or kl > 1 or kl > 2", w, E.BOOL) is True
    with pytest.raises(MissingDataError):
        val("kl > 0 and kl > 0.1 and vf_loss > 0 and kl > 1", w, E.BOOL)
    assert val("kl > 1 or kl > 2 or kl > 3 or kl > 0.4", w, E.BOOL) is True
    assert val("kl > 1 or (kl > 2 and kl > 0) or kl < 0", w, E.BOOL) is False


def test_constant_operands_and_parameters_compute_as_the_general_operations() -> None:
    w = window(kl=[0.25])
    p = {"k": 2.0, "z": 0.0}
    assert compile_expr("$k * kl + 1 - kl / $k", E.NUM, p)(w) == 2.0 * 0.25 + 1 - 0.25 / 2.0
    assert compile_expr("0 / (kl - kl) > 0", E.BOOL, p)(w) is False  # 0/0 is nan, not an error
    assert compile_expr("1 / (kl - kl)", E.NUM, p)(w) == math.inf
    assert compile_expr("kl / $z", E.NUM, p)(w) == math.inf
    assert compile_expr("-$k < kl", E.BOOL, p)(w) is True
    assert compile_expr("step >= 1 and kl == 0.25 and 2 > kl", E.BOOL, p)(w) is True


@pytest.mark.parametrize("text", ["count_over(kl > median(kl, 20), 10)", "count_over(kl > 1.2 * avg(kl, 20, 3), 10)"])
def test_a_count_over_reads_its_conditions_windows_in_full_from_a_window_sized_by_its_reach(text: str) -> None:
    """The condition is judged n - 1 steps back too: a window sized by max(n, the condition's window) alone
    held too few of those steps after a trim, and 29 of these 299 counts differed from an unbounded window's."""
    n = compile_expr(text, want="number")
    assert n.max_window == 9 + (20 if "median" in text else 23)
    sized, whole = Window(window_steps(n.max_window), n.metrics), Window(None, n.metrics)
    r = random.Random(3)
    for step in range(1, 300):
        v = {"kl": r.random() * (1 + step / 50)}  # (a rising series: the old steps' baselines matter)
        sized.append(step, v)
        whole.append(step, v)
        assert n.fn(sized, step, 0) == n.fn(whole, step, 0), step
