"""Checkpoints in verl's layout that count only when complete and intact.

::

    root/
      global_step_40/
        actor/state.pt          one file per component (torch.save of a state dict)
        critic/state.pt
        extra.pt                anything else (data-loader position, RNG, KL controller, ...)
        manifest.json           {step, epoch, ts, complete: true, files: {relpath: sha256}}  -- written LAST
      latest_checkpointed_iteration.txt   verl's marker: the newest step, as text

A checkpoint is built in a hidden temporary directory beside its final place and
renamed into place only after every file and the manifest are written and fsynced,
so a crash mid-save leaves a ``.tmp-*`` directory that no reader lists, never a
half-written ``global_step_N``. Readers still trust nothing: :func:`verify_checkpoint`
re-hashes every file against the manifest, and :func:`load_checkpoint` hashes the very
bytes it deserialises, so a file changed between verify and load is caught too.

Generic over state dicts: this module knows nothing about models.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import inputs, rundir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
EXTRA_FILE = "extra.pt"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp-global_step_"
_TRASH_PREFIX = ".trash-global_step_"
_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointError(rundir.PathError):
    """A checkpoint that must not be loaded; names the path and what is wrong with it."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What the directory listing and the manifest say about one checkpoint."""

    path: Path
    """The ``global_step_N`` directory."""
    step: int
    """Global step the checkpoint was taken after."""
    epoch: int
    """Epoch at that step (-1 when the manifest is unreadable)."""
    complete: bool
    """True only when the manifest says complete and every checksum matches."""
    ts: float
    """Save time (manifest ``ts``; the directory's mtime when the manifest is unreadable)."""
    reason: str = ""
    """Why the checkpoint is not complete (empty when it is)."""


