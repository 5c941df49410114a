"""Prototype: the DCP prefix pass (a chunk's query rows against the request's cached tokens, non-causal, over a
paged cache) in Gluon for sm_90, with key tiles of several pages: the ``tl`` kernel dcp-triton ships takes one
64-token page per tensor-descriptor copy and so 64-key tiles, and each tile pays the softmax's fixed costs (the row
maxima and sums, the accumulator's rescale) over 64 keys; FA3 takes 176-key tiles for non-causal attention. Here a
producer warp copies ``PAGES`` pages (``block_table`` entries) into the halves or thirds of one shared-memory tile,
and two consumer warpgroups of 64 query rows run ``gluon_chunk._attend_rows``'s loop over ``PAGES * PAGE`` keys.

Launched like ``gluon_chunk.chunk_attention_kernel`` (flat varlen numbering of 128-row blocks, programs in reverse,
the padding rows' program); caches ``[pages, PAGE, kv_heads, head_dim]`` with heads contiguous, read through host
descriptors over ``[pages * PAGE, kv_heads * head_dim]``. A request with no cached tokens gets (0, -inf).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from gluon_chunk import _find_block, _store_rows, _write_padding

ROWS = gl.constexpr(64)  # per consumer warpgroup; a program's block is 2 * ROWS query rows of one head


@gluon.jit
def _load_pages(k_desc, v_desc, k_smem, v_smem, ready, empty, table_ptr, n_pages, n_tiles, column,
                PAGE: gl.constexpr, PAGES: gl.constexpr, STAGES: gl.constexpr):
    """The producer: tile i is pages ``PAGES * i ..`` of the request's table (page 0 past its last page: those keys
    are masked), one mbarrier for all its copies."""
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), PAGES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for j in gl.static_range(PAGES):
            entry = i * PAGES + j
            page = gl.load(table_ptr + entry, mask=entry < n_pages, other=0)
            tma.async_copy_global_to_shared(k_desc, [page * PAGE, column], ready.index(s),
                                            k_smem.index(s).slice(j * PAGE, PAGE))
            tma.async_copy_global_to_shared(v_desc, [page * PAGE, column], ready.index(s),
                                            v_smem.index(s).slice(j * PAGE, PAGE))


@gluon.jit
def _step(acc, l_i, m_i, qk, v_tile, qk_scale, offs_n, n_start, kv_len, MASKED: gl.constexpr,
          acc_layout: gl.constexpr, dtype: gl.constexpr):
    if MASKED:  # the last tile: keys past the cached length
        qk = gl.where(gl.expand_dims(n_start + offs_n < kv_len, 0), qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    return warpgroup_mma(p_op, v_tile, acc, is_async=True), l_i, m_new


@gluon.jit
def _zero_rows_past(v_tile, v_fix, valid, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``v_fix`` = ``v_tile`` with rows ``valid ..`` zeroed, 32 rows at a time (this warpgroup's own copy)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(BLOCK_N // 32):
        part = v_tile.slice(c * 32, 32).load(layout)
        v_fix.slice(c * 32, 32).store(gl.where(gl.expand_dims(c * 32 + rows < valid, 1), part, 0.0).to(part.dtype))
    fence_async_shared()


@gluon.jit
def _attend_prefix_rows(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, v_fix, ready, empty, n_tiles, kv_len, row0,
                        seq_start, seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                        stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """A consumer warpgroup: query rows ``row0 .. row0 + ROWS`` against every tile, the last one masked."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    row_ok = gl.expand_dims(rows_io < seq_len, 1)
    q = gl.load(q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1)
                + head.to(gl.int64) * stride_qh + gl.expand_dims(cols_io, 0), mask=row_ok, other=0.0)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    for i in range(n_tiles - 1):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        acc, l_i, m_i = _step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_n, i * BLOCK_N, kv_len, False,
                              acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    if n_tiles > 0:
        last = n_tiles - 1
        s = last % STAGES
        mbarrier.wait(ready.index(s), (last // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        v_last = v_smem.index(s)
        if kv_len % BLOCK_N != 0:  # rows past the cached length hold anything (NaN too): 0 x NaN would be NaN
            _zero_rows_past(v_smem.index(s), v_fix, kv_len - last * BLOCK_N, BLOCK_N, HEAD_DIM)
            v_last = v_fix
        acc, l_i, m_i = _step(acc, l_i, m_i, qk, v_last, qk_scale, offs_n, last * BLOCK_N, kv_len, True,
                              acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    _store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len, head, stride_ot,
                stride_oh, stride_lt, stride_lh, acc_layout, io_layout)  # no cached token: (0, -inf)


@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def prefix_attention_kernel(q_ptr, k_desc, v_desc, out_ptr, lse_ptr, query_start_loc_ptr, table_ptr, kv_lens_ptr,
                            num_tokens, num_reqs, num_q_programs, qk_scale, q_head_start, q_per_kv, kv_head_start,
                            stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_lh,
                            HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PAGES: gl.constexpr, STAGES: gl.constexpr):
    """Grid (num_q_programs + 1, local Q heads), ``gluon_chunk.chunk_attention_kernel``'s numbering."""
    BLOCK_N: gl.constexpr = PAGE * PAGES
    pid = gl.num_programs(0) - 1 - gl.program_id(0)
    head = gl.program_id(1)
    if pid >= num_q_programs:
        _write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens, head, stride_ot, stride_oh,
                       stride_lt, stride_lh, 2 * ROWS, HEAD_DIM)
        return
    seq, m_block = _find_block(query_start_loc_ptr, num_reqs, pid, 2 * ROWS)
    seq_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    seq_len = (gl.load(query_start_loc_ptr + seq + 1) - gl.load(query_start_loc_ptr + seq)).to(gl.int32)
    m_start = (m_block * (2 * ROWS)).to(gl.int32)
    if m_start < seq_len:
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_len = gl.load(kv_lens_ptr + seq)
        n_pages = gl.cdiv(kv_len, PAGE)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        column = ((q_head_start + head) // q_per_kv - kv_head_start) * HEAD_DIM
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_fix = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem_layout)  # a last V tile each
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
        table = table_ptr + seq.to(gl.int64) * stride_bt
        gl.warp_specialize([
            (_attend_prefix_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, v_fix.index(0), ready, empty, n_tiles,
                                   kv_len, m_start, seq_start, seq_len, qk_scale, head, stride_qt, stride_qh,
                                   stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES)),
            (_attend_prefix_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, v_fix.index(1), ready, empty, n_tiles,
                                   kv_len, m_start + ROWS, seq_start, seq_len, qk_scale, head, stride_qt, stride_qh,
                                   stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES)),
            (_load_pages, (k_desc, v_desc, k_smem, v_smem, ready, empty, table, n_pages, n_tiles, column, PAGE,
                           PAGES, STAGES)),
        ], [4, 1], [232, 40])
