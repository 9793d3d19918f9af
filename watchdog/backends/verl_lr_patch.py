"""verl's learning-rate trap on resume, and the patched checkpoint copy that defuses it.

On resume verl's FSDP checkpoint manager loads, per rank and in this order, the
optimizer state (``optim_world_size_W_rank_R.pt``: its ``param_groups`` carry ``lr`` and
the scheduler's ``initial_lr``) and then the LambdaLR state from
``extra_state_world_size_W_rank_R.pt`` (``{'lr_scheduler': {'base_lrs', '_last_lr', ...},
'rng': ...}``). Both overwrite what the new config built, so a restart with a new
``actor_rollout_ref.actor.optim.lr`` trains on with the old one, silently: the first step
uses the checkpoint's ``param_groups`` lr, every later step ``base_lrs x lambda(step)``.

The zero-patch watchdog therefore never hands verl a checkpoint whose lr differs from the
one it asks for: it writes a copy of ``global_step_N`` in which every rank's optimizer and
scheduler state carry the new lr (the schedule position is kept: every lr-valued field is
scaled by new / old base lr) and resumes from that copy. Model shards and everything else
are hard links (copies across file systems), so the copy costs little disk.

Files are read with ``torch.load(weights_only=True)`` only. A file that cannot be read that
way (a sharded-tensor class outside the allowlist, an arbitrary pickle) makes the lr change
refused with :class:`LrPatchRefused` naming the file, never a silent resume at the old lr.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir

log = logging.getLogger(__name__)

#: verl's lr keys and the checkpoint component directory each one lives in.
LR_COMPONENTS: dict[str, str] = {
    "actor_rollout_ref.actor.optim.lr": "actor",
    "critic.optim.lr": "critic",
}
PATCH_RECORD = ".watchdog_lr_patch.json"
#: Relative tolerance under which a checkpoint's lr already is the one asked for.
LR_RTOL = 1e-9


class LrPatchRefused(rundir.PathError):
    """The lr of a checkpoint cannot be changed safely; names the file and why."""


def _scheduler(extra: Any, where: Path) -> dict[str, Any] | None:
    if not isinstance(extra, Mapping) or "lr_scheduler" not in extra:
        raise LrPatchRefused(where, "not verl's extra_state ({'lr_scheduler': ..., 'rng': ...})")
    sched = extra["lr_scheduler"]
    if sched is not None and not isinstance(sched, Mapping):
        raise LrPatchRefused(where, f"lr_scheduler is a {type(sched).__name__}, not a state dict")
    return dict(sched) if sched is not None else None


def _groups(optim: Any, where: Path) -> list[dict[str, Any]]:
    groups = optim.get("param_groups") if isinstance(optim, Mapping) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) and "lr" in g for g in groups):
        raise LrPatchRefused(where, "no optimizer param_groups with an 'lr'")
    return [dict(g) for g in groups]


def base_lr(optim: Any, extra: Any, where: Path) -> float:
    """The lr the checkpoint resumes with: the scheduler's first base lr, else the first group's lr."""
    sched = _scheduler(extra, where)
    if sched and sched.get("base_lrs"):
        return float(sched["base_lrs"][0])
    g = _groups(optim, where)[0]
    return float(g.get("initial_lr", g["lr"]))


def rescale(optim: Mapping[str, Any], extra: Mapping[str, Any], new_lr: float, where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optimizer and extra_state dicts with the base lr moved to ``new_lr`` (pure; inputs untouched).

    Every lr-valued field (``param_groups[i]['lr']`` and ``['initial_lr']``, the scheduler's
    ``base_lrs`` and ``_last_lr``) is multiplied by ``new_lr / old base lr``: the warm-up or
    decay position stays where it was, only its scale changes.
    """
    old = base_lr(optim, extra, where)
    if not old > 0:
        raise LrPatchRefused(where, f"the checkpoint's base lr is {old!r}: no scale to move from")
    scale = float(new_lr) / old
    groups = _groups(optim, where)
    for g in groups:
        g["lr"] = float(g["lr"]) * scale
        if "initial_lr" in g:
            g["initial_lr"] = float(g["initial_lr"]) * scale
    new_optim = {**optim, "param_groups": groups}
    sched = _scheduler(extra, where)
    if sched is not None:
        for key in ("base_lrs", "_last_lr"):
            if isinstance(sched.get(key), list):
                sched[key] = [float(v) * scale for v in sched[key]]
    return new_optim, {**extra, "lr_scheduler": sched}


def checkpoint_lrs(path: Path | str) -> dict[str, float]:
    """The base lr each lr key resumes with from a verl ``global_step_N`` (rank 0's files)."""
    path = Path(path)
    sizes = ckpt.verl_components(path)
    out: dict[str, float] = {}
    for key, comp in LR_COMPONENTS.items():
        if comp not in sizes:
            continue
        w = sizes[comp]
        o_path, e_path = ckpt.verl_file(path / comp, "optim", w, 0), ckpt.verl_file(path / comp, "extra_state", w, 0)
        out[key] = base_lr(_load(o_path), _load(e_path), o_path)
    return out


