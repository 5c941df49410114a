"""Prototype: ``gluon_chunk.py``'s current chunk as a persistent kernel, FA3's other structural difference: one
program per SM walks the (block, head) tiles, heaviest blocks first, and its producer warp streams the next tile's
K/V through the same ring of shared-memory stages while the consumer warpgroups finish the current tile (its
softmax tail, the output's store), so no SM idles between tiles on a program's start and end.

K and V come through host-built tensor descriptors over the whole ``[tokens, kv_heads * head_dim]`` tensors (FA3's
varlen way): a request's last tile may read the next request's rows, which the causal mask removes from every valid
row (their positions lie past the request's end), so its probabilities there are exactly 0.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from gluon_chunk import _softmax_step

from dcp_plugin.kernels.gluon_prefix import find_block, store_rows, write_padding

ROWS = gl.constexpr(64)  # per consumer warpgroup; a tile is 2 * ROWS query rows of one head


@gluon.jit
def _tile(query_start_loc_ptr, num_reqs, num_q_programs, num_heads, t, BLOCK: gl.constexpr):
    """Tile ``t`` -> (padding tile, has rows, request start, request length, first row, head). Tiles run heaviest
    first: ``t // num_heads`` counts flat programs from the last (``extend_attention_kernel``'s order), every head of
    one before the next; the last ``num_heads`` tiles write the rows past the last request (one per head)."""
    idx = t // num_heads
    head = t % num_heads
    is_pad = idx >= num_q_programs
    pid = gl.maximum(num_q_programs - 1 - idx, 0)
    seq, m_block = find_block(query_start_loc_ptr, num_reqs, pid, BLOCK)
    seq_start = gl.load(query_start_loc_ptr + seq)
    seq_len = gl.load(query_start_loc_ptr + seq + 1) - seq_start
    m_start = m_block * BLOCK
    return is_pad, (idx < num_q_programs) & (m_start < seq_len), seq_start, seq_len, m_start, head


@gluon.jit
def _load_tiles(k_desc, v_desc, k_smem, v_smem, ready, empty, query_start_loc_ptr, num_reqs, num_q_programs,
                num_heads, q_head_start, q_per_kv, kv_head_start, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr):
    """The producer: every tile's K/V tiles into the ring, one counter across tiles (the consumers keep the same)."""
    it = 0
    for t in range(gl.program_id(0), (num_q_programs + 1) * num_heads, gl.num_programs(0)):
        is_pad, valid, seq_start, seq_len, m_start, head = _tile(query_start_loc_ptr, num_reqs, num_q_programs,
                                                                 num_heads, t, 2 * ROWS)
        if valid:
            column = ((q_head_start + head) // q_per_kv - kv_head_start) * HEAD_DIM
            for i in range(gl.cdiv(gl.minimum(m_start + 2 * ROWS, seq_len), BLOCK_N)):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [seq_start + i * BLOCK_N, column], ready.index(s),
                                                k_smem.index(s))
                tma.async_copy_global_to_shared(v_desc, [seq_start + i * BLOCK_N, column], ready.index(s),
                                                v_smem.index(s))
                it += 1


@gluon.jit
def _attend_tiles(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, query_start_loc_ptr, num_tokens, num_reqs,
                  num_q_programs, num_heads, qk_scale, row_offset, stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_lt, stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  WRITES_PADDING: gl.constexpr):
    """A consumer warpgroup: rows ``row_offset .. row_offset + ROWS`` of every tile (``gluon_chunk._attend_rows``'s
    loop); ``WRITES_PADDING``: this one writes the padding tiles' rows as (0, -inf)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    it = 0
    for t in range(gl.program_id(0), (num_q_programs + 1) * num_heads, gl.num_programs(0)):
        is_pad, valid, seq_start, seq_len, m_start, head = _tile(query_start_loc_ptr, num_reqs, num_q_programs,
                                                                 num_heads, t, 2 * ROWS)
        if is_pad:
            if WRITES_PADDING:
                write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens,
                              head.to(gl.int64) * stride_oh, head.to(gl.int64) * stride_lh, stride_ot, stride_lt,
                              ROWS, HEAD_DIM)
        elif valid:
            row0 = m_start + row_offset
            rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
            row_ok = gl.expand_dims(rows_io < seq_len, 1)
            q = gl.load(q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1)
                        + head.to(gl.int64) * stride_qh + gl.expand_dims(cols_io, 0), mask=row_ok, other=0.0)
            q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
            offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
            l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
            n_tiles = gl.cdiv(gl.minimum(m_start + 2 * ROWS, seq_len), BLOCK_N)
            n_unmasked = m_start // BLOCK_N
            for i in range(n_unmasked):  # tiles wholly below the tile's first row
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_m, offs_n,
                                              i * BLOCK_N, False, qk_layout, acc_layout, dtype)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(s), count=1)
                it += 1
            for i in range(n_unmasked, n_tiles):  # the tiles the causal mask cuts
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_m, offs_n,
                                              i * BLOCK_N, True, qk_layout, acc_layout, dtype)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(s), count=1)
                it += 1
            store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len,
                       head.to(gl.int64) * stride_oh, head.to(gl.int64) * stride_lh, stride_ot, stride_lt,
                       acc_layout, io_layout)


@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def chunk_attention_persistent_kernel(q_ptr, k_desc, v_desc, out_ptr, lse_ptr, query_start_loc_ptr, num_tokens,
                                      num_reqs, num_q_programs, num_heads, qk_scale, q_head_start, q_per_kv,
                                      kv_head_start, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                                      stride_lh, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                                      STAGES: gl.constexpr):
    """Grid (programs,), at most one per SM; ``num_q_programs``: ``_schedule.flat_programs`` of 128-row blocks."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
    gl.warp_specialize([
        (_attend_tiles, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, query_start_loc_ptr, num_tokens,
                         num_reqs, num_q_programs, num_heads, qk_scale, 0, stride_qt, stride_qh, stride_ot,
                         stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES, True)),
        (_attend_tiles, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, query_start_loc_ptr, num_tokens,
                         num_reqs, num_q_programs, num_heads, qk_scale, ROWS, stride_qt, stride_qh, stride_ot,
                         stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES, False)),
        (_load_tiles, (k_desc, v_desc, k_smem, v_smem, ready, empty, query_start_loc_ptr, num_reqs, num_q_programs,
                       num_heads, q_head_start, q_per_kv, kv_head_start, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [232, 40])