def step_dir(root: Path | str, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (verl's ``global_step_N``)."""
    return Path(root) / f"global_step_{int(step)}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch(where: Path | str) -> Any:
    """torch, imported only to save or load tensors: listing and verifying need none (a core install has none)."""
    try:
        import torch
    except ImportError as exc:
        raise CheckpointError(where, f"reading or writing tensors needs torch ({exc}); install torch, "
                              "or ppo-watchdog[trainer]") from exc
    return torch


def _serialise(obj: Any) -> bytes:
    torch = _torch("checkpoint")
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deserialise(data: bytes, where: Path) -> Any:
    torch = _torch(where)
    try:
        # weights_only: a checkpoint is data, never code (no arbitrary pickles).
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise CheckpointError(where, f"cannot deserialise ({type(exc).__name__}: {exc})") from exc


def save_checkpoint(
    root: Path | str,
    step: int,
    epoch: int,
    components: dict[str, dict[str, Any]],
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    protect: Iterable[int] = (),
) -> Path:
    """Write ``root/global_step_{step}`` atomically and return its path.

    Each component goes to ``{name}/state.pt``, ``extra`` to ``extra.pt``; the manifest
    with the sha256 of every file is written last, then the directory is renamed into
    place, then verl's marker is updated, then older checkpoints are pruned to the
    newest ``keep`` complete ones (steps in ``protect`` are never pruned, e.g. the last
    known-good one). Saving a step that already exists replaces it.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    for name in components:
        if not _COMPONENT_NAME.match(name) or name in (MANIFEST, EXTRA_FILE):
            raise ValueError(f"bad component name {name!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    final = step_dir(root, step)
    tmp = root / f"{_TMP_PREFIX}{step}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        files: dict[str, str] = {}
        for name, state in components.items():
            rel = f"{name}/{STATE_FILE}"
            data = _serialise(state)
            _write_file(tmp / rel, data)
            files[rel] = _sha256(data)
        if extra is not None:
            data = _serialise(extra)
            _write_file(tmp / EXTRA_FILE, data)
            files[EXTRA_FILE] = _sha256(data)
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": int(step),
            "epoch": int(epoch),
            "ts": time.time(),
            "files": files,
            "complete": True,
        }
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        for sub in {p.parent for p in tmp.rglob("*") if p.is_file()}:
            _fsync_dir(sub)
        if final.exists():
            # Replace an older save of the same step (a resumed run re-saving it): move it
            # aside first so that at every instant the name holds one whole checkpoint or none.
            trash = root / f"{_TRASH_PREFIX}{step}-{time.monotonic_ns()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rundir.atomic_write_bytes(root / rundir.LATEST_MARKER, f"{int(step)}".encode())
    if keep is not None:
        prune(root, keep, protect=protect)
    log.info("saved checkpoint %s (epoch %d, %d files)", final, epoch, len(files))
    return final


def _remove_stale_temporaries(root: Path) -> None:
    # A crash mid-save leaves a temp dir; it was never visible as a checkpoint, so drop it.
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(_TMP_PREFIX) or p.name.startswith(_TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    try:
        text = inputs.read_text(mpath)
    except FileNotFoundError:
        raise CheckpointError(path, f"no {MANIFEST} (incomplete or torn save)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(mpath, f"unreadable manifest ({exc})") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(mpath, f"manifest is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(mpath, "manifest must be a JSON object")
    for key in ("step", "epoch"):
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool):
            raise CheckpointError(mpath, f"manifest key {key!r} must be an integer, got {doc.get(key)!r}")
    if doc.get("complete") is not True:
        raise CheckpointError(mpath, f"manifest says complete={doc.get('complete')!r}")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(mpath, "manifest key 'files' must map relative paths to sha256 strings")
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != doc["step"]:
        raise CheckpointError(mpath, f"manifest step {doc['step']} does not match directory {path.name}")
    return doc


def _read_verified(path: Path, rel: str, expected: str) -> bytes:
    # Refuse paths that leave the checkpoint directory (a crafted manifest).
    target = (path / rel).resolve()
    if path.resolve() not in target.parents:
        raise CheckpointError(path, f"manifest file {rel!r} lies outside the checkpoint")
    try:
        data = inputs.read_file(target)
    except FileNotFoundError:
        raise CheckpointError(path / rel, "listed in the manifest but missing") from None
    except OSError as exc:
        raise CheckpointError(path / rel, f"unreadable ({exc})") from exc
    actual = _sha256(data)
    if actual != expected:
        raise CheckpointError(
            path / rel, f"checksum mismatch (manifest sha256 {expected[:12]}..., file {actual[:12]}..., {len(data)} bytes)"
        )
    return data


def verify_checkpoint(path: Path | str) -> CheckpointInfo:
    """Check a checkpoint directory; raise :class:`CheckpointError` if it is torn, incomplete or corrupt."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "not a directory")
    doc = _read_manifest(path)
    for rel, digest in doc["files"].items():
        _read_verified(path, rel, digest)
    return CheckpointInfo(path, doc["step"], doc["epoch"], True, float(doc.get("ts", path.stat().st_mtime)))


def load_checkpoint(path: Path | str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Verify and load a checkpoint: (components by name, extra). Never loads a file that fails its checksum."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "not a directory")
    doc = _read_manifest(path)
    # Verify every file before deserialising any, so a bad checkpoint loads nothing at all.
    blobs = {rel: _read_verified(path, rel, digest) for rel, digest in doc["files"].items()}
    components: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    for rel, data in blobs.items():
        obj = _deserialise(data, path / rel)
        if rel == EXTRA_FILE:
            extra = obj
        elif rel.endswith("/" + STATE_FILE):
            components[rel[: -len(STATE_FILE) - 1]] = obj
    return components, extra


def list_checkpoints(root: Path | str, verify: bool = True) -> list[CheckpointInfo]:
    """All ``global_step_N`` directories under ``root``, sorted by step; incomplete ones have complete=False.

    With ``verify=False`` only the manifest is read (no hashing), for quick listings.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    out: list[CheckpointInfo] = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        step = int(m.group(1))
        try:
            info = verify_checkpoint(p) if verify else _manifest_info(p)
        except CheckpointError as exc:
            epoch = -1
            try:
                raw = json.loads(inputs.read_text(p / MANIFEST))
                epoch = int(raw.get("epoch", -1))
            except (OSError, ValueError, TypeError, AttributeError):
                pass
            info = CheckpointInfo(p, step, epoch, False, p.stat().st_mtime, exc.reason)
        out.append(info)
    return sorted(out, key=lambda c: c.step)


def _manifest_info(path: Path) -> CheckpointInfo:
    doc = _read_manifest(path)
    return CheckpointInfo(path, doc["step"], doc["epoch"], True, float(doc.get("ts", path.stat().st_mtime)))


def latest_complete(root: Path | str) -> CheckpointInfo | None:
    """The newest checkpoint that verifies, or None."""
    return last_known_good(root, set())


def last_known_good(root: Path | str, bad_steps: Callable[[int], bool] | set[int] | frozenset[int]) -> CheckpointInfo | None:
    """The newest verified checkpoint whose step was not taken while a divergence rule fired.

    ``bad_steps`` is a set of steps or a predicate: the watchdog knows which steps fell
    inside a firing divergence rule. Newer checkpoints are hashed first and the search
    stops at the first good one, so a long history is not re-hashed on every call.
    """
    is_bad: Callable[[int], bool] = bad_steps.__contains__ if isinstance(bad_steps, (set, frozenset)) else bad_steps
    for info in reversed(list_checkpoints(root, verify=False)):
        if not info.complete or is_bad(info.step):
            continue
        try:
            return verify_checkpoint(info.path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s", exc)
    return None


def read_marker(root: Path | str) -> int | None:
    """The step in verl's ``latest_checkpointed_iteration.txt``, or None when absent or garbled."""
    try:
        return int(inputs.read_text(Path(root) / rundir.LATEST_MARKER).strip())
    except (FileNotFoundError, ValueError):
        return None


def prune(root: Path | str, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (and incomplete ones older than those).

    Incomplete checkpoints newer than the oldest kept one are left alone: one may be a
    save still in progress by another writer. Returns the deleted paths.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    protected = set(protect)
    infos = list_checkpoints(root, verify=False)
    complete = [c for c in infos if c.complete]
    kept = complete[-keep:]
    if not kept:
        return []
    oldest_kept = kept[0].step
    removed: list[Path] = []
    for c in infos:
        if c in kept or c.step in protected or c.step >= oldest_kept:
            continue
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.path)
    if removed:
        log.info("pruned %d checkpoint(s): %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def discard_newer(root: Path | str, step: int) -> list[Path]:
    """Delete checkpoints newer than ``step`` and point verl's marker at ``step``.

    For a rollback: checkpoints of the abandoned timeline must not be picked up as the
    "latest" by a later resume.
    """
    removed = []
    for c in list_checkpoints(root, verify=False):
        if c.step > step:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    if step_dir(root, step).is_dir():
        rundir.atomic_write_bytes(Path(root) / rundir.LATEST_MARKER, f"{int(step)}".encode())
    return removed


def set_aside(root: Path | str, label: str) -> Path | None:
    """Move every ``global_step_N`` and verl's marker into ``root/abandoned-<label>/``.

    For a run that starts over from its initial weights: what it saved on the abandoned
    timeline (a diverged run's checkpoints, and the one its SIGTERM handler wrote while being
    stopped) must not be resumed by any later restart, but is kept for a human to inspect.
    Returns the folder (None when there was nothing to move).
    """
    root = Path(root)
    # The watchdog's kept copies (known-good on the abandoned timeline) go too: a later restart
    # must not find them either.
    moved = [p for p in root.iterdir() if _STEP_DIR.match(p.name) or p.name in (rundir.LATEST_MARKER, KEPT_DIR)] \
        if root.is_dir() else []
    if not moved:
        return None
    dest = root / f"abandoned-{label}"
    dest.mkdir(parents=True, exist_ok=True)
    for p in moved:
        p.rename(dest / p.name)
    _fsync_dir(root)
    return dest


def set_aside_newer(root: Path | str, step: int, label: str) -> list[Path]:
    """Move every ``global_step_N`` with N > ``step`` into ``root/abandoned-<label>/`` and point verl's
    marker at ``step`` (when that checkpoint is there); returns the moved folders' new paths.

    For a relaunch from ``step`` of a trainer that cannot be stopped between two steps: verl's
    driver keeps training while Ray shuts down, so the stopped attempt may save checkpoints past the
    one the relaunch resumes from (measured: two steps at 2.4 s a step). They belong to a timeline
    the watchdog left; kept for a human, out of reach of any later resume or known-good choice, and
    the marker no longer vouches for a same-numbered save the relaunch has not finished.
    """
    root = Path(root)
    newer = [p for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and int(m.group(1)) > step] \
        if root.is_dir() else []
    moved: list[Path] = []
    if newer:
        dest = root / f"abandoned-{label}"
        dest.mkdir(parents=True, exist_ok=True)
        for p in sorted(newer):
            target = dest / p.name
            if target.exists():
                shutil.rmtree(target, ignore_errors=True)
            p.rename(target)
            moved.append(target)
    if step_dir(root, step).is_dir() and (moved or (root / rundir.LATEST_MARKER).exists()):
        rundir.atomic_write_bytes(root / rundir.LATEST_MARKER, f"{int(step)}".encode())
    if moved:
        _fsync_dir(root)
    return moved


# -- verl's own layout (no manifest) ----------------------------------------------------
#
# A checkpoint written by verl itself (``RayPPOTrainer._save_checkpoint`` and its FSDP
# checkpoint manager) has no manifest::
#
#     default_local_dir/
#       global_step_40/
#         actor/model_world_size_8_rank_0.pt  optim_world_size_8_rank_0.pt
#               extra_state_world_size_8_rank_0.pt ({'lr_scheduler': ..., 'rng': ...})  ... every rank
#         critic/...                           (the same, when the run has a critic)
#         data.pt                              (the dataloader's state)
#       latest_checkpointed_iteration.txt      written after all of the above
#
# verl writes the marker last, so a ``global_step_N`` counts when N is at or below the
# marker and it holds every rank's three files for one world size (a restart must use the
# world size it was saved with) plus ``data.pt``.

VERL_KINDS = ("model", "optim", "extra_state")
VERL_DATA_FILE = "data.pt"
_VERL_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")


def verl_file(component_dir: Path | str, kind: str, world_size: int, rank: int) -> Path:
    """verl's per-rank file name, e.g. ``actor/optim_world_size_8_rank_3.pt``."""
    if kind not in VERL_KINDS:
        raise ValueError(f"kind must be one of {', '.join(VERL_KINDS)}, got {kind!r}")
    return Path(component_dir) / f"{kind}_world_size_{int(world_size)}_rank_{int(rank)}.pt"


def verl_components(path: Path | str) -> dict[str, int]:
    """Component directories of a verl checkpoint holding per-rank files, with their world size.

    Raises :class:`CheckpointError` when one directory mixes world sizes (two saves overlaid).
    """
    out: dict[str, int] = {}
    for sub in sorted(p for p in Path(path).iterdir() if p.is_dir()):
        sizes = {int(m.group(2)) for f in sub.iterdir() if (m := _VERL_FILE.match(f.name))}
        if len(sizes) > 1:
            raise CheckpointError(sub, f"files of several world sizes ({', '.join(map(str, sorted(sizes)))})")
        if sizes:
            out[sub.name] = sizes.pop()
    return out


def verl_checkpoint_info(path: Path | str, marker: int | None, world_size: int | None = None,
                         components: tuple[str, ...] = ("actor",), by_files: bool = False) -> CheckpointInfo:
    """What a manifest-less verl ``global_step_N`` is worth: complete, or not with the reason.

    ``marker`` is the step in ``latest_checkpointed_iteration.txt`` (None: none written yet,
    so nothing counts); ``world_size`` the run's (None: whatever the files say, as long as
    every rank of it is there); ``components`` the directories a resume loads: verl loads
    ``critic/`` whenever the run has a critic (trainer/ppo/v1/trainer_base.py, _load_checkpoint:
    no check that it exists), so a run with one needs ``("actor", "critic")``.

    ``by_files``: judge by the files alone, the marker not consulted: verl 0.9.1's v1 trainer writes
    no marker under ``actor.checkpoint.async_save`` (trainer/ppo/v1/trainer_base.py:1011-1019), so
    one there is not verl's word. ``data.pt`` is what its ``_save_checkpoint`` writes last, after the
    actor's and critic's saves have returned, so a save in progress lacks it.
    """
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not m:
        raise ValueError(f"{path}: not a global_step_N directory")
    step = int(m.group(1))
    files = [f for f in path.rglob("*") if f.is_file()]
    ts = max((f.stat().st_mtime for f in files), default=path.stat().st_mtime)

    def incomplete(reason: str) -> CheckpointInfo:
        return CheckpointInfo(path, step, -1, False, ts, reason)

    if by_files:
        pass
    elif marker is None:
        return incomplete(f"no {rundir.LATEST_MARKER} beside it (verl writes it after a complete save)")
    elif step > marker:
        return incomplete(f"newer than {rundir.LATEST_MARKER} ({marker}): a save in progress or abandoned")
    try:
        found = verl_components(path)
    except CheckpointError as exc:
        return incomplete(str(exc))
    for name in components_needed(components):
        if name not in found:
            return incomplete(f"no {name}/ directory with per-rank model files"
                              + (" (verl loads it on resume: the run has a critic)" if name == "critic" else ""))
    for name, size in found.items():
        if world_size is not None and size != world_size:
            return incomplete(f"{name}/ was saved with world size {size}, the run uses {world_size}")
        for rank in range(size):
            for kind in VERL_KINDS:
                if not verl_file(path / name, kind, size, rank).is_file():
                    return incomplete(f"missing {name}/{verl_file('', kind, size, rank).name}")
    if not (path / VERL_DATA_FILE).is_file():
        return incomplete(f"missing {VERL_DATA_FILE} (the dataloader state verl saves last)")
    return CheckpointInfo(path, step, -1, True, ts)


def check_verl_files(path: Path | str) -> None:
    """Raise :class:`CheckpointError` naming the first file of a verl checkpoint that verl could not load.

    Each per-rank file and ``data.pt`` must be the zip archive ``torch.save`` writes, its directory
    readable and its pickle's CRC right: a truncated, overwritten or bit-flipped header fails here,
    before a relaunch is wasted on it. The tensors' bytes are not read (an optimizer shard is gigabytes);
    a corruption there is what the trainer reports when it loads them (an ``error`` event, ``what:
    resume``). verl writes no checksums, so this is the most that can be known without loading.
    """
    path = Path(path)
    files = [f for sub in sorted(path.iterdir()) if sub.is_dir() for f in sorted(sub.iterdir())
             if _VERL_FILE.match(f.name)]
    for f in [*files, path / VERL_DATA_FILE]:
        try:
            with os.fdopen(inputs.open_regular(f), "rb") as fh, zipfile.ZipFile(fh) as zf:
                pickle = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
                if pickle is None:
                    raise CheckpointError(f, "not a torch.save archive (no data.pkl inside)")
                zf.read(pickle)  # checks its CRC
        except FileNotFoundError:
            raise CheckpointError(f, "missing") from None
        except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise CheckpointError(f, f"cannot be loaded ({type(exc).__name__}: {exc})") from exc


def components_needed(components: tuple[str, ...]) -> tuple[str, ...]:
    """The component directories a checkpoint must hold: always ``actor``, plus those given."""
    return ("actor", *(c for c in components if c != "actor"))


def list_verl_checkpoints(root: Path | str, world_size: int | None = None,
                          components: tuple[str, ...] = ("actor",), by_files: bool = False,
                          cache: VerlListingCache | None = None) -> list[CheckpointInfo]:
    """Every ``global_step_N`` under verl's ``default_local_dir``, sorted by step, judged by
    :func:`verl_checkpoint_info` (no hashing: verl writes no checksums to compare with; ``by_files``:
    the marker not consulted, for verl's async save). ``cache``: a checkpoint unchanged since the last
    listing through it is not walked again (:class:`VerlListingCache`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    marker = read_marker(root)
    paths = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    if cache is None:
        out = [verl_checkpoint_info(p, marker, world_size, components, by_files) for p in paths]
    else:
        out = [cache.info(p, marker, world_size, components, by_files) for p in paths]
        cache.forget_all_but(paths)
    return sorted(out, key=lambda c: c.step)


class VerlListingCache:
    """What :func:`verl_checkpoint_info` said of each checkpoint, kept while the checkpoint is unchanged.

    A watcher lists a run's checkpoints every tick; walking and stat'ing every rank's files of every
    checkpoint each time costs seconds on a network file system with many checkpoints. A checkpoint is
    walked again only when its directory, one of its component directories (a file added, removed or
    renamed there) or its ``data.pt`` (verl's last write of a save) changed, or verl's marker moved.
    """

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[tuple[Any, ...], CheckpointInfo]] = {}
        self.walks = 0
        """Checkpoints walked (not answered from memory): what a test or a measurement counts."""

    @staticmethod
    def _signature(path: Path) -> tuple[Any, ...]:
        st = path.stat()
        parts = []
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False) or e.name == VERL_DATA_FILE:
                    s = e.stat(follow_symlinks=False)
                    parts.append((e.name, s.st_ino, s.st_mtime_ns, s.st_size if e.name == VERL_DATA_FILE else 0))
        return st.st_ino, st.st_mtime_ns, tuple(sorted(parts))

    def info(self, path: Path, marker: int | None, world_size: int | None, components: tuple[str, ...],
             by_files: bool) -> CheckpointInfo:
        """:func:`verl_checkpoint_info` of ``path``, from memory when nothing it reads changed."""
        try:
            key = (marker, world_size, components, by_files, self._signature(path))
        except OSError:  # (removed meanwhile): said as verl_checkpoint_info says it
            return verl_checkpoint_info(path, marker, world_size, components, by_files)
        seen = self._seen.get(path)
        if seen is not None and seen[0] == key:
            return seen[1]
        self.walks += 1
        info = verl_checkpoint_info(path, marker, world_size, components, by_files)
        self._seen[path] = (key, info)
        return info

    def forget_all_but(self, paths: Iterable[Path]) -> None:
        """Drop what is remembered of checkpoints no longer listed."""
        keep = set(paths)
        for p in [p for p in self._seen if p not in keep]:
            del self._seen[p]


#: Where numpy's array rebuilder lives, under numpy 1 and numpy 2: a file pickled by the other
#: numpy names the other module (numpy 2 renamed ``numpy.core`` to ``numpy._core``).
_NUMPY_RECONSTRUCT = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")


def verl_safe_globals() -> list[Any]:
    """The numpy types verl's ``extra_state`` holds (``np.random.get_state()`` in its RNG state).

    Allowing exactly these lets ``torch.load(weights_only=True)`` read verl's files: they
    rebuild arrays and dtypes, never call arbitrary code. The array rebuilder is allowed under
    both numpy 1's and numpy 2's module name, so a checkpoint written by a trainer on the
    other numpy loads too (the same function, renamed).
    """
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core to np._core
    reconstruct = core.multiarray._reconstruct
    own = f"{reconstruct.__module__}.{reconstruct.__name__}"
    out: list[Any] = [reconstruct, np.ndarray, np.dtype]
    out += [(reconstruct, name) for name in _NUMPY_RECONSTRUCT if name != own]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [dtypes.UInt32DType, dtypes.Float64DType, dtypes.Int64DType]
    return out


def _register_dtensor(torch: Any) -> None:
    """Make torch's weights-only unpickler accept DTensors (FSDP2's optimizer state holds them).

    torch allows ``DTensor`` and its spec classes only once ``torch.distributed.tensor`` is
    imported (it registers them with the serialization allowlist); nothing else in the
    watchdog imports it, so without this every FSDP2 checkpoint is refused.
    """
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available():
        return
    try:
        import torch.distributed.tensor  # noqa: F401  (the import registers the classes)
    except ImportError:  # a torch built without distributed: no DTensor can be in its files either
        pass


def load_verl_file(path: Path | str, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of one verl checkpoint file (numpy RNG state and FSDP2's
    DTensors allowed).

    ``mmap``: map the file's tensors instead of reading them into memory (zip-format files,
    what ``torch.save`` writes; an older format is read normally): the lr patch reads whole
    optimizer shards only to rewrite a few numbers.

    Raises :class:`CheckpointError` naming the file when it cannot be loaded that way
    (a pickle of arbitrary objects, or a type outside the allowlist such as a sharded
    tensor class): such a file is refused, never loaded with ``weights_only=False``.
    """
    path = Path(path)
    torch = _torch(path)
    _register_dtensor(torch)
    try:
        with torch.serialization.safe_globals(verl_safe_globals()):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if not mmap or "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except Exception as exc:  # UnpicklingError, RuntimeError, EOFError, ...
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # torch's UnpicklingError is a page of advice; the line naming the refused type is the news.
        why = next((ln for ln in lines if "Unsupported global" in ln or "WeightsUnpickler" in ln
                    or "must be imported" in ln), lines[0] if lines else "")
        raise CheckpointError(path, f"cannot be loaded with weights_only=True ({type(exc).__name__}: {why})") from exc


def save_verl_file(path: Path | str, obj: Any) -> None:
    """Write one verl checkpoint file (temp file + rename, so a reader never sees half of it).

    ``torch.save`` streams into the temporary file: no second, serialised copy of the tensors
    is built in memory (an optimizer shard of a 7B run is gigabytes).
    """
    path = Path(path)
    torch = _torch(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- known-good checkpoints kept out of the trainer's own pruning ------------------------------
#
# verl deletes old checkpoints itself when ``trainer.max_actor_ckpt_to_keep`` /
# ``max_critic_ckpt_to_keep`` is set (its checkpoint manager rmtree's ``global_step_N/actor`` and
# ``/critic`` of the paths it saved, utils/checkpoint/checkpoint_manager.py), whatever the
# watchdog still needs for a rollback. The watchdog keeps the last known-good ones as hard
# links under ``root/.watchdog_kept/global_step_N``: a directory verl never saved, so never
# prunes; no disk is used until verl deletes the original, and a rollback resumes from the kept
# copy (verl's resume_path takes any ``global_step_N`` directory).

KEPT_DIR = ".watchdog_kept"


def kept_root(root: Path | str) -> Path:
    """Where the watchdog keeps hard-linked copies of known-good checkpoints."""
    return Path(root) / KEPT_DIR


def keep_checkpoint(path: Path | str, root: Path | str) -> Path:
    """Hard-link every file of the checkpoint ``path`` into ``root/.watchdog_kept/<its name>``.

    Built beside its final place and renamed in, so a crash leaves no half copy; an existing
    copy with the same files is kept as it is. Files on another file system are copied.
    """
    src, dest_root = Path(path), kept_root(root)
    dst = dest_root / src.name
    files = sorted(f.relative_to(src) for f in src.rglob("*") if f.is_file())
    if dst.is_dir() and all(_same_file(dst / rel, src / rel) for rel in files):
        return dst
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = dest_root / f".tmp-{src.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        for rel in files:
            link_or_copy(src / rel, tmp / rel)
        publish_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("kept %s as %s (out of reach of the trainer's own pruning)", src, dst)
    return dst


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a copy across file systems); its parent is made."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _same_file(copy: Path, src: Path) -> bool:
    """``copy`` is ``src``: the same inode (a hard link) or, copied across file systems, same size and mtime."""
    try:
        a, b = copy.stat(), src.stat()
    except OSError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev) or (a.st_size, int(a.st_mtime)) == (b.st_size, int(b.st_mtime))


def publish_dir(tmp: Path, dst: Path) -> None:
    """Put the directory built at ``tmp`` in place of ``dst``: the old one is renamed aside first and
    removed only once the new one is in place, so a crash leaves one whole copy or the other."""
    old = dst.with_name(f"{dst.name}.old-{os.getpid()}-{time.monotonic_ns()}") if dst.exists() else None
    if old is not None:
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_copy(src: Path, dst_root: Path, rewritten: Iterable[str], write: Callable[[Path], None],
               record_name: str, record: Mapping[str, Any]) -> Path:
    """Publish ``dst_root/<src's name>``: a copy of the checkpoint ``src`` in which ``write(tmp)`` writes
    the files named in ``rewritten`` (paths relative to ``src``) and every other file is a hard link
    (a copy across file systems), with ``record`` as JSON in ``record_name``. Built in a hidden
    directory and renamed into place, so a crash leaves no half copy that a resume could pick; on
    any error nothing is left behind. ``src`` is only read."""
    dst = dst_root / src.name
    dst_root.mkdir(parents=True, exist_ok=True)
    tmp = dst_root / f".tmp-{src.name}-{os.getpid()}-{time.monotonic_ns()}"
    skip = set(rewritten)
    try:
        write(tmp)
        for f in src.rglob("*"):
            rel = f.relative_to(src)
            if f.is_dir() or str(rel) in skip:
                continue
            link_or_copy(f, tmp / rel)  # the model shards are the bulk: share them, never rewrite them
        rundir.atomic_write_json(tmp / record_name, dict(record))
        publish_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def release_kept(root: Path | str, keep: Iterable[str]) -> list[Path]:
    """Remove the kept copies whose name is not in ``keep``; returns what was removed."""
    where = kept_root(root)
    if not where.is_dir():
        return []
    names = set(keep)
    removed = []
    for p in sorted(where.iterdir()):
        if p.is_dir() and (p.name.startswith(".tmp-") or p.name not in names):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def files_present(path: Path | str) -> bool:
    """True when every file a checkpoint's manifest lists exists (a stat each, no hashing): a
    checkpoint whose ``actor/`` the trainer pruned still has its manifest but not its files."""
    try:
        doc = _read_manifest(Path(path))
    except CheckpointError:
        return False
    return all((Path(path) / rel).is_file() for rel in doc["files"])