def _load(path: Path, mmap: bool = False) -> Any:
    try:
        return ckpt.load_verl_file(path, mmap=mmap)
    except ckpt.CheckpointError as exc:
        raise LrPatchRefused(path, exc.reason) from exc


def wanted_changes(path: Path | str, lrs: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """``{key: (checkpoint lr, wanted lr)}`` for the lr keys whose value the checkpoint would override."""
    have = checkpoint_lrs(path)
    out = {}
    for key, want in lrs.items():
        if key in have and abs(have[key] - float(want)) > LR_RTOL * max(abs(have[key]), abs(float(want))):
            out[key] = (have[key], float(want))
    return out


def patch_lr_copy(src: Path | str, dst_root: Path | str, lrs: Mapping[str, float]) -> Path:
    """Write ``dst_root/global_step_N``: ``src`` with every rank's optimizer and LambdaLR state
    carrying the lrs in ``lrs`` (verl keys); return its path.

    One rank at a time: a rank's optimizer and extra_state are loaded (the tensors memory-mapped
    from the file, not read in), rescaled, written to the copy and dropped before the next
    rank's are loaded, so the watchdog holds at most one rank's optimizer state at once, never
    the whole checkpoint's (:func:`patch_memory_bound`; for a 7B actor and critic on 8 GPUs
    that is one shard of about 7 GB, file-backed, instead of ~120 GB).

    Idempotent: a finished copy with the same source and lrs is reused. Built in a hidden
    temporary directory and renamed into place, so a crash leaves no half copy that verl
    could resume from. Raises :class:`LrPatchRefused` (nothing left behind) when a file cannot
    be loaded with ``weights_only=True`` or is not what verl writes.
    """
    src, dst_root = Path(src), Path(dst_root)
    unknown = sorted(set(lrs) - set(LR_COMPONENTS))
    if unknown:
        raise ValueError(f"not an lr key verl checkpoints: {', '.join(unknown)}")
    sizes = ckpt.verl_components(src)
    for key in lrs:
        if LR_COMPONENTS[key] not in sizes:
            raise LrPatchRefused(src, f"{key} is set but the checkpoint has no {LR_COMPONENTS[key]}/ directory")
    record = {"source": str(src.resolve()), "lrs": {k: float(v) for k, v in sorted(lrs.items())}}
    dst = dst_root / src.name
    if _same_record(dst, record):
        return dst
    rewritten = {str(ckpt.verl_file(Path(LR_COMPONENTS[key]), kind, sizes[LR_COMPONENTS[key]], rank))
                 for key in lrs for rank in range(sizes[LR_COMPONENTS[key]]) for kind in ("optim", "extra_state")}

    def write(tmp: Path) -> None:
        for key, lr in lrs.items():
            comp = LR_COMPONENTS[key]
            for rank in range(sizes[comp]):
                _patch_rank(src, tmp, comp, sizes[comp], rank, float(lr))

    ckpt.build_copy(src, dst_root, rewritten, write, PATCH_RECORD,
                    {**record, "files": sorted(rewritten), "ts": time.time()})
    log.info("wrote %s: %s with lr %s", dst, src, record["lrs"])
    return dst


def _patch_rank(src: Path, tmp: Path, comp: str, world_size: int, rank: int, lr: float) -> None:
    """Rescale one rank's optimizer and extra_state into ``tmp`` (everything it loaded is dropped on return)."""
    o_path = ckpt.verl_file(src / comp, "optim", world_size, rank)
    e_path = ckpt.verl_file(src / comp, "extra_state", world_size, rank)
    optim, extra = rescale(_load(o_path, mmap=True), _load(e_path), lr, o_path)
    ckpt.save_verl_file(tmp / o_path.relative_to(src), optim)
    ckpt.save_verl_file(tmp / e_path.relative_to(src), extra)


def patch_memory_bound(src: Path | str, lrs: Mapping[str, float]) -> int:
    """Bytes of optimizer state the patch holds at once, at most: the largest single rank's
    ``optim`` + ``extra_state`` files among those it rewrites (a file's tensors are what it loads)."""
    src = Path(src)
    sizes = ckpt.verl_components(src)
    largest = 0
    for key in lrs:
        comp = LR_COMPONENTS.get(key)
        if comp not in sizes:
            continue
        for rank in range(sizes[comp]):
            files = (ckpt.verl_file(src / comp, kind, sizes[comp], rank) for kind in ("optim", "extra_state"))
            largest = max(largest, sum(f.stat().st_size for f in files if f.is_file()))
    return largest


def _same_record(dst: Path, record: Mapping[str, Any]) -> bool:
    try:
        doc = json.loads((dst / PATCH_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("source") == record["source"] and doc.get("lrs") == record["lrs"]
