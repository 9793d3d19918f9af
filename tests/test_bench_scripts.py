"""Every bench script still imports: the scripts share helpers (``trl_stability.run_to_end``, ``bench_rules``), and a
helper renamed in one of them must not leave another that fails only when someone next runs it, an hour into a bench."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCH.glob("*.py")))
def test_the_bench_script_imports(script: str) -> None:
    # Imported, not run: each script's work is behind ``if __name__ == "__main__"`` (tick_parts is a module).
    code = f"import sys; sys.path[:0] = [{str(BENCH)!r}, {str(BENCH.parent)!r}]; import {script}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
