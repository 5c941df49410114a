"""What the vLLM adapter tests share: tiny Llama checkpoints and a one-process vLLM parallel state."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

TINY_LLAMA = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def write_llama_config(path: Path, **overrides) -> Path:
    """A model directory holding only ``config.json`` (enough for vLLM's config parsing)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
              **TINY_LLAMA, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_random_llama(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama checkpoint whose attention is far from uniform.

    ``initializer_range=0.2`` (transformers' default is 0.02) makes q.k logits of order 10 after RMSNorm, so
    softmax rows are peaked and a wrong key, position or head changes the greedy tokens.
    """
    if (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA, "initializer_range": 0.2, **overrides})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


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
