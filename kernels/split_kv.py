"""Split-KV partials of paged attention: where they live and the kernel that merges a request's splits by LSE.

A paged-attention launch with ``S`` splits per request writes ``[T, H, S, D]`` float32 partial outputs and
``[T, H, S]`` LSEs (``split_views``), then ``paged_attention_reduce_kernel`` merges each (token, head)'s splits into
the final ``out``/``lse``, which may be rank-major (``head_offsets``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import LOG2E, Launch, cdiv, head_strides, next_pow2
from dcp_plugin.kernels._mode import INTERPRET

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def head_offsets(head, heads_per_rank, stride_r, stride_h):
    """Offset of global head ``head`` in a plain (heads_per_rank = all) or rank-major output."""
    return (head // heads_per_rank).to(tl.int64) * stride_r + (head % heads_per_rank).to(tl.int64) * stride_h



@triton.jit(do_not_specialize=("num_splits", "stride_pl_t", "stride_pl_h", "stride_lse_r", "stride_lse_t",
                               "stride_lse_h"))
def paged_attention_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_q_heads, num_splits, head_dim,
    stride_po_t, stride_po_h, stride_po_s, stride_po_d,
    stride_pl_t, stride_pl_h, stride_pl_s,
    out_heads_per_rank, stride_o_r, stride_o_t, stride_o_h, stride_o_d,
    stride_lse_r, stride_lse_t, stride_lse_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the splits of BLOCK_H heads of one token by LSE: two passes over the splits (their maximum LSE, then
    the weighted sum), so any split count runs the same compiled kernel."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_q_heads
    lse_ptrs = part_lse_ptr + token * stride_pl_t + heads.to(tl.int64) * stride_pl_h
    lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_ptrs + s * stride_pl_s, mask=head_mask, other=float("-inf")))
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    part_ptrs = part_out_ptr + token * stride_po_t + heads.to(tl.int64)[:, None] * stride_po_h \
        + dims[None, :] * stride_po_d
    hd_mask = head_mask[:, None] & (dims[None, :] < head_dim)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(num_splits):
        weight = tl.exp2((tl.load(lse_ptrs + s * stride_pl_s, mask=head_mask, other=float("-inf"))
                          - lse_max_safe) * _LOG2E)  # exactly 0 for an empty split, whose O is not read
        part = tl.load(part_ptrs + s * stride_po_s, mask=hd_mask & (weight > 0.0)[:, None], other=0.0)
        acc += part * weight[:, None]
        total += weight
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(total > 0.0, lse_max + tl.log(total_safe), float("-inf"))
    out_rows = out_ptr + token * stride_o_t + head_offsets(heads, out_heads_per_rank, stride_o_r, stride_o_h)
    tl.store(out_rows[:, None] + dims[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    lse_rows = lse_ptr + token * stride_lse_t + head_offsets(heads, out_heads_per_rank, stride_lse_r, stride_lse_h)
    tl.store(lse_rows, lse, mask=head_mask)



def plan_split_reduce(part_out, part_lse, out, lse) -> Launch:
    """The merge of ``S`` split partials (``split_views``) into ``out [T, H, D]``/``lse [T, H]`` (plain or
    rank-major); call it with ``(part_out, part_lse, out, lse)``."""
    num_tokens, num_heads, _, head_dim = part_out.shape
    block_d = max(16, next_pow2(head_dim))
    # One program merges the splits of a few heads of one token (all heads under the interpreter, where every
    # program costs Python time).
    heads = next_pow2(num_heads) if INTERPRET else min(next_pow2(num_heads), max(1, 2048 // block_d))
    return Launch(paged_attention_reduce_kernel, (num_tokens, cdiv(num_heads, heads)),
                  (num_heads, part_out.shape[2], head_dim, *part_out.stride(), *part_lse.stride(),
                   *head_strides(out, 3), *head_strides(lse, 2)[1:]),
                  dict(BLOCK_H=heads, BLOCK_D=block_d), num_warps=4)


def split_views(buffer, num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device):
    """``[T, H, S, D]`` partial outputs and ``[T, H, S]`` LSEs, carved from ``buffer`` (or new)."""
    out_size, lse_size = num_tokens * num_heads * num_splits * head_dim, num_tokens * num_heads * num_splits
    if buffer is None or buffer.numel() < out_size + lse_size:
        buffer = torch.empty(out_size + lse_size, dtype=torch.float32, device=device)
    part_out = buffer[:out_size].view(num_tokens, num_heads, num_splits, head_dim)
    part_lse = buffer[out_size:out_size + lse_size].view(num_tokens, num_heads, num_splits)
    return part_out, part_lse
