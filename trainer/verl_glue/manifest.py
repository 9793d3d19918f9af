"""A manifest for verl's own ``global_step_N`` directories, so they count as protocol checkpoints.

The watchdog trusts a checkpoint only when its ``manifest.json`` says complete and every
checksum matches (:func:`ppo_watchdog.protocol.checkpoint.verify_checkpoint`); that is what lets it
restart or roll back from ``run_dir/checkpoints``. verl writes no manifest, so after
verl's save has returned (every rank's files written, its marker updated) the glue hashes
the directory and writes one, last and atomically, in the embedded trainer's format plus
``"layout": "verl"``. A save that died midway never gets one, so it never counts.

Files are hashed in chunks (verl's per-rank shards can be gigabytes), several at once
(``hashlib`` lets go of the GIL while it hashes a chunk), and off the training step:
:class:`ManifestWriter` hashes in a background thread, so a 7B save costs verl's step
timer (``perf/time_per_step``, throughput) only verl's own save; the checkpoint counts
once its manifest is written, not before.

Multi-node runs: the glue runs in the TaskRunner, on one node, and sees only the files on
that node's disks. Before hashing, the directory is checked for every rank's files
(:func:`ppo_watchdog.protocol.checkpoint.verl_checkpoint_info`); a run whose nodes save to local
disks gets no manifest (an ``error`` event says why) rather than one that vouches for the
head node's shards alone: put ``trainer.default_local_dir`` on a shared file system.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir

log = logging.getLogger(__name__)

CHUNK = 1 << 22
#: Files hashed at once: enough to keep a parallel file system busy, few enough for the TaskRunner's node.
HASH_WORKERS = max(1, min(8, os.cpu_count() or 1))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def write_manifest(step_dir: Path | str, step: int, epoch: int, world_size: int | None = None,
                   components: tuple[str, ...] = (), workers: int = HASH_WORKERS, layout: str = "verl") -> Path:
    """Hash every file under a finished verl ``global_step_N`` (``workers`` at once) and write its
    manifest.json (``layout`` names whose folder it is: verl's, or TRL's for ppo_watchdog.trainer.trl_glue). With
    ``world_size``, first check that every rank's files of ``components``
    (actor always) are there: on a multi-node run with node-local disks they are not."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise ckpt.CheckpointError(step_dir, "not a directory (verl's save wrote nothing here)")
    if world_size is not None:
        info = ckpt.verl_checkpoint_info(step_dir, int(step), world_size, components or ("actor",))
        if not info.complete:
            raise ckpt.CheckpointError(step_dir, f"{info.reason} (a multi-node run needs trainer.default_local_dir "
                                                 "on a file system every node shares)")
    paths = [p for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != ckpt.MANIFEST]
    if not paths:
        raise ckpt.CheckpointError(step_dir, "no files to vouch for")
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sha256") as pool:
        digests = list(pool.map(_sha256_file, paths))
    files = {p.relative_to(step_dir).as_posix(): d for p, d in zip(paths, digests, strict=True)}
    manifest = {"format": ckpt.MANIFEST_FORMAT, "step": int(step), "epoch": int(epoch), "ts": time.time(),
                "files": files, "complete": True, "layout": layout}
    path = step_dir / ckpt.MANIFEST
    rundir.atomic_write_json(path, manifest)
    return path


class ManifestWriter:
    """Writes manifests in one background thread, in save order, off verl's training step.

    ``submit`` returns at once; ``done(path, error)`` is called from the writer's thread when the
    manifest is written (``error`` None) or refused. :meth:`wait` before the process ends (a
    ``stop`` saves last), so no save goes unvouched.
    """

    def __init__(self, hash_workers: int = HASH_WORKERS) -> None:
        self.hash_workers = hash_workers
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")
        self._pending: list[Future[None]] = []

    def submit(self, step_dir: Path | str, step: int, epoch: int, done: Callable[[Path, Exception | None], None],
               world_size: int | None = None, components: tuple[str, ...] = ()) -> Future[None]:
        """Queue one manifest; returns its future."""
        def job() -> None:
            t0 = time.monotonic()
            try:
                write_manifest(step_dir, step, epoch, world_size, components, self.hash_workers)
            except (OSError, ValueError) as exc:  # CheckpointError is an OSError
                done(Path(step_dir), exc)
                return
            log.info("manifest of %s written in %.1fs (off the training step)", step_dir, time.monotonic() - t0)
            done(Path(step_dir), None)

        fut = self._pool.submit(job)
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every queued manifest; False when some are still being written at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in list(self._pending):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except TimeoutError:
                return False
        self._pending = []
        return True

    def close(self) -> None:
        """Wait for what is queued, then stop the thread."""
        self.wait()
        self._pool.shutdown(wait=True)
