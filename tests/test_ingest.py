"""Reading metrics: verl's real console logs, FileLogger JSONL, dedup, and tailing a live run dir."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from verl_logs import HEALTHY, NAN, needs_logs

from ppo_watchdog.protocol import rundir
from ppo_watchdog.sources import ingest


@needs_logs
def test_healthy_verl_console_log_yields_its_106_steps_in_order() -> None:
    res = ingest.read_run(HEALTHY)
    assert res.format == "console"
    steps = [r["step"] for r in res.records]
    assert steps == list(range(106))
    assert res.issues == []


@needs_logs
def test_console_values_match_the_text_of_the_log() -> None:
    # Compute the expectation from the raw text, independently of the parser's regexes.
    text = HEALTHY.read_text()
    line = next(raw for raw in text.splitlines() if "step:57 - " in raw)
    expected_kl = float(line.split("critic/kl:")[1].split()[0])
    expected_vf = float(line.split("critic/vf_loss:")[1].split()[0])
    rec = {r["step"]: r for r in ingest.read_records(HEALTHY)}[57]
    assert rec["data"]["critic/kl"] == expected_kl
    assert rec["data"]["critic/vf_loss"] == expected_vf


@needs_logs
def test_validation_line_of_a_step_merges_with_its_training_line() -> None:
    first = ingest.read_records(HEALTHY)[0]
    assert first["step"] == 0
    assert first["data"]["test_score/openai/gsm8k"] == pytest.approx(0.521)
    assert "critic/vf_loss" in first["data"]


@needs_logs
def test_scaled_lr_key_is_also_recorded_in_real_units() -> None:
    rec = ingest.read_records(HEALTHY)[3]
    assert rec["data"]["actor/lr(1e-4)"] == pytest.approx(0.010)
    assert rec["data"]["actor/lr"] == pytest.approx(1e-6)
    assert rec["data"]["critic/lr"] == pytest.approx(1e-5)


def test_the_batchs_sequence_count_is_derived_from_verls_token_total_on_every_path(tmp_path: Path) -> None:
    """verl logs no count of sequences; 16 sequences of 24 + 8 tokens are 512. The typed FileLogger path (numbers
    only), the general one (a null among them) and a console line give the same count; a step without all three
    parts gives none."""
    parts = {"perf/total_num_tokens": 512, "prompt_length/mean": 24.0, "response_length/mean": 8.0}
    log = tmp_path / "verl.jsonl"
    log.write_text(json.dumps({"step": 1, "data": parts}) + "\n"
                   + json.dumps({"step": 2, "data": {**parts, "actor/grad_norm": None}}) + "\n"
                   + json.dumps({"step": 3, "data": {"perf/total_num_tokens": 512, "prompt_length/mean": 24.0}}) + "\n")
    counts = {r["step"]: r["data"].get("derived/num_sequences") for r in ingest.read_records(log)}
    assert counts == {1: 16.0, 2: 16.0, 3: None}
    console = ingest.parse_console_line("step:4 - perf/total_num_tokens:384 - prompt_length/mean:24.0 - "
                                        "response_length/mean:8.0")
    assert console is not None and console[1]["derived/num_sequences"] == 12.0


@needs_logs
def test_nan_excerpts_give_nan_values_and_report_the_truncated_tail() -> None:
    res = ingest.read_run(NAN)
    by_step = {r["step"]: r["data"] for r in res.records}
    assert sorted(by_step) == [1, 59, 83]
    assert math.isnan(by_step[1]["critic/vf_loss"])
    assert math.isnan(by_step[1]["critic/grad_norm"])
    assert by_step[1]["actor/grad_norm"] == pytest.approx(9.819)
    assert math.isnan(by_step[59]["actor/pg_loss"])
    assert math.isnan(by_step[83]["actor/grad_norm"])
    assert by_step[83]["critic/score/mean"] == -1.0
    # the third excerpt is cut mid-key ("- prompt"): one issue naming file and line
    assert [str(i) for i in res.issues] == [f"{NAN}:7: item 'prompt' is not key:value"]


def test_console_line_with_ansi_and_ray_prefix_parses() -> None:
    line = "\x1b[2m\x1b[36m(TaskRunner pid=123)\x1b[0m step:7 - actor/pg_loss:-0.5 - critic/kl:1e-06 - x/y:inf"
    step, data, problems = ingest.parse_console_line(line)  # type: ignore[misc]
    assert (step, problems) == (7, [])
    assert data["actor/pg_loss"] == -0.5
    assert data["critic/kl"] == 1e-06
    assert data["x/y"] == math.inf


@pytest.mark.parametrize(
    ("text", "expected"),
    [("nan", math.nan), ("-inf", -math.inf), ("1e-06", 1e-06), ("np.float64(0.1)", 0.1),
     ("np.float32(1e-06)", 1e-06), ("numpy.int64(3)", 3.0), ("tensor(0.25)", 0.25),
     ("True", None), ("abc", None)],
)
def test_parse_value_handles_verl_reprs(text: str, expected: float | None) -> None:
    got = ingest.parse_value(text)
    if expected is None:
        assert got is None
    elif math.isnan(expected):
        assert got is not None and math.isnan(got)
    else:
        assert got == pytest.approx(expected)


def test_other_output_and_lookalike_keys_are_not_step_lines() -> None:
    assert ingest.parse_console_line("Training Progress: 10%| global_step:3 - foo:1") is None
    assert ingest.parse_console_line("(main_task pid=1) {'step': 3}") is None
    assert ingest.parse_console_line("checkpoint saved at step:3 of 10") is None
    assert ingest.parse_console_line("Saving checkpoint at step:3") is None


def test_console_log_with_garbled_value_reports_file_line_and_key(tmp_path: Path) -> None:
    p = tmp_path / "console.log"
    p.write_text("Started\nstep:1 - a/b:0.5 - c/d:oops - e/f:2\nnoise\n")
    res = ingest.read_run(p)
    assert res.records == [{"step": 1, "data": {"a/b": 0.5, "e/f": 2.0}}]
    assert [str(i) for i in res.issues] == [f"{p}:2: key 'c/d': value 'oops' is not a number"]


def test_filelogger_jsonl_reads_orjson_null_as_nan_and_skips_garbled_lines(tmp_path: Path) -> None:
    p = tmp_path / "verl.jsonl"
    p.write_text(
        '{"step": 1, "data": {"critic/kl": 0.01, "actor/pg_loss": null, "note": "text"}}\n'
        "{not json\n"
        '{"step": "two", "data": {}}\n'
        '{"step": 2, "data": {"critic/kl": 0.02}}\n'
    )
    res = ingest.read_run(p)
    assert res.format == "jsonl"
    assert [r["step"] for r in res.records] == [1, 2]
    assert math.isnan(res.records[0]["data"]["actor/pg_loss"])
    assert "note" not in res.records[0]["data"]
    assert [i.line for i in res.issues] == [2, 3]
    assert str(res.issues[1]) == f"{p}:3: 'step' must be an integer, got 'two'"


def test_trainer_metrics_jsonl_in_a_run_dir_is_read_via_the_directory(tmp_path: Path) -> None:
    for step in range(1, 4):
        rundir.append_metrics(tmp_path, step, {"actor/reward_kl_penalty": step / 100})
    rundir.append_event(tmp_path, "checkpoint", 2, path="x", epoch=0)
    assert [r["data"]["actor/reward_kl_penalty"] for r in ingest.read_records(tmp_path)] == [0.01, 0.02, 0.03]
    assert [e["kind"] for e in ingest.read_events(tmp_path)] == ["checkpoint"]


def test_missing_file_is_a_clean_ingest_error(tmp_path: Path) -> None:
    with pytest.raises(ingest.IngestError, match=re.escape(str(tmp_path / "nope.jsonl")) + ": no such file"):
        ingest.read_records(tmp_path / "nope.jsonl")
    with pytest.raises(ingest.IngestError, match="not a run directory"):
        ingest.read_records(tmp_path)


def test_resumed_run_rewrites_steps_and_drops_the_abandoned_branch() -> None:
    raw = [{"step": s, "data": {"k": float(s)}} for s in range(1, 8)]
    # restart from the checkpoint at step 4: steps 5.. are written again with new values
    raw += [{"step": s, "data": {"k": 100.0 + s}} for s in range(5, 7)]
    out = ingest.dedup_records(raw)
    assert [(r["step"], r["data"]["k"]) for r in out] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 105), (6, 106)]


def test_same_step_with_overlapping_keys_keeps_the_newest_line() -> None:
    out = ingest.dedup_records([{"step": 3, "data": {"k": 1.0}}, {"step": 3, "data": {"k": 2.0}}])
    assert out == [{"step": 3, "data": {"k": 2.0}}]


# -- tailing ------------------------------------------------------------------------------


def test_tailer_leaves_a_partial_last_line_for_the_next_poll(tmp_path: Path) -> None:
    metrics = tmp_path / rundir.METRICS
    rundir.append_metrics(tmp_path, 1, {"critic/kl": 0.1})
    line2 = json.dumps({"step": 2, "data": {"critic/kl": 0.2}}) + "\n"
    with open(metrics, "a") as f:
        f.write(line2[:10])
    t = ingest.RunTailer(tmp_path)
    recs, events = t.poll()
    assert [r["step"] for r in recs] == [1] and events == []
    with open(metrics, "a") as f:
        f.write(line2[10:])
    recs, _ = t.poll()
    assert recs == [{"step": 2, "data": {"critic/kl": 0.2}}]
    assert t.poll() == ([], [])


def test_tailer_offsets_survive_a_restart_without_rereading(tmp_path: Path) -> None:
    rundir.append_metrics(tmp_path, 1, {"critic/kl": 0.1})
    rundir.append_event(tmp_path, "started", 0)
    t = ingest.RunTailer(tmp_path)
    t.poll()
    saved = json.loads(json.dumps(t.offsets))  # what a daemon would persist
    rundir.append_metrics(tmp_path, 2, {"critic/kl": 0.2})
    rundir.append_event(tmp_path, "oom", 2, micro_batch_size=4)
    t2 = ingest.RunTailer(tmp_path, offsets=saved)
    recs, events = t2.poll()
    assert [r["step"] for r in recs] == [2]
    assert [e["kind"] for e in events] == ["oom"]


def test_tailer_reports_garbled_line_with_its_line_number_and_goes_on(tmp_path: Path) -> None:
    metrics = tmp_path / rundir.METRICS
    rundir.append_metrics(tmp_path, 1, {"critic/kl": 0.1})
    t = ingest.RunTailer(tmp_path)
    t.poll()
    with open(metrics, "a") as f:
        f.write("garbage\n")
    rundir.append_metrics(tmp_path, 2, {"critic/kl": 0.2})
    recs, _ = t.poll()
    assert [r["step"] for r in recs] == [2]
    assert len(t.issues) == 1 and t.issues[0].startswith(f"{metrics}:2: not JSON")


def test_tailer_rereads_a_file_that_was_truncated_by_a_restarted_logger(tmp_path: Path) -> None:
    for s in range(1, 4):
        rundir.append_metrics(tmp_path, s, {"critic/kl": 0.1})
    t = ingest.RunTailer(tmp_path)
    t.poll()
    (tmp_path / rundir.METRICS).write_text(json.dumps({"step": 3, "data": {"critic/kl": 0.5}}) + "\n")
    recs, _ = t.poll()
    assert recs == [{"step": 3, "data": {"critic/kl": 0.5}}]


_record = st.one_of(
    st.builds(lambda s: {"step": s, "data": {"critic/kl": s / 10, "critic/vf_loss": 1.0}}, st.integers(0, 30)),
    st.builds(lambda s: {"step": s, "data": {"val-core/x/reward/mean@1": 0.5}}, st.integers(0, 30)),
)


@settings(max_examples=60, deadline=None)
@given(records=st.lists(_record, max_size=25), cuts=st.lists(st.integers(0, 4000), max_size=4),
       restarts=st.booleans())
@example(records=[{"step": 0, "data": {"critic/kl": 0.0, "critic/vf_loss": 1.0}},
                  {"step": 1, "data": {"critic/kl": 0.1, "critic/vf_loss": 1.0}},
                  {"step": 0, "data": {"val-core/x/reward/mean@1": 0.5}}], cuts=[63], restarts=False)
@example(records=[{"step": 1, "data": {"critic/kl": 0.1, "critic/vf_loss": 1.0}},
                  {"step": 1, "data": {"val-core/x/reward/mean@1": 0.5}}], cuts=[63], restarts=True)
def test_tailing_in_any_chunks_gives_the_same_timeline_as_reading_whole(
    tmp_path_factory: pytest.TempPathFactory, records: list[dict], cuts: list[int], restarts: bool
) -> None:
    d = tmp_path_factory.mktemp("run")
    blob = "".join(json.dumps(r) + "\n" for r in records).encode()
    t = ingest.RunTailer(d)
    history: list[dict] = []
    written = 0
    path = d / rundir.METRICS
    path.touch()
    for i, cut in enumerate(sorted(c for c in cuts if c < len(blob)) + [len(blob)]):
        with open(path, "ab") as f:
            f.write(blob[written:cut])
        written = max(written, cut)
        history = _replace_steps(history, t.poll()[0])
        if restarts and i % 2 == 0:  # a watchdog restarted from its saved positions (the last step read back)
            t = ingest.RunTailer(d, offsets=json.loads(json.dumps(t.offsets)))
    # A live run's steps only go forward within an attempt: a line below the last step with no started or
    # rollback event to explain it is ignored (issue 20); the whole file read without those lines is the same.
    forward, _, _ = ingest.forward_only(records, range(1, len(records) + 1), path, None, [])
    whole = tmp_path_factory.mktemp("whole") / rundir.METRICS
    whole.write_text("".join(json.dumps(r) + "\n" for r in forward))
    assert history == ingest.read_records(whole)


def _replace_steps(history: list[dict], records: list[dict]) -> list[dict]:
    """RunTailer's consumer contract (what Window.append_record does): each record is its step's
    whole record as it now stands, replacing that step and dropping every later one. (Not
    apply_records' merge rule: a rewound step 0 holding only a validation score must not be
    merged into the abandoned step 0's metrics; hypothesis found that case.)"""
    out = list(history)
    for rec in records:
        out = [r for r in out if r["step"] < rec["step"]] + [rec]
    return out


@needs_logs
def test_healthy_log_memory_chatter_is_not_an_oom() -> None:
    assert ingest.read_run(HEALTHY).events == []


def test_console_oom_traceback_becomes_one_oom_event_at_the_last_logged_step(tmp_path: Path) -> None:
    p = tmp_path / "verl.log"
    p.write_text(
        "(TaskRunner pid=9) step:1 - critic/kl:0.01\n"
        "(TaskRunner pid=9) step:2 - critic/kl:0.02\n"
        "Error executing job with overrides: [...]\n"
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::WorkerDict.actor_rollout_update_actor()\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity\n"
    )
    res = ingest.read_run(p)
    assert [(e["kind"], e["step"], e["device"]) for e in res.events] == [("oom", 2, "cuda")]
    assert res.events[0]["source"] == f"{p}:4"


def test_ray_memory_monitor_kill_is_a_host_oom() -> None:
    line = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory. "
            "Memory on the node (IP: 10.0.0.1) was 246.41GB / 251.54GB")
    assert ingest.scan_oom(line) == "host"
    assert ingest.scan_oom("Before building vllm rollout, memory allocated (GB): 9.7") is None


