"""Scatter this step's new K/V rows into the paged cache (step 1 of DCP attention).

An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2``) stores ``value / scale`` (one float32 scale for K, one for V,
read from device memory at run time, so an engine may set them later), clamped to the format's finite range.
The Triton interpreter rounds float32 to fp8 wrongly (checked: thousands of mismatches against torch over a sweep
of values, some off by a factor of two), so on CPU an fp8 cache is written by the torch reference only.
"""

from __future__ import annotations

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import INDEX_DTYPES, Launch, cdiv, check_kernel_tensor, check_shape, next_pow2
from dcp_plugin.kernels._pdl import pdl_for, wait_for_previous_grid
from dcp_plugin.kernels.checks import CACHE_DTYPES, check_kv_scales

_MAX_TILE_ELEMENTS = 4096  # heads x head-dim elements one program moves; bounds registers per program


@triton.jit
def write_kv_cache_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    num_heads, head_dim,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_blk, stride_kc_tok, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_h, stride_vc_d,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: the cache is fp8, store clamp(value / scale, +-FP8_MAX)
    PDL: tl.constexpr = 0,  # above 0: a programmatic dependent launch (_pdl)
):
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # another DCP rank owns this token
        return
    page = slot // PAGE_SIZE
    row = slot % PAGE_SIZE

    heads = (head_block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(k_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :] * stride_k_d, mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims[None, :] * stride_v_d, mask=mask)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX), FP8_MAX)
    k_dst = key_cache_ptr + page * stride_kc_blk + row * stride_kc_tok
    v_dst = value_cache_ptr + page * stride_vc_blk + row * stride_vc_tok
    tl.store(k_dst + heads[:, None] * stride_kc_h + dims[None, :] * stride_kc_d,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vc_h + dims[None, :] * stride_vc_d,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Store ``k[t], v[t]`` at slot ``slot_mapping[t]`` of the paged caches, in place.

    Args:
        k, v: ``[T, H, D]`` float (fp16/bf16/fp32, any strides); rows ``t >= len(slot_mapping)`` are padding and
            are not written.
        key_cache, value_cache: ``[num_blocks, block_size, H, D]`` float or fp8 (e4m3fn / e5m2), any strides (e.g.
            views of one ``[num_blocks, block_size, H, 2 * D]`` buffer); values are cast to the cache dtype.
        slot_mapping: ``[num_slots]`` int32/int64, ``num_slots <= T``; slot ``s`` is row ``s % block_size`` of
            page ``s // block_size``; ``s < 0`` means another DCP rank owns the token (skipped).
        k_scale, v_scale: for an fp8 cache only, one-element float32 tensors: the cache stores value / scale.

    Example:
        >>> write_kv_cache(k, v, key_cache, value_cache, torch.tensor([0, -1, 17], device=k.device))
    """
    check_kernel_tensor("k", k, ndim=3)
    device = k.device
    check_kernel_tensor("v", v, ndim=3, device=device)
    check_kernel_tensor("key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_kernel_tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), device=device)
    check_kv_scales(key_cache.dtype, k_scale, v_scale, device)
    check_kernel_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_tokens, num_heads, head_dim = k.shape
    check_shape("v", v, tuple(k.shape))
    check_shape("key_cache", key_cache, (None, None, num_heads, head_dim))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    if key_cache.shape[1] < 1:
        raise ValueError(f"key_cache block size (dim 1) must be >= 1, got {key_cache.shape[1]}")
    if slot_mapping.shape[0] > num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but k/v hold only {num_tokens} rows; "
                         "it must have at most one slot per row")
    plan_write_kv(k, v, key_cache, value_cache, slot_mapping)(k, v, key_cache, value_cache, slot_mapping,
                                                             k_scale, v_scale)


def plan_write_kv(k, v, key_cache, value_cache, slot_mapping) -> Launch:
    """``write_kv_cache`` prepared for tensors shaped like these (no checks): call it with ``(k, v, key_cache,
    value_cache, slot_mapping, k_scale, v_scale)`` (scales ``None`` unless the cache is fp8)."""
    if INTERPRET and key_cache.dtype.itemsize == 1:
        raise ValueError(
            f"an fp8 KV cache ({key_cache.dtype}) cannot be written by the Triton interpreter, which rounds float32 "
            "to fp8 wrongly; on CPU use the torch kernels (dcp_plugin.kernels.reference, DCP_TRITON_KERNELS=reference)"
        )
    num_heads, head_dim = k.shape[1:]
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, _MAX_TILE_ELEMENTS // block_d))
    grid = (slot_mapping.shape[0], cdiv(num_heads, block_h)) if num_heads and head_dim else (0,)
    scalars = (num_heads, head_dim, *k.stride(), *v.stride(), *key_cache.stride(), *value_cache.stride())
    fp8_max = torch.finfo(key_cache.dtype).max if key_cache.dtype.itemsize == 1 else 0.0
    pdl = pdl_for(k.device)
    # A cache in the model dtype has no scales: slot_mapping's pointer stands in for them (never read).
    return Launch(write_kv_cache_kernel, grid, scalars,
                  dict(PAGE_SIZE=key_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, FP8_MAX=fp8_max, PDL=pdl),
                  num_warps=4, stand_ins=None if fp8_max else {5: 4, 6: 4}, pdl=pdl)
