"""``skip_batches`` for verl: the resume checkpoint's dataloader state moved on by N batches.

verl has no key for skipping batches on resume. What it does have is the state of its training
dataloader in every checkpoint: ``global_step_N/data.pt`` is ``torch.save(train_dataloader.state_dict())``
of a torchdata ``StatefulDataLoader`` (verl 0.9.1: trainer/ppo/v1/trainer_base.py:997-999, and
ray_trainer.py:1030-1033 for the older trainer), loaded back with ``load_state_dict`` on resume
(trainer_base.py:892-896). Advancing that state by N batches makes the relaunched verl draw, as its
first batch, the one after the N it would have re-run: the batches that led to the divergence.

The state has two shapes (torchdata 0.11, stateful_dataloader.py):

- ``data.dataloader_num_workers=0``: the single-process iterator's dict. The batch sampler verl builds
  (torchdata's ``BatchSampler`` over ``create_rl_sampler``'s ``SequentialSampler``, or torchdata's
  ``RandomSampler`` when ``data.shuffle``) restores from ``_sampler_iter_state``: ``samples_yielded``
  (a sequential sampler is fast-forwarded by it) and, for the random sampler, ``sampler_iter_state``
  ``{'yielded', 'generator'}`` (the epoch's permutation is rebuilt from the generator state and
  ``yielded`` of it skipped). The patch adds N batches to each of these counters and to
  ``_sampler_iter_yielded`` / ``_num_yielded``.
- ``num_workers>0`` (verl's default is 8): ``{'_snapshot', '_steps_since_snapshot', ...}``; on load
  torchdata draws ``_steps_since_snapshot`` batches after restoring the snapshot, so the patch adds N there.

A skip past the end of the epoch would make verl's first ``iter()`` raise StopIteration twice
(torchdata keeps the state it failed to restore) and end the run, so the skip stops at the epoch's
end: the glue learns the epoch's length from verl's own ``dataset len`` lines (:func:`epoch_batches`)
and refuses the skip when it cannot.

``data.pt`` is read with ``torch.load(weights_only=True)`` (it holds ints, None and the generator's
uint8 tensor); a file that needs more, or a dict not of these shapes, is refused naming the file
and the verl version, never guessed at. The patched state goes into a copy of the checkpoint
(everything else hard-linked, the copy renamed into place), so the known-good checkpoint itself,
which a later rollback may need again, is never written to.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir

log = logging.getLogger(__name__)

#: The verl (and torchdata) this state format was read from.
TESTED = "verl 0.9.1 (torchdata 0.11.0)"
PATCH_RECORD = ".watchdog_skip_patch.json"
#: The single-process iterator's keys (torchdata's _StatefulSingleProcessDataLoaderIter.state_dict).
SINGLE_KEYS = frozenset({"_index_sampler_state", "_sampler_iter_state", "_sampler_iter_yielded", "_num_yielded",
                         "_IterableDataset_len_called", "_shared_seed", "fetcher_state", "dataset_state",
                         "_iterator_finished"})
#: The worker-process iterator's keys (_StatefulMultiProcessingDataLoaderIter.state_dict).
MULTI_KEYS = frozenset({"_snapshot", "_steps_since_snapshot", "_iterator_finished"})
#: verl prints these while building its train dataset (verl/utils/dataset/rl_dataset.py): the size read,
#: the size after ``data.train_max_samples``, the size after ``filter_overlong_prompts``.
_LEN_LINE = re.compile(r"(?:(filter )?dataset len: (\d+)|selected (\d+) random samples out of \d+)")


class SkipRefused(rundir.PathError):
    """The dataloader state of a checkpoint cannot be moved on safely; names the file and why."""


def _verl_version() -> str:
    try:
        from importlib.metadata import version

        return f"verl {version('verl')}"
    except Exception:  # verl need not be installed beside the watchdog
        return "verl (not installed here)"


def _refuse(where: Path, why: str) -> SkipRefused:
    return SkipRefused(where, f"{why}: not the StatefulDataLoader state {TESTED} saves "
                              f"(this machine has {_verl_version()}); the batches are not skipped")


def _int(d: Mapping[str, Any], key: str, where: Path) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _refuse(where, f"{key} is {v!r}, not a count")
    return v


@dataclass(frozen=True)
class Skip:
    """What a skip did: batches drawn before it, the batches asked for and those skipped."""

    drawn: int
    """Batches verl had drawn in the current epoch when it saved (``_num_yielded``)."""
    asked: int
    """Batches the rule asked to skip (``skip_batches``)."""
    done: int
    """Batches skipped: ``asked``, or fewer where the epoch ends."""
    batch_size: int | None = None
    """Samples a batch (single-process state only: ``samples_yielded / _num_yielded``)."""

    def text(self) -> str:
        """The journal's words for it."""
        capped = f" of {self.asked} asked (the epoch ends there)" if self.done < self.asked else ""
        return (f"skipped {self.done} batch{'es' if self.done != 1 else ''}{capped}: verl's dataloader state "
                f"in data.pt moved from {self.drawn} to {self.drawn + self.done} batches drawn")


