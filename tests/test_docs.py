"""The documents' links and paths resolve in a clone of the repository, and none points outside it.

Checked in README.md, RELIABILITY.md, ARCHITECTURE.md, bench/README.md and rules/README.md: every relative link;
every path that starts at a folder of the repository (``bench/results/x.md``; in a folder's README, one of that
folder's too: ``results/x.md``), in prose, backticks or code blocks alike; every backticked file name
(``faults.md``), which some file of the repository must have (names that a run, a checkpoint or the state writes
at run time aside); and no ``../`` that leaves the clone.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

from ppo_watchdog.protocol import rundir

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "RELIABILITY.md", "ARCHITECTURE.md", "bench/README.md", "rules/README.md"]

#: File names that exist only where a run, a checkpoint or the watchdog's state writes them, not in the repository:
#: the run-directory protocol's files, verl's and the embedded trainer's checkpoint parts, the state database.
WRITTEN_AT_RUN_TIME = {
    *(v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and "." in v),
    "data.pt", "optimizer.pt", "scheduler.pt", "latest_checkpointed_iteration.txt", "watchdog.db", "smoke.json",
    "monkey_patch.py",
}

LINK = re.compile(r"\]\(([^)\s]+)\)")
TICKED_NAME = re.compile(r"`([\w*{},-][\w.*{},-]*\.(?:md|json|png|txt|py|yaml|yml|pstats|toml))`")
OUTSIDE = re.compile(r"\.\./shared|\.\./\.\./")


def expand(pattern: str) -> list[str]:
    """``a.{json,md}`` -> [``a.json``, ``a.md``] (nested braces too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def exists(root: Path, base: Path, path: str) -> bool:
    """Whether ``path`` (braces and globs allowed) names something under ``base`` that lies inside ``root``."""
    for one in expand(path):
        target = (base / one).resolve()
        if not target.is_relative_to(root):
            return False
        if "*" in one:
            if not list(base.glob(one)):
                return False
        elif not target.exists():
            return False
    return True


def file_names(root: Path) -> list[str]:
    """The names of the files under ``root`` (what git ignores that a checkout makes left out)."""
    skip = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    return [p.name for p in root.rglob("*") if p.is_file() and not skip.intersection(p.relative_to(root).parts)]


def _tracked_folders(base: Path) -> set[str] | None:
    """The folders of ``base`` that hold a file git tracks (a checkout's ``runs/`` or ``.venv`` is no folder of
    the repository); None where git cannot say."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "."], cwd=base, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {f.split("/", 1)[0] for f in out.decode().split("\0") if "/" in f}


def rooted_paths(text: str, base: Path) -> list[str]:
    """Paths in ``text`` that start with a folder of ``base`` (``bench/x.py`` from the root), wherever they stand."""
    tracked = _tracked_folders(base)
    folders = sorted((d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith(".")
                      and (tracked is None or d.name in tracked)), key=len, reverse=True)
    rx = re.compile(r"(?<![\w/.$-])((?:" + "|".join(map(re.escape, folders)) + r")/[\w./{},*-]*)")
    return [m.group(1).rstrip(".,;:") for m in rx.finditer(text)]


def broken(root: Path, doc: str) -> list[str]:
    """Every link, path and file name of ``root/doc`` that names nothing in ``root``, and every way out of it."""
    path = root / doc
    files = file_names(root)
    text = path.read_text()
    here = path.parent
    out = [f"{doc}: names a place outside the clone: {m.group(0)!r}" for m in OUTSIDE.finditer(text)]
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if target and not re.match(r"[a-z]+:", target) and not exists(root, here, target):
            out.append(f"{doc}: link to a missing file: {target}")
    for base in {root, here}:
        for p in rooted_paths(text, base):
            if not (exists(root, here, p) or exists(root, root, p)):
                out.append(f"{doc}: path of no file: {p}")
    for name in TICKED_NAME.findall(text):
        if name in WRITTEN_AT_RUN_TIME:
            continue
        for one in expand(name):
            if not fnmatch.filter(files, one):
                out.append(f"{doc}: no file of the repository is named {one}")
    return sorted(set(out))


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_and_path_of_the_doc_names_a_file_of_the_clone(doc: str) -> None:
    assert broken(ROOT, doc) == []


def test_the_check_finds_a_missing_result_a_missing_link_and_a_path_outside_the_clone(tmp_path: Path) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "README.md").write_text("# Benchmarks\n")
    (tmp_path / "bench" / "results" / "faults.json").write_text("{}\n")
    (tmp_path / "bench" / "probe.md").write_text(
        "See [the index](README.md), [gone](results/gone.md), `results/faults.json`, `results/faults.{json,md}`,\n"
        "bench/no_such_bench.py, `faults.json`, `daemon_scale_before_i22.json`, `run.json`, [up](../../x.md)\n"
        "and ../shared/testdata.\n")
    assert broken(tmp_path, "bench/probe.md") == sorted([
        "bench/probe.md: link to a missing file: results/gone.md",
        "bench/probe.md: path of no file: results/gone.md",
        "bench/probe.md: link to a missing file: ../../x.md",
        "bench/probe.md: path of no file: results/faults.{json,md}",
        "bench/probe.md: path of no file: bench/no_such_bench.py",
        "bench/probe.md: no file of the repository is named daemon_scale_before_i22.json",
        "bench/probe.md: names a place outside the clone: '../shared'",
        "bench/probe.md: names a place outside the clone: '../../'",
    ])
