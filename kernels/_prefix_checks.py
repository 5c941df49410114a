"""``prefix_attention``'s argument checks: one clear line naming a bad argument, before any work is done."""

from __future__ import annotations

import numbers

import torch

from dcp_plugin.kernels._launch import (
    INDEX_DTYPES, check_head_map, check_heads_out, check_int, check_kernel_tensor, check_shape,
)
from dcp_plugin.kernels.checks import FP8_DTYPES, check_kv_scales

MAX_HEAD_DIM = 256
MAX_SPLITS = 256  # explicit num_splits upper bound


def checked_outputs(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, *, scale, q_head_start,
                    q_per_kv, kv_head_start, max_kv_len, max_query_len, num_splits, out, lse, k_scale, v_scale):
    """``prefix_attention``'s arguments checked, one clear line for a bad one -> ``(out, lse)``, made if None."""
    check_kernel_tensor("q", q, ndim=3)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    check_kernel_tensor("key_cache", key_cache, ndim=4, dtypes=(q.dtype, *FP8_DTYPES), device=device)
    check_kernel_tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), device=device)
    check_kv_scales(key_cache.dtype, k_scale, v_scale, device)
    check_shape("key_cache", key_cache, (None, None, None, head_dim))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    _, page_size, num_kv_heads, _ = key_cache.shape
    check_kernel_tensor("kv_lens", kv_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_reqs = kv_lens.shape[0]
    check_kernel_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    check_kernel_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but kv_lens has {num_reqs} requests")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} (q.shape[-1]) is not supported; use 1..{MAX_HEAD_DIM}")
    if page_size < 1:
        raise ValueError(f"key_cache block size (dim 1) must be >= 1, got {page_size}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    check_head_map(num_q_heads=num_q_heads, q_head_start=q_head_start, q_per_kv=q_per_kv,
                   kv_head_start=kv_head_start, num_kv_heads=num_kv_heads, kv_name="key_cache")
    check_int("max_kv_len", max_kv_len, low=0, high=block_table.shape[1] * page_size)
    if max_query_len is not None:
        check_int("max_query_len", max_query_len, low=0)
    if num_splits is not None:
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)
    if out is not None:
        check_heads_out("out", out, (num_tokens, num_q_heads, head_dim), device)
    out, lse = outputs(q, out, lse)
    check_heads_out("lse", lse, (num_tokens, num_q_heads), device, dtypes=(torch.float32,))
    if (out.dim() == 4) != (lse.dim() == 3) or out.dim() == 4 and out.shape[0] != lse.shape[0]:
        raise ValueError(f"out {tuple(out.shape)} and lse {tuple(lse.shape)} must both be plain ([T, Hq, ...]) or "
                         "both rank-major over the same number of ranks")
    return out, lse


def outputs(q, out, lse) -> tuple:
    """``(out, lse)``, each made where None: ``out`` ``[T, Hq, D]`` in q's dtype, ``lse`` ``[T, Hq]`` float32
    (rank-major ``[R, T, Hq / R]`` beside a rank-major ``out``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
        if out.dim() == 4:
            lse = lse.view(num_tokens, out.shape[0], -1).transpose(0, 1)
    return out, lse
