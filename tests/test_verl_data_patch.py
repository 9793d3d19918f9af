"""``skip_batches`` for verl: the dataloader state in a checkpoint's data.pt moved on (fast, CPU).

The fixtures are real: torchdata's ``StatefulDataLoader`` over the samplers verl 0.9.1's
``create_rl_sampler`` builds (trainer/ppo/utils.py: torchdata's ``RandomSampler`` with a seeded
generator under ``data.shuffle``, else torch's ``SequentialSampler``), ``drop_last=True`` as verl's
trainer sets it, its ``state_dict()`` saved with ``torch.save`` as verl saves ``data.pt``, and
resumed the way verl resumes (``load_state_dict``, then ``iter``/``next``, a StopIteration answered
by one more ``iter``: trainer/ppo/v1/trainer_base.py, _fetch_one_gen_batch).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torch.utils.data import SequentialSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

from ppo_watchdog.backends import zero_patch as verl_mode  # noqa: E402
from ppo_watchdog.backends.verl_data_patch import (  # noqa: E402
    SkipRefused,
    epoch_batches,
    patch_skip_copy,
    read_record,
)
from ppo_watchdog.protocol import checkpoint as ckpt  # noqa: E402

ROWS, BATCH = 40, 4  # 10 batches an epoch


def _loader(shuffle: bool, workers: int = 0) -> StatefulDataLoader:
    """verl's train dataloader, as trainer_base.py:743-750 builds it over create_rl_sampler's sampler."""
    data = list(range(ROWS))
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7)) if shuffle else SequentialSampler(data)
    return StatefulDataLoader(data, batch_size=BATCH, drop_last=True, sampler=sampler, num_workers=workers)


def _fetch(loader: StatefulDataLoader, it: list) -> list[int]:
    """verl's _fetch_one_gen_batch: a StopIteration (the epoch's end) starts the next epoch."""
    try:
        if not it:
            it.append(iter(loader))
        return next(it[0]).tolist()
    except StopIteration:
        it[:] = [iter(loader)]
        return next(it[0]).tolist()


def _checkpoint(root: Path, step: int, shuffle: bool, workers: int = 0) -> tuple[Path, list[list[int]]]:
    """A ``global_step_N`` whose data.pt is the loader's state after ``step`` batches, with the batches an
    uninterrupted run draws (two epochs' worth)."""
    full, it = _loader(shuffle, workers), []
    batches = [_fetch(full, it) for _ in range(2 * ROWS // BATCH)]
    loader, it = _loader(shuffle, workers), []
    for _ in range(step):
        _fetch(loader, it)
    d = ckpt.step_dir(root, step)
    (d / "actor").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, ckpt.verl_file(d / "actor", "model", 1, 0))
    torch.save(loader.state_dict(), d / ckpt.VERL_DATA_FILE)
    return d, batches


def _resumed(path: Path, shuffle: bool, n: int, workers: int = 0) -> list[list[int]]:
    """The first ``n`` batches verl draws after resuming from ``path``."""
    loader, it = _loader(shuffle, workers), []
    loader.load_state_dict(torch.load(path / ckpt.VERL_DATA_FILE, weights_only=True))
    return [_fetch(loader, it) for _ in range(n)]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_a_skipped_copy_resumes_on_the_batch_after_the_skipped_ones_and_the_checkpoint_is_untouched(
        tmp_path: Path, shuffle: bool) -> None:
    src, batches = _checkpoint(tmp_path / "ck", 3, shuffle)
    before = _digest(src / "data.pt")
    assert _resumed(src, shuffle, 1) == [batches[3]]  # unpatched: verl re-runs the 4th batch
    dst, skip = patch_skip_copy(src, tmp_path / "resume", 2, epoch_len=ROWS // BATCH)
    assert (skip.drawn, skip.done) == (3, 2) and "skipped 2 batches" in skip.text()
    assert _resumed(dst, shuffle, 3) == batches[5:8]
    # The known-good checkpoint is as it was (a later rollback may need it again); the model is shared.
    assert _digest(src / "data.pt") == before and _resumed(src, shuffle, 1) == [batches[3]]
    assert (dst / "actor" / "model_world_size_1_rank_0.pt").stat().st_ino == \
        (src / "actor" / "model_world_size_1_rank_0.pt").stat().st_ino
    assert (dst / "data.pt").stat().st_ino != (src / "data.pt").stat().st_ino
    assert read_record(dst)["done"] == 2 and not list((tmp_path / "resume").glob(".tmp-*"))


def test_a_loader_with_worker_processes_skips_by_the_batches_it_draws_after_its_snapshot(tmp_path: Path) -> None:
    # verl's default data.dataloader_num_workers is 8: torchdata's multi-process state has another shape.
    src, batches = _checkpoint(tmp_path / "ck", 3, True, workers=1)
    dst, skip = patch_skip_copy(src, tmp_path / "resume", 1, epoch_len=ROWS // BATCH)
    assert skip.done == 1 and _resumed(dst, True, 2, workers=1) == batches[4:6]


def test_a_skip_past_the_epochs_end_stops_there_and_verl_goes_on_into_the_next_epoch(tmp_path: Path) -> None:
    # Unbounded, torchdata raises StopIteration at every iter() of the resumed loader: verl's run would end.
    src, batches = _checkpoint(tmp_path / "ck", 8, False)
    dst, skip = patch_skip_copy(src, tmp_path / "resume", 5, epoch_len=ROWS // BATCH)
    assert (skip.done, skip.asked) == (2, 5) and "of 5 asked (the epoch ends there)" in skip.text()
    assert _resumed(dst, False, 2) == batches[10:12]


def test_a_data_pt_that_needs_more_than_weights_only_is_refused_naming_the_file(tmp_path: Path) -> None:
    src, _ = _checkpoint(tmp_path / "ck", 2, False)
    with open(src / "data.pt", "wb") as f:
        pickle.dump({"_num_yielded": 2, "sampler": SkipRefused}, f)  # a class: no weights-only load reads it
    with pytest.raises(SkipRefused, match="data.pt.*weights_only=True"):
        patch_skip_copy(src, tmp_path / "resume", 1, epoch_len=10)
    assert not (tmp_path / "resume" / src.name).exists()


def test_a_dataloader_state_of_another_shape_is_refused_naming_the_verl_version(tmp_path: Path) -> None:
    src, _ = _checkpoint(tmp_path / "ck", 2, False)
    torch.save({"dataloader": {"step": 2}}, src / "data.pt")
    with pytest.raises(SkipRefused, match=r"data\.pt: keys \['dataloader'\]: not the StatefulDataLoader state "
                                          r"verl 0\.9\.1"):
        patch_skip_copy(src, tmp_path / "resume", 1, epoch_len=10)
    assert not (tmp_path / "resume" / src.name).exists()


VERL_START = """\
(TaskRunnerV1 pid=9749) dataset len: 7473
(TaskRunnerV1 pid=9749) selected 1000 random samples out of 7473
(TaskRunnerV1 pid=9749) filter dataset len: 998
(TaskRunnerV1 pid=9749) dataset len: 1319
(TaskRunnerV1 pid=9749) filter dataset len: 1300
"""


def test_the_epochs_length_is_read_from_verls_dataset_lines_of_the_last_launch() -> None:
    assert epoch_batches(VERL_START, 256) == 998 // 256
    assert epoch_batches(VERL_START + VERL_START.replace("998", "512"), 256) == 2
    assert epoch_batches("(TaskRunnerV1 pid=1) dataset len: 256\n", 4) == 64  # the validation set not built yet
    assert epoch_batches("no such line", 4) is None


def _glue(tmp_path: Path, log: str) -> verl_mode.VerlGlue:
    run = tmp_path / "run"
    verl_mode.init_run(run, ["python3", "-m", "verl.trainer.main_ppo", f"data.train_batch_size={BATCH}"])
    (run / verl_mode.LOG_NAME).write_text(log)
    glue = verl_mode.dialect_for(run, "run")
    assert isinstance(glue, verl_mode.VerlGlue)
    return glue


def test_a_zero_patch_rollback_with_skip_batches_resumes_from_a_copy_that_skips_them(tmp_path: Path) -> None:
    src, batches = _checkpoint(tmp_path / "run" / "checkpoints", 3, False)
    glue = _glue(tmp_path, f"(TaskRunnerV1 pid=1) dataset len: {ROWS}\n(TaskRunnerV1 pid=1) dataset len: 8\n")
    p = glue.plan_resume({"resume": "path", "resume_path": str(src), "resume_step": 3, "skip_batches": 1}, {})
    assert p["checkpoint_path"] == str(src) and p["skip_done"] == 1 and "skipped 1 batch:" in p["skip_patch"]
    assert Path(p["resume_path"]).name == "global_step_3" and _resumed(Path(p["resume_path"]), False, 1) == [batches[4]]
    json.dumps(p)  # the journal stores it
    # A restart that does not rewind (a tuning relaunch from the latest checkpoint) skips nothing.
    q = glue.plan_resume({"resume": "latest", "resume_path": str(src), "skip_batches": 1}, {})
    assert q["resume_path"] == str(src) and "skip_patch" not in q


def test_a_skip_whose_epoch_length_verl_never_printed_is_not_done_and_the_journal_says_why(tmp_path: Path) -> None:
    src, _ = _checkpoint(tmp_path / "run" / "checkpoints", 3, False)
    glue = _glue(tmp_path, "")
    p = glue.plan_resume({"resume": "path", "resume_path": str(src), "resume_step": 3, "skip_batches": 1}, {})
    assert p["resume_path"] == str(src) and "skip_batches=1 not done: the epoch's length is unknown" in p["skip_note"]