def test_a_validation_line_after_a_tailer_restart_is_merged_into_its_step(tmp_path: Path) -> None:
    rundir.append_metrics(tmp_path, 5, {"critic/kl": 0.05})
    t = ingest.RunTailer(tmp_path)
    t.poll()
    t2 = ingest.RunTailer(tmp_path, offsets=json.loads(json.dumps(t.offsets)))
    rundir.append_metrics(tmp_path, 5, {"val-core/x/reward/mean@1": 0.4})
    recs, _ = t2.poll()
    # the whole step comes back, so a consumer that replaces step 5 keeps its KL
    assert recs == [{"step": 5, "data": {"critic/kl": 0.05, "val-core/x/reward/mean@1": 0.4}}]


def test_saved_positions_hold_the_last_steps_place_and_a_file_replaced_since_gives_the_step_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A daemon saves every run's positions at every tick: the last step's ~100 values are in the file, so
    # the state keeps where they are, and a restart reads them back (merging a validation line into them).
    rundir.append_metrics(tmp_path, 4, {"critic/kl": 0.04})
    rundir.append_metrics(tmp_path, 5, {"critic/kl": 0.05, "critic/vf_loss": 1.5})
    t = ingest.RunTailer(tmp_path)
    t.poll()
    saved = json.loads(json.dumps(t.offsets))
    first = len(json.dumps({"step": 4, "data": {"critic/kl": 0.04}})) + 1
    assert saved["last"] == {"step": 5, "at": [first, (tmp_path / rundir.METRICS).stat().st_size]}
    assert ingest.RunTailer(tmp_path, offsets=saved)._last == {
        "step": 5, "data": {"critic/kl": 0.05, "critic/vf_loss": 1.5}}
    # The file replaced since (another inode): the step alone, said; the positions read it from the start.
    (tmp_path / rundir.METRICS).unlink()
    rundir.append_metrics(tmp_path, 6, {"critic/kl": 0.3})
    with caplog.at_level("WARNING"):
        t2 = ingest.RunTailer(tmp_path, offsets=saved)
    assert t2._last == {"step": 5, "data": {}}
    assert "changed since its read positions were saved: step 5's record is not there" in caplog.text
    assert t2.poll()[0] == [{"step": 6, "data": {"critic/kl": 0.3}}]
    assert t2.offsets["last"] == {"step": 6, "at": [0, (tmp_path / rundir.METRICS).stat().st_size]}  # (the new file's)


