"""Fault schedule: parsing, firing once per run directory, and the memory budget's real OOM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_watchdog.trainer.faults import FIRED_FILE, KINDS, Fault, FaultSchedule, MemoryBudget

SPEC = "kl_collapse@20,lr_spike@30:x20,nan@45,oom@60,hang@80:30,crash@90"


def test_the_documented_example_parses() -> None:
    sched = FaultSchedule.parse(SPEC)
    assert [(f.kind, f.step, f.arg) for f in sched.faults] == [
        ("kl_collapse", 20, None), ("lr_spike", 30, 20.0), ("nan", 45, None),
        ("oom", 60, None), ("hang", 80, 30.0), ("crash", 90, None),
    ]
    assert sched.faults[0].value == 0.0 and sched.faults[-1].value == 1.0
    assert str(sched) == SPEC


@pytest.mark.parametrize("spec", [None, "", "  "])
def test_an_empty_spec_is_an_empty_schedule(spec: str | None) -> None:
    sched = FaultSchedule.parse(spec)
    assert not sched and sched.due(1) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nan@5,explode@7", r"item 2 'explode@7': unknown kind 'explode'"),
        ("nan@5,lr_spike", r"item 2 'lr_spike': expected kind@step"),
        ("lr_spike@x", r"item 1 'lr_spike@x': expected kind@step"),
        ("nan@0", r"item 1 'nan@0': step must be >= 1"),
        ("nan@3:2", r"item 1 'nan@3:2': nan takes no argument"),
        ("hang@3:soon", r"item 1 'hang@3:soon': argument 'soon' is not a number"),
        ("lr_spike@3:x-2", r"item 1 'lr_spike@3:x-2': argument must be a finite number >= 0"),
        ("crash@3:1.5", r"exit code must be an integer"),
        ("oom@4, oom@4", r"item 2 'oom@4': oom@4 given twice"),
        ("nan@5,,oom@6", r"item 2 '': expected kind@step"),
    ],
)
def test_parse_errors_name_the_bad_item(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultSchedule.parse(spec)


def test_each_fault_fires_once(tmp_path: Path) -> None:
    sched = FaultSchedule.parse("nan@3,oom@3,crash@5", tmp_path)
    assert sched.due(2) == []
    assert [f.kind for f in sched.due(3)] == ["nan", "oom"]
    assert sched.due(3) == []
    assert [f.kind for f in sched.due(5)] == ["crash"]


def test_a_resumed_run_does_not_reinject_a_fault_that_already_fired(tmp_path: Path) -> None:
    first = FaultSchedule.parse("oom@4,crash@6", tmp_path)
    assert [f.kind for f in first.due(4)] == ["oom"]
    assert (tmp_path / FIRED_FILE).is_file()
    # the trainer exits; a new process resumes from the step-2 checkpoint over the same run dir
    resumed = FaultSchedule.parse("oom@4,crash@6", tmp_path)
    assert [resumed.due(s) for s in (3, 4, 5)] == [[], [], []]
    assert [f.kind for f in resumed.due(6)] == ["crash"]
    # a fresh run directory starts with nothing fired
    assert [f.kind for f in FaultSchedule.parse("oom@4", tmp_path / "other").due(4)] == ["oom"]


def test_an_unbound_schedule_remembers_in_memory_only() -> None:
    sched = FaultSchedule.parse("nan@1")
    assert len(sched.due(1)) == 1 and sched.due(1) == []


def test_a_damaged_fired_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / FIRED_FILE).write_text("[1,")
    with pytest.raises(ValueError, match=FIRED_FILE):
        FaultSchedule.parse("nan@1", tmp_path)


faults_st = st.lists(
    st.builds(
        Fault,
        kind=st.sampled_from(KINDS),
        step=st.integers(1, 10_000),
        arg=st.none(),
    ),
    max_size=6,
    unique_by=lambda f: f.id,
)


@given(faults_st, st.data())
def test_a_schedule_round_trips_through_its_spec(faults: list[Fault], data: st.DataObject) -> None:
    with_args = []
    for f in faults:
        arg = None
        if f.kind in ("lr_spike", "kl_collapse", "hang"):
            arg = data.draw(st.none() | st.integers(0, 500).map(float))
        elif f.kind == "crash":
            arg = data.draw(st.none() | st.integers(0, 255).map(float))
        with_args.append(Fault(f.kind, f.step, arg))
    spec = ",".join(str(f) for f in with_args)
    parsed = FaultSchedule.parse(spec)
    assert sorted(parsed.faults, key=lambda f: f.id) == sorted(with_args, key=lambda f: f.id)
    assert FaultSchedule.parse(str(parsed)).faults == parsed.faults


def test_memory_budget_raises_a_real_out_of_memory_error() -> None:
    budget = MemoryBudget(tokens_per_micro_batch=256)
    budget.check(256, "actor micro-batch")  # fits
    with pytest.raises(torch.OutOfMemoryError, match=r"actor micro-batch: micro-batch of 257 tokens exceeds .* 256"):
        budget.check(257, "actor micro-batch")
    # the same type a CUDA OOM has, so one except clause serves both
    assert torch.OutOfMemoryError is torch.cuda.OutOfMemoryError


def test_an_unlimited_budget_never_raises_unless_forced() -> None:
    budget = MemoryBudget(None)
    budget.check(10**9, "critic")
    budget.force_next()
    with pytest.raises(torch.OutOfMemoryError, match="critic: injected"):
        budget.check(1, "critic")
    budget.check(1, "critic")


def test_a_bad_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        MemoryBudget(0)
