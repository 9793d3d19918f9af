"""The run report: PNG and self-contained HTML from a real run directory's files."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess

import pytest

from ppo_watchdog.observe.report import (
    ReportError,
    log_axis,
    rollback_spans,
    segments,
    timelines,
    write_report,
)
from ppo_watchdog.protocol import rundir


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 13):
        rundir.append_metrics(run, step, {"actor/reward_kl_penalty": 0.01 * step, "critic/score/mean": 0.3,
                                          "critic/vf_loss": 0.2, "actor/lr": 2e-4,
                                          "actor/reward_kl_penalty_coeff": 0.05})
    rundir.append_event(run, "rollback", 12, from_step=12, to_step=6, path="x")
    for step in range(7, 10):  # the re-run after the rollback
        rundir.append_metrics(run, step, {"actor/reward_kl_penalty": 0.02, "critic/score/mean": 0.4})
    rundir.append_metrics(run, 9, {"val-core/arith/reward/mean@1": 0.5})  # validation on its own line, by source
    return run


DECISIONS = [
    {"id": 1, "step": 12, "rule": "kl_far", "kind": "fire", "actions": [{"kind": "rollback"}],
     "inputs": {"kl": 0.12}, "status": "applied", "outcome": "rolled back in process to step 6", "journal": []},
    {"id": 2, "step": 4, "rule": "kl_high", "kind": "resolve", "actions": [], "inputs": {},
     "status": "skipped", "outcome": "resolved", "journal": []},
]


def test_segments_split_where_steps_go_back_and_merge_a_separate_validation_line(tmp_path):
    run = _run_dir(tmp_path)
    segs = segments(rundir.read_jsonl(run / rundir.METRICS).records)
    assert [(s.steps[0], s.steps[-1]) for s in segs] == [(1, 12), (7, 9)]
    assert segs[1].data[-1] == {"actor/reward_kl_penalty": 0.02, "critic/score/mean": 0.4,
                                "val-core/arith/reward/mean@1": 0.5}


def test_rollback_spans_run_from_the_step_restored_to_the_step_left():
    assert rollback_spans([{"kind": "rollback", "from_step": 12, "to_step": 6}, {"kind": "oom"}]) == [(6, 12)]


def test_png_report_is_a_real_png_image(tmp_path):
    out = write_report(_run_dir(tmp_path), DECISIONS, tmp_path / "r.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 800  # five stacked panels


def test_html_report_is_self_contained_with_its_data_script_and_every_decision_in_words(tmp_path):
    out = write_report(_run_dir(tmp_path), DECISIONS, tmp_path / "r.html")
    text = out.read_text()
    assert not re.search(r'(src|href)=["\']?(https?:)?//', text)  # nothing fetched from elsewhere
    assert "<script src" not in text and "<link" not in text
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S).group(1))
    kl = next(p for p in data["panels"] if p["key"] == "actor/reward_kl_penalty")
    # the kept timeline: 1-6, then the re-run 7-9; the branch the rollback abandoned: 7-12
    assert [s for s, _ in kl["kept"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [[s for s, _ in b] for b in kl["branches"]] == [[7, 8, 9, 10, 11, 12]]
    assert data["spans"] == [[6, 12]]
    assert [m["text"] for m in data["marks"]] == ["step 12, kl_far: rolled back in process to step 6"]
    assert "step 12, kl_far: rolled back in process to step 6" in text
    assert "kl_high" not in text.split('id="report-data"')[0]  # a resolve is no line of its own
    assert "Not logged by this run: entropy, response length (tokens)." in text


def test_timelines_keep_the_rerun_and_set_aside_each_abandoned_branch_and_non_finite_values():
    segs = segments([{"step": s, "data": {"k": v}} for s, v in
                     [(1, 1.0), (2, float("nan")), (3, 3.0), (4, 4.0), (2, 2.0), (3, 3.5), (1, 0.5), (2, 2.5)]])
    kept, branches, bad = timelines(segs, "k")
    assert kept == [(1, 0.5), (2, 2.5)]
    assert branches == [[(1, 1.0), (2, None), (3, 3.0), (4, 4.0)], [(2, 2.0), (3, 3.5)]]
    assert bad == []  # the NaN was on an abandoned branch; on the kept timeline it is listed
    kept, _, bad = timelines(segments([{"step": 1, "data": {"k": 1.0}}, {"step": 2, "data": {"k": float("inf")}}]), "k")
    assert kept == [(1, 1.0), (2, None)] and bad == [(2, "inf")]


def test_kl_gets_a_log_axis_when_a_spike_would_flatten_it_and_lr_whenever_it_is_positive():
    assert log_axis([0.0, 0.02, 0.03, 0.025, 6.2])  # the explosion: 200x the median
    assert not log_axis([0.0, 0.02, 0.03, 0.025, 0.05])  # a 0 and no spike: linear, every point drawn
    assert log_axis([2e-4, 2e-4, 6e-4]) and not log_axis([None, -1.0])


def _chromium_render(page, tmp_path):
    """The page's DOM after its script ran in headless Chromium, and every console message it logged."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (`make deps` installs it)")
    out = subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


