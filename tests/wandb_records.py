"""What an offline W&B run wrote: the records of ``wandb/offline-run-*/run-<id>.wandb`` (shared by the tracker tests).

The file is wandb-core's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then the
LevelDB log format in 32 KiB blocks (chunks of crc32c, length, type: full, first, middle, last), each
record a ``wandb_internal_pb2.Record``. The installed wandb (0.31) reads it only in its Go core, so the
tests read it here.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The records of a .wandb file, in order."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (starts {data[:7]!r})")
    out, pos, part = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            part = chunk
        elif kind == MIDDLE:
            part += chunk
        elif kind == LAST:
            out.append(part + chunk)
    return out


@dataclass
class OfflineRun:
    """One process's part of an offline W&B run."""

    path: Path
    run_id: str
    wandb_config: dict[str, Any]
    """The ``_wandb`` config entry (``branch_point`` for a rewound or forked start)."""
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The history rows by ``_step``: ``{key: value}``."""


def read_offline_run(path: Path) -> OfflineRun:
    """The run id, ``_wandb`` config and history of one ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, wandb_config, steps = "", {}, {}
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            for item in rec.run.config.update:
                if item.key == "_wandb":
                    wandb_config = json.loads(item.value_json)
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            steps[int(row["_step"])] = row
    return OfflineRun(path, run_id, wandb_config, steps)


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run segment under ``wandb_dir`` (``$WANDB_DIR``), oldest first."""
    files = sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [read_offline_run(f) for f in files]
