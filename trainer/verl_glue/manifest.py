"""A manifest for verl's own ``global_step_N`` directories, so they count as protocol checkpoints.

The watchdog trusts a checkpoint only when its ``manifest.json`` says complete and every
checksum matches (:func:`watchdog.protocol.checkpoint.verify_checkpoint`); that is what lets it
restart or roll back from ``run_dir/checkpoints``. verl writes no manifest, so after
verl's save has returned (every rank's files written, its marker updated) the glue hashes
the directory and writes one, last and atomically, in the embedded trainer's format plus
``"layout": "verl"``. A save that died midway never gets one, so it never counts.

Files are hashed in chunks: verl's per-rank shards can be gigabytes.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from watchdog.protocol import checkpoint as ckpt
from watchdog.protocol import rundir

CHUNK = 1 << 22


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def write_manifest(step_dir: Path | str, step: int, epoch: int) -> Path:
    """Hash every file under a finished verl ``global_step_N`` and write its manifest.json."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise ckpt.CheckpointError(step_dir, "not a directory (verl's save wrote nothing here)")
    files = {p.relative_to(step_dir).as_posix(): _sha256_file(p)
             for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != ckpt.MANIFEST}
    if not files:
        raise ckpt.CheckpointError(step_dir, "no files to vouch for")
    manifest = {"format": ckpt.MANIFEST_FORMAT, "step": int(step), "epoch": int(epoch), "ts": time.time(),
                "files": files, "complete": True, "layout": "verl"}
    path = step_dir / ckpt.MANIFEST
    rundir.atomic_write_json(path, manifest)
    return path
