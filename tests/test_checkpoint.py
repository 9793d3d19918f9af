"""Checkpoints: atomic, checksummed, never loaded when torn or corrupt, verl's marker, pruning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ppo_watchdog.protocol import checkpoint as ck
from ppo_watchdog.protocol import rundir

torch.set_num_threads(1)


def _components(seed: int = 0) -> dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return {"actor": {"model": model.state_dict(), "optimizer": opt.state_dict()}, "critic": {"w": torch.randn(5, generator=g)}}


def _save(root: Path, step: int, **kw) -> Path:
    return ck.save_checkpoint(root, step, epoch=step // 10, components=_components(step), extra={"seen": step, "rng": torch.get_rng_state()}, **kw)


def test_save_writes_verls_layout_with_manifest_and_marker(tmp_path: Path) -> None:
    path = _save(tmp_path, 40)
    assert path == tmp_path / "global_step_40"
    assert (path / "actor" / "state.pt").is_file() and (path / "critic" / "state.pt").is_file()
    assert (path / "extra.pt").is_file()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["step"] == 40 and manifest["epoch"] == 4
    assert set(manifest["files"]) == {"actor/state.pt", "critic/state.pt", "extra.pt"}
    import hashlib

    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((path / rel).read_bytes()).hexdigest() == digest
    assert (tmp_path / rundir.LATEST_MARKER).read_text().strip() == "40"
    assert ck.read_marker(tmp_path) == 40
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_returns_exactly_what_was_saved(tmp_path: Path) -> None:
    comps = _components(3)
    path = ck.save_checkpoint(tmp_path, 7, 1, comps, extra={"kl": 0.001, "order": [3, 1, 2]})
    loaded, extra = ck.load_checkpoint(path)
    assert extra == {"kl": 0.001, "order": [3, 1, 2]}
    assert torch.equal(loaded["actor"]["model"]["weight"], comps["actor"]["model"]["weight"])
    assert torch.equal(loaded["critic"]["w"], comps["critic"]["w"])
    exp_state = comps["actor"]["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["actor"]["optimizer"]["state"][0]["exp_avg"], exp_state)
    info = ck.verify_checkpoint(path)
    assert (info.step, info.epoch, info.complete) == (7, 1, True)


def test_a_flipped_byte_is_never_loaded_and_the_error_names_the_file(tmp_path: Path) -> None:
    path = _save(tmp_path, 10)
    target = path / "actor" / "state.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(path)
    assert str(target) in str(err.value) and "checksum mismatch" in err.value.reason
    with pytest.raises(ck.CheckpointError):
        ck.verify_checkpoint(path)
    assert ck.latest_complete(tmp_path) is None


def test_a_truncated_file_is_never_loaded(tmp_path: Path) -> None:
    path = _save(tmp_path, 10)
    target = path / "extra.pt"
    target.write_bytes(target.read_bytes()[:20])
    with pytest.raises(ck.CheckpointError, match="extra.pt: checksum mismatch"):
        ck.load_checkpoint(path)


def test_a_missing_manifest_means_incomplete(tmp_path: Path) -> None:
    path = _save(tmp_path, 10)
    (path / "manifest.json").unlink()
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(path)
    assert err.value.path == str(path) and "no manifest.json" in err.value.reason
    [info] = ck.list_checkpoints(tmp_path)
    assert info.complete is False and info.step == 10 and "manifest" in info.reason


def test_a_missing_state_file_or_a_manifest_saying_incomplete_is_refused(tmp_path: Path) -> None:
    a = _save(tmp_path, 10)
    (a / "critic" / "state.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="missing"):
        ck.verify_checkpoint(a)
    b = _save(tmp_path, 20)
    doc = json.loads((b / "manifest.json").read_text())
    doc["complete"] = False
    (b / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ck.CheckpointError, match="complete=False"):
        ck.load_checkpoint(b)
    c = _save(tmp_path, 30)
    (c / "manifest.json").write_text('{"step": 30, "epo')
    with pytest.raises(ck.CheckpointError, match="not JSON .line 1, column"):
        ck.verify_checkpoint(c)


def test_a_manifest_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 10)
    (tmp_path / "evil.pt").write_bytes(b"x")
    doc = json.loads((path / "manifest.json").read_text())
    import hashlib

    doc["files"]["../evil.pt"] = hashlib.sha256(b"x").hexdigest()
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ck.CheckpointError, match="outside"):
        ck.load_checkpoint(path)


def test_a_save_killed_midway_leaves_no_visible_checkpoint(tmp_path: Path) -> None:
    """A real process is SIGKILLed (os._exit) after writing part of a checkpoint."""
    root = tmp_path / "ckpt"
    _save(root, 5)
    script = textwrap.dedent(
        f"""
        import os, torch
        from ppo_watchdog.protocol import checkpoint as ck
        real = ck._write_file
        calls = []
        def dying(path, data):
            calls.append(path)
            if len(calls) == 2:
                real(path, data[: len(data) // 2])
                os._exit(9)  # die mid-file: no cleanup handlers run
            real(path, data)
        ck._write_file = dying
        ck.save_checkpoint({str(root)!r}, 10, 1, {{"actor": {{"w": torch.ones(1000)}}, "critic": {{"w": torch.zeros(1000)}}}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr.decode()
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the killed writer should have left its temp directory behind"
    assert [c.step for c in ck.list_checkpoints(root)] == [5]
    assert ck.latest_complete(root).step == 5  # type: ignore[union-attr]
    assert ck.read_marker(root) == 5
    _save(root, 15)  # the next save sweeps the dead writer's temp directory
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_list_includes_incomplete_ones_sorted_by_step(tmp_path: Path) -> None:
    for s in (30, 10, 20):
        _save(tmp_path, s)
    (tmp_path / "global_step_25" / "actor").mkdir(parents=True)  # a torn directory, e.g. copied by hand
    (tmp_path / "not_a_checkpoint").mkdir()
    infos = ck.list_checkpoints(tmp_path)
    assert [(c.step, c.complete) for c in infos] == [(10, True), (20, True), (25, False), (30, True)]
    assert ck.latest_complete(tmp_path).step == 30  # type: ignore[union-attr]


def test_latest_complete_skips_a_corrupt_newest(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    (newest / "critic" / "state.pt").write_bytes(b"garbage")
    assert ck.latest_complete(tmp_path).step == 10  # type: ignore[union-attr]


def test_rollback_skips_checkpoints_taken_while_diverging(tmp_path: Path) -> None:
    for s in (5, 10, 15, 20):
        _save(tmp_path, s)
    diverging = set(range(13, 21))  # a divergence rule fired from step 13 on
    assert ck.last_known_good(tmp_path, diverging).step == 10  # type: ignore[union-attr]
    assert ck.last_known_good(tmp_path, lambda s: s >= 13).step == 10  # type: ignore[union-attr]
    assert ck.last_known_good(tmp_path, set()).step == 20  # type: ignore[union-attr]
    assert ck.last_known_good(tmp_path, lambda s: True) is None


def test_rollback_target_must_also_verify(tmp_path: Path) -> None:
    for s in (5, 10, 15):
        _save(tmp_path, s)
    (tmp_path / "global_step_10" / "extra.pt").write_bytes(b"\0")
    assert ck.last_known_good(tmp_path, {15}).step == 5  # type: ignore[union-attr]


def test_keep_prunes_to_the_newest_complete_ones(tmp_path: Path) -> None:
    for s in (5, 10, 15, 20):
        _save(tmp_path, s, keep=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [15, 20]
    _save(tmp_path, 25, keep=2, protect={15})
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [15, 20, 25]
    with pytest.raises(ValueError, match="keep"):
        _save(tmp_path, 30, keep=0)


def test_resaving_a_step_replaces_it_whole(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    ck.save_checkpoint(tmp_path, 10, 9, {"actor": {"w": torch.full((2,), 7.0)}})
    comps, extra = ck.load_checkpoint(tmp_path / "global_step_10")
    assert list(comps) == ["actor"] and extra == {} and torch.equal(comps["actor"]["w"], torch.full((2,), 7.0))
    assert ck.verify_checkpoint(tmp_path / "global_step_10").epoch == 9


def test_discard_newer_forgets_the_abandoned_timeline(tmp_path: Path) -> None:
    for s in (5, 10, 15):
        _save(tmp_path, s)
    removed = ck.discard_newer(tmp_path, 5)
    assert sorted(p.name for p in removed) == ["global_step_10", "global_step_15"]
    assert ck.read_marker(tmp_path) == 5 and ck.latest_complete(tmp_path).step == 5  # type: ignore[union-attr]


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    """weights_only=True: a state file that would run code on load is refused, even with a valid checksum."""
    path = _save(tmp_path, 1)
    target = path / "actor" / "state.pt"
    torch.save({"evil": os.system}, target)  # noqa: S102 -- a function reference is what weights_only rejects
    import hashlib

    doc = json.loads((path / "manifest.json").read_text())
    doc["files"]["actor/state.pt"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ck.CheckpointError, match="cannot deserialise"):
        ck.load_checkpoint(path)