def test_tailer_rejects_offsets_of_another_version(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported version 99"):
        ingest.RunTailer(tmp_path, offsets={"version": 99})


def test_console_log_that_opens_with_a_json_line_is_still_read_as_console(tmp_path: Path) -> None:
    p = tmp_path / "out.log"
    p.write_text('{"event": "ray started"}\nstep:1 - critic/kl:0.01\nstep:2 - critic/kl:0.02\n')
    res = ingest.read_run(p)
    assert res.format == "console" and [r["step"] for r in res.records] == [1, 2]


_keys = st.from_regex(r"[a-z_]{1,8}(/[a-z_@0-9]{1,8}){0,3}", fullmatch=True)
_vals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6))


@settings(max_examples=80, deadline=None)
@given(step=st.integers(0, 10**6), data=st.dictionaries(_keys, _vals, max_size=12), numpy=st.booleans(),
       prefix=st.sampled_from(["", "(TaskRunner pid=123) ", "\x1b[36m(main_task pid=7)\x1b[0m "]))
def test_lines_printed_by_verls_own_console_logger_parse_back_exactly(
    step: int, data: dict[str, float], numpy: bool, prefix: str
) -> None:
    import numpy as np
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    logged = {k: np.float64(v) for k, v in data.items()} if numpy else data
    line = prefix + concat_dict_to_str(logged, step=step)
    parsed = ingest.parse_console_line(line)
    if not data:
        assert parsed is None  # "step:N" alone carries no metrics
        return
    assert parsed is not None
    got_step, got, problems = parsed
    assert (got_step, problems) == (step, [])
    assert set(got) == set(data)
    for k, v in data.items():
        assert (math.isnan(got[k]) and math.isnan(v)) or got[k] == float(v)


