"""End to end: examples/offline_generate.py with no model argument runs the embedded SmolLM2 in vLLM, every
attention layer of the worker is dcp-triton's, with the Triton kernels (interpreted on CPU, as `make demo` runs
them), and it prints only the answer and one line of what ran (vLLM's log goes to a file)."""

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
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "0"  # what ran is asked by method name, no pickled function
    env.pop("DCP_TRITON_KERNELS", None)
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--prompt", "The capital of France is", "--max-tokens", "2", "--kernels",
         "triton"], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout.splitlines()
    assert len(out) == 5 and result.stderr == "", result  # model, start, prompt, completion, what ran
    assert out[1].startswith("starting vLLM on smollm2-135m-instruct (its log: ")
    log = Path(out[1].split("its log: ")[1].split(")")[0])
    assert "dcp-triton attention: backend=DCP_TRITON" in log.read_text()  # the engine's log is there
    assert out[2:4] == ["prompt: 'The capital of France is'", out[3]] and out[3].startswith("completion: ' Paris")
    ran = re.fullmatch(r"ran: DCP_TRITON \(DcpTritonImpl\) in 30 attention layers on 1 rank\(s\), dcp_size=1, "
                       r"kernels=(.*); 2 tokens for 1 prompt\(s\) in [\d.]+ s \([\d.]+ tokens/s, prefill included\)",
                       out[4])
    assert ran is not None, out[4]
    assert ran.group(1).startswith("triton (interpreter"), out[4]  # the Triton kernels ran, not the references
