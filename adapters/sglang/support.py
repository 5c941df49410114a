"""What the SGLang backend runs, and the start-up checks that refuse everything else, each naming its option."""

from __future__ import annotations

from dcp_plugin.adapters.sglang import speculative
from dcp_plugin.kernels.checks import FLOAT_DTYPES


def runner_problems(model_runner) -> list[str]:
    """Each unsupported setting of an SGLang model runner, as ``"<option>: <why>; supported: <what>"``."""
    from dcp_plugin.adapters.sglang import compat
    from dcp_plugin.kernels import SUPPORTED_HEAD_DIMS

    config = model_runner.model_config
    problems = []
    if getattr(model_runner, "use_mla_backend", False):
        problems.append("MLA model (multi-head latent attention, DeepSeek-style): not supported; supported: models "
                        "with separate K/V heads")
    if getattr(config, "is_encoder_decoder", False):
        problems.append("encoder-decoder model (cross-attention layers): not supported; supported: decoder-only")
    if getattr(model_runner, "sliding_window_size", None) is not None:
        problems.append(f"sliding window {model_runner.sliding_window_size} (the model's config): sliding-window "
                        "attention is not supported; supported: full-context attention")
    if getattr(config, "attention_chunk_size", None) is not None:
        problems.append(f"attention_chunk_size={config.attention_chunk_size} (the model's config): chunked local "
                        "attention is not supported; supported: full-context attention")
    problems += speculative.problems(speculative.from_runner(model_runner))
    if compat.resolved_server_arg(model_runner, "enable_two_batch_overlap"):
        problems.append("--enable-two-batch-overlap: two micro-batches would share dcp-triton's attention workspace; "
                        "supported: off")
    dtype = model_runner.dtype
    if dtype not in FLOAT_DTYPES:
        problems.append(f"--dtype {dtype}: supported: float16, bfloat16, float32")
    if model_runner.kv_cache_dtype != dtype:
        problems.append(f"--kv-cache-dtype ({model_runner.kv_cache_dtype} with --dtype {dtype}): the KV cache must "
                        "hold the model dtype; supported: auto")
    head_dim, v_head_dim = config.head_dim, getattr(config, "v_head_dim", config.head_dim)
    if head_dim not in SUPPORTED_HEAD_DIMS or v_head_dim != head_dim:
        problems.append(f"head_dim={head_dim} (v_head_dim={v_head_dim}): supported: equal K/V head sizes in "
                        f"{list(SUPPORTED_HEAD_DIMS)}")
    problems += pool_problems(model_runner.token_to_kv_pool)
    return problems


def pool_problems(pool) -> list[str]:
    """An MHA pool of SGLang's plain kind, or a hybrid model's pool (``HybridLinearKVPool``: linear-attention state
    beside one), in an NHD or HND layout."""
    mha = getattr(pool, "full_kv_pool", None) if type(pool).__name__ == "HybridLinearKVPool" else pool
    if type(mha).__name__ != "MHATokenToKVPool":
        inner = f" holding {type(mha).__name__}" if mha is not pool else ""
        return [f"KV pool {type(pool).__name__}{inner} (sliding-window, quantized, MLA, sparse or unified-memory "
                "pools): supported: SGLang's MHATokenToKVPool, alone or in a hybrid model's HybridLinearKVPool"]
    if getattr(mha, "kv_cache_layout", None) not in (None, "NHD", "HND", "nhd", "hnd"):
        return [f"KV cache layout {mha.kv_cache_layout}: supported: NHD, HND"]
    return []


def layer_problems(layer, heads) -> list[str]:
    """Each unsupported setting of one of the model's ``RadixAttention`` layers (``heads``: its ``HeadLayout``)."""
    from sglang.srt.layers.radix_attention import AttentionType

    name = f"layer {layer.layer_id}"
    problems = []
    if (layer.sliding_window_size or -1) > -1:
        problems.append(f"{name}: sliding window {layer.sliding_window_size}: not supported; supported: none")
    if layer.logit_cap not in (None, 0, 0.0):
        problems.append(f"{name}: logit_cap={layer.logit_cap} (soft-capped logits): not supported; supported: 0")
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        kind = "cross-attention" if layer.is_cross_attention else getattr(layer.attn_type, "value", layer.attn_type)
        problems.append(f"{name}: {kind} attention: not supported; supported: decoder self-attention")
    if layer.qk_head_dim != layer.v_head_dim:
        problems.append(f"{name}: K head size {layer.qk_head_dim} and V head size {layer.v_head_dim}: supported: "
                        "equal sizes")
    if (layer.tp_q_head_num, layer.tp_k_head_num) != (heads.num_q_heads, heads.num_kv_heads):
        problems.append(
            f"{name}: holds {layer.tp_q_head_num} Q / {layer.tp_k_head_num} KV heads per rank, but a DCP group of "
            f"{heads.dcp_size} needs {heads.num_q_heads} Q / {heads.num_kv_heads} KV heads per rank (global KV heads "
            f"{heads.kv_head_start}..{heads.kv_head_start + heads.num_kv_heads - 1}, the ones its "
            f"{heads.num_group_q_heads} Q heads read): the model does not replicate its KV heads inside the DCP "
            "group at this --tp-size / --dcp-size; supported: a smaller --dcp-size"
        )
    return problems


def check(problems: list[str]) -> None:
    """Raise one ``ValueError`` listing every problem (none: return)."""
    if problems:
        raise ValueError("The dcp-triton attention backend cannot run this model: " + "; ".join(problems))

