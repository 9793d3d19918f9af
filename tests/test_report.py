"""The run report: PNG and self-contained HTML from a real run directory's files."""

from __future__ import annotations

import base64
import re
import struct

import pytest

from ppo_watchdog.observe.report import ReportError, rollback_spans, segments, write_report
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
    rundir.append_metrics(run, 9, {"val-core/reward/mean@1": 0.5})  # validation on its own line
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
                                "val-core/reward/mean@1": 0.5}


def test_rollback_spans_run_from_the_step_restored_to_the_step_left():
    assert rollback_spans([{"kind": "rollback", "from_step": 12, "to_step": 6}, {"kind": "oom"}]) == [(6, 12)]


def test_png_report_is_a_real_png_image(tmp_path):
    out = write_report(_run_dir(tmp_path), DECISIONS, tmp_path / "r.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 800  # five stacked panels


def test_html_report_is_self_contained_with_the_figure_and_every_decision(tmp_path):
    out = write_report(_run_dir(tmp_path), DECISIONS, tmp_path / "r.html")
    text = out.read_text()
    png = re.search(r'src="data:image/png;base64,([^"]+)"', text).group(1)
    assert base64.b64decode(png)[:4] == b"\x89PNG"
    assert not re.search(r'(src|href)="https?:', text)  # nothing fetched from elsewhere
    assert "kl_far" in text and "rolled back in process to step 6" in text and "&quot;kl&quot;: 0.12" in text


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
