"""The inner step of the prefix pass (``paged_attention_kernel``): one tile of cached tokens read through the block
table and folded into the online softmax of a tile of query rows."""

import triton
import triton.language as tl

from dcp_plugin.kernels._launch import descriptor_ready, next_pow2, tma_available


@triton.jit
def attend_cached_tile(acc, l_i, m_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, n_start, kv_end, dims,
                       dim_mask, qk_scale, stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok,
                       stride_vc_d, stride_bt_blk, rows_per_block, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASK_TOKENS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       KV_FP8: tl.constexpr, USE_TMA: tl.constexpr):
    """One online-softmax step over cached tokens ``n_start + [0, BLOCK_N)``; scores in base-2 units.
    ``MASK_TOKENS``: the tile may pass ``kv_end`` (it always holds at least one token before it). ``USE_TMA``: the
    tile lies inside one page (``BLOCK_N`` divides ``PAGE_SIZE``) and comes through the tensor descriptors, whose
    row ``page * rows_per_block + i`` is the page's token ``i``."""
    pos = n_start + tl.arange(0, BLOCK_N)
    pos_mask = pos < kv_end
    if USE_TMA:
        page = tl.load(table_ptr + (n_start // PAGE_SIZE) * stride_bt_blk).to(tl.int32)
        row = page * rows_per_block + tl.cast(n_start % PAGE_SIZE, tl.int32)  # < 2^31: checked on the host
        k = k_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
        v = v_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
        if MASK_TOKENS:  # the page's rows past kv_end hold anything (NaN too): they must add exactly nothing
            v = tl.where(pos_mask[:, None], v, tl.zeros_like(v))
        k = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    else:
        # Per-token page lookup: any page size works, tiles may span pages.
        if MASK_TOKENS:
            page = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_bt_blk, mask=pos_mask, other=0).to(tl.int64)
        else:
            page = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_bt_blk).to(tl.int64)
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        k_ptrs = k_head_ptr + (page * stride_kc_blk + in_page * stride_kc_tok)[None, :] + dims[:, None] * stride_kc_d
        v_ptrs = v_head_ptr + (page * stride_vc_blk + in_page * stride_vc_tok)[:, None] + dims[None, :] * stride_vc_d
        if MASK_TOKENS:
            k = tl.load(k_ptrs, mask=dim_mask[:, None] & pos_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(v_ptrs, mask=pos_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif not EVEN_D:
            k = tl.load(k_ptrs, mask=dim_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if KV_FP8:  # dequantize in registers (the scales are applied to scores and output)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASK_TOKENS:
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
    # The scale (> 0) is applied to the row maximum and folded into the exponent's argument: one FMA per score.
    # Every tile holds a cached token, so each row's max is finite (no -inf - -inf).
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


def cache_takes_descriptors(key_cache, value_cache, head_dim: int, block_n: int) -> bool:
    """Whether whole tiles can come through tensor descriptors: the GPU has them (``tma_available``), a tile lies
    inside one page (``block_n`` divides the page size), the head dim is a power of two, and each cache reads as a
    2-D tensor of token rows (per KV head; unit stride along D, 16-byte aligned base and strides, the block stride a
    whole number of token strides, the same for K and V, and fewer than 2^31 rows: 32-bit descriptor offsets)."""
    num_blocks, page_size = key_cache.shape[:2]
    if not tma_available(key_cache.device) or head_dim != next_pow2(head_dim) or page_size % block_n:
        return False
    blk, tok = key_cache.stride()[:2]
    if tok < 1 or blk % tok:
        return False
    if not all(t.stride()[:2] == (blk, tok) and descriptor_ready(t, (0, 1, 2)) for t in (key_cache, value_cache)):
        return False
    return num_blocks * (blk // tok) < 2 ** 31
