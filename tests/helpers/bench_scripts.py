"""A benchmark run the way its docstring says, ``python -m benchmarks.<folder>.<script>`` from the repository root,
for the tests of its CPU modes (listing, planning, dry runs, summaries): its output, and the top-level modules it
imported (``-X importtime``), which those modes keep free of torch and the engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -X importtime -m module args`` in the repository root: the finished process and what it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    return done, {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