# -- the tailer's read path (one read of the new bytes, a typed decoder, the general path behind it) --------


_LINES = [
    b'{"step": 1, "data": {"critic/kl": 0.1}}\n',
    b"\n",  # blank: skipped, still counted
    b'{"step": 2, "data": {"critic/kl": 0.2}}\r\n',  # CRLF: one line
    b"garbage\n",
    b"[1, 2]\n",
    b'{"step": -1, "data": {"critic/kl": 0.3}}\n',
    b'{"step": 3, "data": {"critic/kl": 0.4}}\n',
]


def test_tailer_names_each_bad_line_once_with_its_line_number_wherever_the_polls_cut_the_file(
        tmp_path: Path) -> None:
    blob = b"".join(_LINES)
    for cut in range(len(blob) + 1):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        path = d / rundir.METRICS
        path.write_bytes(blob[:cut])
        t = ingest.RunTailer(d)
        steps = [r["step"] for r in t.poll()[0]]
        with open(path, "ab") as f:
            f.write(blob[cut:])
        for _ in range(3):  # nothing new after the first: nothing said again
            steps += [r["step"] for r in t.poll()[0]]
        assert steps == [1, 2, 3], cut
        assert [re.sub(r": .*", "", i.removeprefix(f"{path}:")) for i in t.issues] == ["4", "5", "6"], (cut, t.issues)
        assert "not JSON" in t.issues[0] and "not a JSON object" in t.issues[1] and "'step' must be >= 0" in t.issues[2]
    # Lines after them keep their numbers.
    with open(path, "ab") as f:
        f.write(b'{"step": 4, "data": "x"}\n')
    assert t.poll()[0] == [] and t.issues[-1] == f"{path}:8: skipped a record: 'data' must be an object, got str"


