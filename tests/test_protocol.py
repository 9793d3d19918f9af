"""The run-directory protocol's typed files: run.json as RunInfo, events.jsonl lines as Events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_watchdog.protocol import hydra, rundir
from ppo_watchdog.protocol.events import Event, EventError
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError, update

REPO = Path(__file__).resolve().parents[1]


def test_run_json_round_trips_and_keeps_fields_it_does_not_know(tmp_path: Path) -> None:
    (tmp_path / rundir.RUN_JSON).write_text(json.dumps({
        "id": "r1", "pid": 42, "live_keys": [], "started": 1700000000, "from_a_newer_trainer": {"x": 1},
    }))
    info = RunInfo.read(tmp_path)
    assert (info.id, info.pid, info.live_keys, info.started) == ("r1", 42, [], 1700000000.0)
    assert info.commands is None  # not said: every command is done in process
    update(tmp_path, metrics_port=9100)
    doc = json.loads((tmp_path / rundir.RUN_JSON).read_text())
    # An empty live_keys is an answer (nothing is live) and survives; the unknown field too.
    assert doc == {"id": "r1", "pid": 42, "live_keys": [], "started": 1700000000.0,
                   "from_a_newer_trainer": {"x": 1}, "metrics_port": 9100}
    assert RunInfo.read(tmp_path / "nowhere") == RunInfo()


@pytest.mark.parametrize(("text", "message"), [
    ("{\"id\": \"r\",", "not JSON (line 1"),
    ("[1, 2]", "top level must be an object, got list"),
    ("{\"pid\": \"123\"}", "'pid': must be an integer, got '123'"),
    ("{\"pid\": true}", "'pid': must be an integer, got True"),
    ("{\"live_keys\": [\"a\", 3]}", "'live_keys': must be a list of strings"),
    ("{\"exit_codes\": {\"oom\": \"75\"}}", "'exit_codes': must be an object of integers"),
])
def test_a_bad_run_json_names_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / rundir.RUN_JSON).write_text(text)
    with pytest.raises(RunInfoError) as err:
        RunInfo.read(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / rundir.RUN_JSON}: ")
    assert message in str(err.value)


def test_an_atomic_write_makes_its_directory_and_leaves_the_old_file_whole_when_it_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "new" / "dir" / "control.json"
    rundir.atomic_write_bytes(path, b"v1" * 40_000)  # (more than one write(2) may take)
    assert path.read_bytes() == b"v1" * 40_000

    def no_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", no_disk)
    with pytest.raises(OSError, match="No space"):
        rundir.atomic_write_bytes(path, b"v2")
    assert path.read_bytes() == b"v1" * 40_000
    assert sorted(p.name for p in path.parent.iterdir()) == ["control.json"]  # no temporary file left


def test_without_clears_a_field_another_process_writes_again(tmp_path: Path) -> None:
    info = RunInfo(id="r", pid=1, metrics_port=9000, extra={"trainer_hint": 1})
    cleared = info.without("metrics_port", "trainer_hint")
    assert cleared.metrics_port is None and cleared.extra == {} and cleared.pid == 1
    assert info.metrics_port == 9000  # a copy


@pytest.mark.parametrize(("obj", "field", "reason"), [
    ({"step": 1}, "kind", "non-empty string"),
    ({"kind": "oom", "step": -1}, "step", "non-negative integer"),
    ({"kind": "oom", "step": "3"}, "step", "non-negative integer"),
    ({"kind": "oom", "step": True}, "step", "non-negative integer"),
    ({"kind": "oom", "ts": "yesterday"}, "ts", "finite number"),
])
def test_an_invalid_event_names_its_field(obj: dict, field: str, reason: str) -> None:
    with pytest.raises(EventError) as err:
        Event.parse(obj, "events.jsonl:7")
    assert err.value.field == field and reason in str(err.value)
    assert str(err.value).startswith("events.jsonl:7: ")


def test_reading_events_skips_invalid_lines_and_says_where(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rundir.append_event(tmp_path, "started", 0)
    with open(tmp_path / rundir.EVENTS, "a") as f:
        f.write('{"kind": "checkpoint", "step": "five"}\nnot json\n')
    rundir.append_event(tmp_path, "checkpoint", 5, path="p")
    events = rundir.iter_events(tmp_path)
    assert [(e.kind, e.step) for e in events] == [("started", 0), ("checkpoint", 5)]
    assert isinstance(events[1].ts, float) and events[1]["path"] == "p"
    assert f"{tmp_path / rundir.EVENTS}:2: 'step'" in caplog.text
    assert f"{tmp_path / rundir.EVENTS}:3: not JSON" in caplog.text
    with pytest.raises(ValueError, match="unknown event kind 'exploded'"):
        rundir.append_event(tmp_path, "exploded", 1)


def test_the_protocol_imports_without_torch_or_the_rest_of_the_project() -> None:
    code = (
        "import sys, ppo_watchdog.protocol.rundir, ppo_watchdog.protocol.runinfo, ppo_watchdog.protocol.events, "
        "ppo_watchdog.protocol.control, ppo_watchdog.protocol.catalog, ppo_watchdog.protocol.checkpoint, "
        "ppo_watchdog.protocol.hydra\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'verl') "
        "or (m.startswith('ppo_watchdog.') and not m.startswith('ppo_watchdog.protocol')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30),
)


@given(st.one_of(scalars, st.lists(scalars, max_size=4)))
@settings(max_examples=300, deadline=None)
def test_every_value_the_watchdog_writes_reads_back_through_hydra(value: object) -> None:
    try:
        text = hydra.format_override("some.key", value)
    except hydra.OverrideError:
        return  # refused, never written wrong (a string Hydra's grammar cannot hold)
    back = hydra.parse(text)
    assert back.key == "some.key"
    assert back.value == value or (isinstance(value, list) and back.value == list(value))
    assert type(back.value) is type(value)


def test_a_command_line_keeps_what_is_not_an_override_and_replaces_what_is() -> None:
    base = ["python", "-c", "import sys; x=1", "-m", "verl.trainer.main_ppo", "a.b=1", "+c=x", "d='p,q'"]
    assert hydra.values(base) == {"a.b": 1, "c": "x", "d": "p,q"}
    out = hydra.with_overrides(base, {"c": "y y", "e": 0.5}, ["trainer.resume_mode=resume_path"])
    assert out == ["python", "-c", "import sys; x=1", "-m", "verl.trainer.main_ppo", "a.b=1", "d='p,q'",
                   "c=y y", "e=0.5", "trainer.resume_mode=resume_path"]
    with pytest.raises(hydra.OverrideError, match="a sweep"):
        hydra.values(["lr=1,2"])


def test_a_run_json_rewritten_right_after_a_read_is_read_again(tmp_path: Path) -> None:
    # Same size, same second: only the content differs. Written atomically (a new inode) or not, the
    # second read sees the second version.
    RunInfo(pid=1111).write(tmp_path)
    assert RunInfo.read(tmp_path).pid == 1111
    RunInfo(pid=2222).write(tmp_path)
    assert RunInfo.read(tmp_path).pid == 2222
    path = tmp_path / rundir.RUN_JSON
    path.write_text(path.read_text().replace("2222", "3333"))  # rewritten in place, same size
    assert RunInfo.read(tmp_path).pid == 3333


def test_an_unchanged_run_json_is_parsed_once_and_each_reader_gets_its_own_copy(tmp_path: Path,
                                                                             monkeypatch) -> None:
    from ppo_watchdog.protocol import runinfo

    # A file is remembered once it is older than the file system's timestamp granularity (1 s); a
    # test cannot set a change time back, so the age asked for is lowered instead.
    monkeypatch.setattr(runinfo, "READ_CACHE_AFTER_S", 0.0)
    RunInfo(pid=1111, config={"a": 1}).write(tmp_path)
    parsed = []
    real = RunInfo._parse.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(RunInfo, "_parse", classmethod(lambda cls, p: parsed.append(p) or real(cls, p)))
    first = RunInfo.read(tmp_path)
    first.pid = 9  # a caller that changes its copy changes nobody else's
    again = RunInfo.read(tmp_path)
    assert (again.pid, again.config, len(parsed)) == (1111, {"a": 1}, 1)
    (tmp_path / rundir.RUN_JSON).write_text(json.dumps({"pid": 4444}))  # a new version: read again
    assert RunInfo.read(tmp_path).pid == 4444 and len(parsed) == 2


def test_a_garbled_run_json_is_still_an_error_on_every_read(tmp_path: Path) -> None:
    (tmp_path / rundir.RUN_JSON).write_text("{not json")
    for _ in range(2):
        with pytest.raises(RunInfoError, match="not JSON"):
            RunInfo.read(tmp_path)


def test_metric_lines_orjson_refuses_read_as_the_standard_decoder_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "data": {"x": NaN, "y": Infinity}}\n'
                     b'{"step": 2, "data": {"big": 123456789012345678901234567890}}\n'
                     b'{"step": 3, "data": {"x": 0.5}}\n'
                     b'{"step": 4, "data": \n')
    chunk = rundir.read_jsonl(path)
    assert [r["step"] for r in chunk.records] == [1, 2, 3]
    x = chunk.records[0]["data"]["x"]
    assert x != x and chunk.records[0]["data"]["y"] == float("inf")
    # (orjson reads an integer past 64 bits as a float; no trainer logs one, and a metric is a float anyway)
    assert float(chunk.records[1]["data"]["big"]) == float(123456789012345678901234567890)
    path.write_bytes(b'{"step": 5, "data": {"x": 1.0}\n')
    assert rundir.read_jsonl(path).errors[0].startswith(f"{path}:1: not JSON (")
