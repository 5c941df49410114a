"""What the DCP-Triton backend runs, and the startup checks that refuse everything else with a clear message.

Which kernels run (``DCP_TRITON_KERNELS``) is the core's choice: ``dcp_plugin.kernel_choice``."""

from __future__ import annotations

import os

import torch

from dcp_plugin.kernels.checks import FLOAT_DTYPES as SUPPORTED_DTYPES

# vLLM's fp8 KV-cache options: the cache holds value / scale (vLLM's per-tensor k_scale / v_scale, default or
# calculated), quantized when written and dequantized in registers when read; "fp8" means e4m3 on NVIDIA GPUs.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Otherwise the kernels read the cache in the model's dtype: "auto", or the model dtype spelled out.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def supported_head_sizes() -> tuple[int, ...]:
    from dcp_plugin.kernels import SUPPORTED_HEAD_DIMS

    return tuple(SUPPORTED_HEAD_DIMS)


def layer_problems(
    *,
    head_size: int,
    alibi_slopes,
    sliding_window,
    kv_cache_dtype: str,
    logits_soft_cap,
    attn_type: str,
    kv_sharing_target_layer_name,
    extra_impl_args: dict,
    model_dtype: torch.dtype | None,
    attention_chunk_size: int | None = None,
    use_mla: bool = False,
) -> list[str]:
    """Each unsupported option of one attention layer, as ``"<option>=<value>: <why>; supported: <what>"``.

    ``attention_chunk_size`` is vLLM's ``ModelConfig.attention_chunk_size``: a model that sets it (Llama 4) gets
    chunked local attention layers, which no argument of a layer's impl reveals, and whose metadata-builder wrapper
    writes to the step's metadata, which dcp-triton freezes. ``use_mla`` is the backend selector's flag.
    """
    from vllm.v1.attention.backend import AttentionType

    problems = []
    if use_mla:
        problems.append(
            "use_mla=True: multi-head latent attention (MLA, DeepSeek-style models) is not supported; supported: "
            "decoder self-attention with separate K/V heads (use_mla=False)"
        )
    if attention_chunk_size is not None:
        problems.append(
            f"attention_chunk_size={attention_chunk_size}: chunked local attention is not supported; supported: "
            "full-context decoder attention (attention_chunk_size unset)"
        )
    heads = supported_head_sizes()
    if head_size not in heads:
        problems.append(f"head_size={head_size}: supported head sizes are {list(heads)}")
    if model_dtype is not None and model_dtype not in SUPPORTED_DTYPES:
        problems.append(f"dtype={model_dtype}: supported dtypes are float16, bfloat16, float32")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        problems.append(
            f"kv_cache_dtype={kv_cache_dtype!r}: not a KV-cache format dcp-triton reads; supported: 'auto' (the "
            "model dtype) and per-tensor-scaled 'fp8' / 'fp8_e4m3' / 'fp8_e5m2'"
        )
    elif kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        pass  # any model dtype: the cache is quantized with vLLM's per-tensor scales
    elif kv_cache_dtype != "auto" and model_dtype is not None and kv_cache_dtype != _DTYPE_NAMES.get(model_dtype):
        problems.append(
            f"kv_cache_dtype={kv_cache_dtype!r} with dtype={model_dtype}: the cache must hold the model dtype; "
            "supported: 'auto'"
        )
    if sliding_window is not None:
        problems.append(f"sliding_window={sliding_window}: sliding-window attention is not supported; supported: None")
    if alibi_slopes is not None:
        problems.append("alibi_slopes: ALiBi is not supported; supported: rotary/no position bias")
    if logits_soft_cap not in (None, 0, 0.0):
        problems.append(f"logits_soft_cap={logits_soft_cap}: soft-capped logits are not supported; supported: None")
    if attn_type != AttentionType.DECODER:
        name = getattr(attn_type, "value", attn_type)  # vLLM's layers pass AttentionType members
        problems.append(f"attn_type={name!r}: only decoder self-attention is supported ('decoder')")
    if kv_sharing_target_layer_name is not None:
        problems.append(
            f"kv_sharing_target_layer_name={kv_sharing_target_layer_name!r}: cross-layer KV sharing is not "
            "supported; supported: None"
        )
    if extra_impl_args.get("sinks") is not None:
        problems.append("sinks: attention sinks are not supported; supported: None")
    for name, value in extra_impl_args.items():
        if name != "sinks" and value not in (None, False):
            problems.append(f"{name}={value!r}: not supported by dcp-triton; supported: unset")
    return problems


def check_layer(**options) -> None:
    """Raise ``ValueError`` listing every unsupported option (see ``layer_problems``)."""
    problems = layer_problems(**options)
    if problems:
        raise ValueError("The dcp-triton attention backend cannot run this layer: " + "; ".join(problems))


def prepare_interpreter_env() -> None:
    """On vLLM's CPU platform, put ``TRITON_INTERPRET=1`` in this process's environment (the kernels package's rule
    for a machine without GPU), so the engine-core and worker processes vLLM spawns import triton in interpreter
    mode from the start: triton fixes the mode of its jit helpers at import, and vLLM imports triton there before
    any plugin code runs. (vLLM's platform check, not ``torch.cuda.is_available()``: that would initialise the CUDA
    driver in a process vLLM may later fork.)"""
    from vllm.platforms import current_platform

    if "TRITON_INTERPRET" not in os.environ and current_platform.is_cpu():
        os.environ["TRITON_INTERPRET"] = "1"
