"""``DcpTritonBackend``: the class vLLM resolves for ``--attention-backend dcp-triton``."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, MultipleOf

from dcp_plugin.adapters.vllm import compat, support


HOPPER_BLOCK_SIZE = 64  # the prefix pass's tile (kernels/prefix_attention.py GPU_CONFIGS)


class DcpTritonBackend(AttentionBackend):
    """Decode-context-parallel attention with Triton kernels (``dcp_plugin``), for decoder self-attention.

    ``forward`` writes this step's K/V into the cache itself (one op per layer instead of two). Any
    ``KVCacheLayout`` (0.32+), or either NHD/HND stride order (0.26), works: the impl takes K and V as strided
    views of the layer's logical ``[blocks, heads, block_size, 2 * head]`` cache.
    """

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(support.SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(support.SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "DCP_TRITON"  # the AttentionBackendEnum key vLLM looks the layer's backend up by

    @staticmethod
    def get_impl_cls():
        from dcp_plugin.adapters.vllm.impl import DcpTritonImpl

        return DcpTritonImpl

    @staticmethod
    def get_builder_cls():
        from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder

        return DcpTritonMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """64-token KV blocks on Hopper and later (sm_90+): each 64-token tile of the prefix pass then lies in one
        block and comes through one tensor-descriptor (TMA) copy instead of per-token gathers. Elsewhere vLLM's
        default. vLLM asks only when the user gave no ``--block-size``; any multiple of 16 works."""
        from vllm.platforms import current_platform

        if current_platform.is_cuda() and current_platform.has_device_capability(90):
            return max(default_block_size, HOPPER_BLOCK_SIZE)
        return super().get_preferred_block_size(default_block_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(support.supported_head_sizes())

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """No. The builder plans a step from the host's per-request query lengths (how many leading rows are
        single-token decodes, and the context bound), so a batch whose device ``query_start_loc`` splits the tokens
        otherwise would pair query rows with the wrong requests. vLLM 0.32+'s adaptive verification makes such
        batches (``speculative_config.enable_adaptive_verification``: the V2 runner trims drafts on the device and
        spreads the draft budget evenly on the host, ``v1/worker/gpu/spec_decode/adaptive_verification.py``
        ``compact_batch``); vLLM's backend selector refuses dcp-triton for it with this reason."""
        return False

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None  # every layout keeps K||V innermost; the kernels take the resulting strides

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """vLLM 0.26's allocation contract (0.32+ never call it): the same logical view 0.32+ hand over."""
        return compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """vLLM 0.26's physical order of ``get_kv_cache_shape`` (0.32+ never call it)."""
        return compat.kv_cache_stride_order(include_num_layers_dimension=include_num_layers_dimension)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        """vLLM's selector lists terse reasons ("head_size not supported"); this one says what is supported."""
        from vllm.v1.attention.backend import AttentionType

        problems = support.layer_problems(
            head_size=head_size, alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype or "auto",
            logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
            extra_impl_args={"sinks": True if has_sink else None}, model_dtype=dtype, use_mla=use_mla,
        )
        version = compat.unsupported_vllm_reason()
        return "; ".join(([version] if version else []) + problems) or None