def skip_state(state: Any, n: int, epoch_batches: int, where: Path) -> tuple[dict[str, Any], Skip]:
    """``state`` (a ``StatefulDataLoader.state_dict()``) moved on by ``n`` batches, at most to the end
    of an epoch of ``epoch_batches`` batches; pure (``state`` is untouched)."""
    if n < 1:
        raise ValueError(f"skip n must be >= 1, got {n}")
    if not isinstance(state, Mapping):
        raise _refuse(where, f"a {type(state).__name__}, not a dict")
    keys = set(state)
    if keys == MULTI_KEYS:
        return _skip_multi(state, n, epoch_batches, where)
    if keys != SINGLE_KEYS:
        raise _refuse(where, f"keys {sorted(keys)}")
    new = copy.deepcopy(dict(state))
    drawn = _int(new, "_num_yielded", where)
    if _int(new, "_sampler_iter_yielded", where) != drawn:
        raise _refuse(where, f"_sampler_iter_yielded {new['_sampler_iter_yielded']} != _num_yielded {drawn}")
    if new["_index_sampler_state"] is not None or new["fetcher_state"] is not None:
        raise _refuse(where, "a stateful batch sampler or an iterable dataset (verl builds neither)")
    it = new["_sampler_iter_state"]
    if not isinstance(it, dict) or not set(it) <= {"samples_yielded", "sampler_iter_state"}:
        raise _refuse(where, f"_sampler_iter_state is {it!r}")
    samples = _int(it, "samples_yielded", where)
    if drawn == 0 or samples % drawn:
        raise _refuse(where, f"{samples} samples in {drawn} batches: no batch size to skip by")
    batch = samples // drawn
    done = min(n, max(0, epoch_batches - drawn))
    if done:
        new["_num_yielded"] = new["_sampler_iter_yielded"] = drawn + done
        it["samples_yielded"] = samples + done * batch
        inner = it.get("sampler_iter_state")
        if inner is not None:  # torchdata's RandomSampler: the epoch's permutation is re-drawn, `yielded` skipped
            if not isinstance(inner, dict) or set(inner) != {"yielded", "generator"} \
                    or _int(inner, "yielded", where) != samples:
                raise _refuse(where, f"sampler_iter_state is {inner!r}")
            inner["yielded"] = samples + done * batch
    return new, Skip(drawn, n, done, batch)


def _skip_multi(state: Mapping[str, Any], n: int, epoch_batches: int, where: Path) -> tuple[dict[str, Any], Skip]:
    new = copy.deepcopy(dict(state))
    snap = new["_snapshot"]
    if not isinstance(snap, dict) or "_snapshot_step" not in snap:
        raise _refuse(where, f"_snapshot is {type(snap).__name__} without _snapshot_step")
    since = _int(new, "_steps_since_snapshot", where)
    drawn = _int(snap, "_snapshot_step", where) + since
    done = min(n, max(0, epoch_batches - drawn))
    new["_steps_since_snapshot"] = since + done  # torchdata draws these batches on load, after the snapshot
    return new, Skip(drawn, n, done)


def epoch_batches(log_text: str, batch_size: int) -> int | None:
    """Batches in one epoch of verl's train dataloader (``drop_last``) from its console log, or None.

    verl prints ``dataset len: N`` for the train set and then the validation set, with
    ``selected K random samples ...`` and ``filter dataset len: M`` after each where they apply: the
    train set's size is the last of these before the second plain ``dataset len``. The last launch's
    lines are used (the log holds every attempt's)."""
    if batch_size < 1:
        return None
    sizes: list[int] = []  # one per dataset built, in order: train, validation, train, validation, ...
    for m in _LEN_LINE.finditer(log_text):
        filtered, size, selected = m.group(1), m.group(2), m.group(3)
        if size is not None and not filtered:
            sizes.append(int(size))
        elif sizes:  # the dataset being built shrank (max samples, overlong prompts)
            sizes[-1] = int(size if size is not None else selected)
    if not sizes:
        return None
    return (sizes[-2] if len(sizes) % 2 == 0 else sizes[-1]) // batch_size


def patch_skip_copy(src: Path | str, dst_root: Path | str, n: int, epoch_len: int) -> tuple[Path, Skip]:
    """Write ``dst_root/global_step_N``: ``src`` with ``data.pt`` moved on by ``n`` batches (at most to the
    epoch's end); return its path and what was skipped. Every other file is a hard link (a copy across
    file systems); ``src`` is only read. Built in a hidden directory and renamed into place; raises
    :class:`SkipRefused` (nothing left behind) when ``data.pt`` is not what verl saves."""
    src, dst_root = Path(src), Path(dst_root)
    data = src / ckpt.VERL_DATA_FILE
    try:
        state = ckpt.load_verl_file(data)
    except ckpt.CheckpointError as exc:
        raise SkipRefused(data, exc.reason) from exc
    new, skip = skip_state(state, n, epoch_len, data)
    # A new file under the copy's own name: the source's data.pt (and its inode) is never opened for writing.
    dst = ckpt.build_copy(src, dst_root, [ckpt.VERL_DATA_FILE],
                          lambda tmp: ckpt.save_verl_file(tmp / ckpt.VERL_DATA_FILE, new), PATCH_RECORD,
                          {"source": str(src.resolve()), "asked": n, "done": skip.done, "drawn": skip.drawn,
                           "ts": time.time()})
    log.info("wrote %s: %s with %s", dst, src, skip.text())
    return dst, skip


def read_record(path: Path | str) -> dict[str, Any] | None:
    """The skip record of a patched copy (None when ``path`` is not one)."""
    try:
        doc = json.loads((Path(path) / PATCH_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