def test_the_html_report_renders_its_charts_and_decisions_in_headless_chromium_without_a_console_message(tmp_path):
    page = write_report(_run_dir(tmp_path), DECISIONS, tmp_path / "r.html")
    dom, console = _chromium_render(page, tmp_path)
    assert console == []
    assert re.search(r'<body[^>]*data-rendered="ok"', dom) and "data-error" not in dom
    charts = re.findall(r'<svg[^>]*class="chart"[^>]*data-key="([^"]+)"', dom)
    assert charts == ["actor/reward_kl_penalty", "critic/score/mean", "val-core/arith/reward/mean@1", "critic/vf_loss",
                      "actor/lr", "actor/reward_kl_penalty_coeff"]
    assert len(re.findall(r'<path d="M[^"]+" class="kept"', dom)) == len(charts)
    # steps 7-12 of the first stretch were abandoned on every chart but validation (logged on the re-run only)
    assert len(re.findall(r'<path d="M[^"]+" class="abandoned"', dom)) == len(charts) - 1
    assert len(re.findall(r'class="decision"', dom)) == len(charts)  # the rollback's line on every chart
    assert "step 12, kl_far: rolled back in process to step 6</li>" in dom


def test_the_chromium_check_sees_a_page_whose_script_fails(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><body><script>null.x;</script></body></html>")
    _, console = _chromium_render(page, tmp_path)
    assert console and "Uncaught TypeError" in console[0]


def test_report_refuses_a_run_without_metrics_and_an_unknown_format(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no metrics"):
        write_report(tmp_path / "empty", [], tmp_path / "r.png")
    with pytest.raises(ReportError, match=r"r.pdf: the report is .png or .html"):
        write_report(_run_dir(tmp_path), [], tmp_path / "r.pdf")


def test_report_command_writes_the_report_of_a_run_known_to_the_store(tmp_path):
    from typer.testing import CliRunner

    from ppo_watchdog.cli.run import run_app
    from ppo_watchdog.control.store import RunRecord, Store

    run = _run_dir(tmp_path)
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run)))
    store.add_decision("run", 12, "kl_far", "fire", [{"kind": "rollback"}], {"kl": 0.12})
    args = ["--state-dir", str(tmp_path / "state")]
    out = CliRunner().invoke(run_app, ["report", "run", "--out", str(tmp_path / "r.html"), *args])
    assert out.exit_code == 0, out.output
    assert "kl_far" in (tmp_path / "r.html").read_text()
    missing = CliRunner().invoke(run_app, ["report", "nope", "--out", str(tmp_path / "x.png"), *args])
    assert missing.exit_code == 2 and "no run 'nope'" in missing.output
    status = CliRunner().invoke(run_app, ["status", "--json", *args])
    assert status.exit_code == 0 and '"run": "run"' in status.output
