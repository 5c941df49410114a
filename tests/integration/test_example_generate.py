"""End to end: examples/offline_generate.py with no model argument runs the embedded SmolLM2 in vLLM, and every
attention layer of the worker is dcp-triton's, with the Triton kernels (interpreted on CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offline_generate.py"


@pytest.mark.slow
def test_offline_generate_runs_dcp_triton_and_says_paris(smollm2_dir, tmp_path):
    env = {**os.environ, "DCP_TRITON_CACHE": str(smollm2_dir.parent)}  # the example finds the fixture's checkpoint
    env.pop("DCP_TRITON_KERNELS", None)
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--prompt", "The capital of France is", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    backends = re.findall(r"^attention, rank (\d+): backend=(\S+) impl=(\S+) layers=(\d+) .* kernels=(.*)$", out,
                          flags=re.MULTILINE)
    assert len(backends) == 1, out  # one worker, one kind of attention layer
    rank, backend, impl, layers, kernels = backends[0]
    assert (rank, backend, impl, layers) == ("0", "DCP_TRITON", "DcpTritonImpl", "30"), out
    assert kernels.startswith("triton"), out  # the Triton kernels ran, not the torch references
    completion = re.search(r"^completion: '(.*)'$", out, flags=re.MULTILINE)
    assert completion is not None, out
    assert completion.group(1).startswith(" Paris"), out
    assert re.search(r"^generated 2 tokens for 1 prompts in [\d.]+ s: [\d.]+ tokens/s", out, flags=re.MULTILINE), out