def test_tailer_reads_a_replaced_file_from_its_start_even_when_the_new_one_is_longer(tmp_path: Path) -> None:
    rundir.append_event(tmp_path, "started", 0)
    for s in range(1, 3):
        rundir.append_metrics(tmp_path, s, {"critic/kl": 0.1})
    t = ingest.RunTailer(tmp_path)
    assert [r["step"] for r in t.poll()[0]] == [1, 2]
    # A restarted trainer writes a new file (another inode) that is already past the old offset.
    new = tmp_path / "metrics.new"
    new.write_text("".join(json.dumps({"step": s, "data": {"critic/kl": 0.5}}) + "\n" for s in range(1, 6)))
    rundir.append_event(tmp_path, "started", 0)
    new.replace(tmp_path / rundir.METRICS)
    recs, _ = t.poll()
    assert [(r["step"], r["data"]["critic/kl"]) for r in recs] == [(s, 0.5) for s in range(1, 6)]
    assert t.offsets["metrics"]["line"] == 6 and t.issues == []


def _same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN, and a float where the other has a float."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return type(a) is type(b) and (a == b or (math.isnan(a) and math.isnan(b)))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("decoders", ["typed", "orjson", "json"])
def test_tailer_reads_null_nan_inf_ints_flags_strings_and_scaled_keys_as_a_whole_file_read_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoders: str) -> None:
    if decoders != "typed":  # msgspec absent; and then orjson absent too
        monkeypatch.setattr(ingest, "_LINE_TYPED", None)
    if decoders == "json":
        monkeypatch.setattr(rundir, "_orjson", None)
    (tmp_path / rundir.METRICS).write_bytes(
        b'{"step": 1, "data": {"a": null, "b": 1, "c": true, "d": 1e400, "e": -1e400, "f": 0.5, "g": "nan", '
        b'"h": "np.float64(0.25)", "i": [1], "x(1e-3)": 2.0}}\n'
        b'{"step": 2, "data": {"a": NaN, "b": Infinity, "c": -Infinity}}\n'
        b'{"step": 3.0, "data": {"a": 1.0}}\n'
        b'{"step": 4, "data": {"lr(1e-4)": 0.01, "lr": 5.0}}\n'
        b'{"step": 5, "data": {"a": 0.1, "b": 2, "big": 123456789012345678901234567890, "y(1e-2)": 3}}\n')
    inf, nan = math.inf, math.nan
    expected = [
        {"step": 1, "data": {"a": nan, "b": 1.0, "d": inf, "e": -inf, "f": 0.5, "g": nan, "h": 0.25,
                             "x(1e-3)": 2.0, "x": 0.002}},
        {"step": 2, "data": {"a": nan, "b": inf, "c": -inf}},
        {"step": 3, "data": {"a": 1.0}},
        {"step": 4, "data": {"lr(1e-4)": 0.01, "lr": 5.0}},
        {"step": 5, "data": {"a": 0.1, "b": 2.0, "big": 1.2345678901234568e+29, "y(1e-2)": 3.0, "y": 0.03}},
    ]
    t = ingest.RunTailer(tmp_path)
    recs, _ = t.poll()
    assert _same(recs, expected), recs
    assert _same(ingest.read_records(tmp_path), expected)
    assert t.issues == []


def test_polling_again_from_the_offsets_before_a_poll_reads_the_same_records_and_positions(tmp_path: Path) -> None:
    rundir.append_metrics(tmp_path, 1, {"critic/kl": 0.1})
    t = ingest.RunTailer(tmp_path)
    t.poll()
    saved = t.offsets
    with open(tmp_path / rundir.METRICS, "a") as f:
        f.write(json.dumps({"step": 2, "data": {"critic/kl": 0.2}}) + "\nnot json\n"
                + json.dumps({"step": 3, "data": {"critic/kl": None}}) + "\n" + '{"step": 4, "da')
    first = t.poll()[0]
    after = t.offsets
    t.offsets = saved  # an undone tick: the same bytes are read again
    again = t.poll()[0]
    assert _same(again, first) and [r["step"] for r in first] == [2, 3]
    assert t.offsets == after and after["metrics"]["line"] == 5
