"""A candidate Hopper variant of the current-chunk kernel, timed by ``sweep_kernels.py`` beside the shipped one:
K and V tiles through tensor descriptors (TMA on sm_90: one bulk copy per tile, no per-thread address math),
optionally with Triton's warp specialization of the key loop. Each program builds its descriptors on the device
over its own sequence (``shape = [seq_len, D]``), so rows past the sequence read as zeros, as the masked loads of
the shipped kernel do. Not used by the library; it stays here until a sweep shows it pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import LOG2E, cdiv
from dcp_plugin.kernels._schedule import find_block, flat_programs

_ALLOCATOR_SET = False


@triton.jit
def _step(acc, l_i, m_i, q, k, v, offs_m, offs_kn, qk_scale, IS_DIAGONAL: tl.constexpr):
    qk = tl.dot(q, tl.trans(k))
    if IS_DIAGONAL:
        qk = tl.where(offs_m[:, None] >= offs_kn[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def extend_tma_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr, num_tokens, num_reqs,
                      num_q_programs, qk_scale, q_head_start, q_per_kv, kv_head_start, stride_qt, stride_qh,
                      stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr):
    LN2: tl.constexpr = 0.6931471805599453
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if pid >= num_q_programs:
        return  # the sweep's batches have no padding rows
    seq, m_block = find_block(query_start_loc_ptr, num_reqs, pid, BLOCK_M)
    seq_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)
    m_start = m_block * BLOCK_M
    if m_start >= seq_len:
        return
    kv_head = ((q_head_start + head) // q_per_kv - kv_head_start).to(tl.int64)
    offs_m += m_start
    rows = seq_start + offs_m
    m_mask = offs_m < seq_len
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)
    k_desc = tl.make_tensor_descriptor(k_ptr + seq_start * stride_kt + kv_head * stride_kh, shape=[seq_len, HEAD_DIM],
                                       strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr + seq_start * stride_vt + kv_head * stride_vh, shape=[seq_len, HEAD_DIM],
                                       strides=[stride_vt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n_start in tl.range(0, m_start, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([n_start, 0])
        v = v_desc.load([n_start, 0])
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, offs_m, n_start + offs_n, qk_scale, IS_DIAGONAL=False)
    for n_start in range(m_start, tl.minimum(m_start + BLOCK_M, seq_len), BLOCK_N):
        k = k_desc.load([n_start, 0])
        v = v_desc.load([n_start, 0])
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, offs_m, n_start + offs_n, qk_scale, IS_DIAGONAL=True)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    tl.store(lse_ptr + rows * stride_lt + head.to(tl.int64) * stride_lh, (m_i + tl.log2(l_i)) * LN2, mask=m_mask)


def extend_tma(q, k, v, query_start_loc, *, scale, q_per_kv, block_m, block_n, num_warps, num_stages,
               warp_specialize, out, lse):
    """``extend_attention``'s contract for the sweep's inputs (unit stride along D, no padding rows)."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:  # device-side descriptors live in a per-launch scratch buffer
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs = query_start_loc.shape[0] - 1
    programs = flat_programs(num_tokens, num_reqs, block_m)
    extend_tma_kernel[(programs + cdiv(num_tokens, block_m), num_q_heads)](
        q, k, v, out, lse, query_start_loc, num_tokens, num_reqs, programs, float(scale) * LOG2E, 0, q_per_kv, 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1), HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        WARP_SPECIALIZE=warp_specialize, num_warps=num_warps, num_stages=num_stages)
    return out, lse
