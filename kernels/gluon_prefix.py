"""The prefix pass on Hopper in Triton's Gluon dialect: 128 query rows of one Q head against a request's cached
tokens over 64-token pages, in key tiles of two pages, with a schedule ``tl`` cannot express on sm_90.

A producer warp copies each key tile's two pages (two ``block_table`` entries) through TMA into a ring of
shared-memory stages, on mbarriers (no program-wide barrier); two consumer warpgroups, 64 query rows each, run
QK^T -> softmax -> P x V on warpgroup MMAs, each at its own pace. The ``tl`` kernel takes one page per copy and so
64-key tiles, and pays the softmax's per-tile costs (row maxima and sums, the accumulator's rescale) twice as often.
H200, bf16, 32 Q / 8 KV heads: 580 TFLOP/s at 2 x 4096 rows over 32K cached and 589 at 1 x 2048 over 128K,
against 518 / 510 for the ``tl`` kernel and 582 / 567 for FA3 in the same process
(``benchmarks/probes/gluon_chunk_probe.py``; docs/kernels.md, prefix pass).

Imported only where ``_gluon.prefix_takes_gluon`` allows it (Triton 3.6, sm_90, unless ``DCP_TRITON_GLUON=0``);
``plan_prefix`` picks it for query blocks of a prefill step read in one split, else the ``tl`` kernel runs.
Semantics are ``prefix_attention``'s: programs numbered over the batch like ``chunk_attention_kernel``
(``_schedule``), one per (block of 128 rows, local Q head), plus one per head for the rows past
``query_start_loc[num_reqs]`` (written as (0, -inf)); a request with no cached tokens gets (0, -inf); plain or
rank-major ``out``/``lse``. The last tile's V rows past the context are zeroed into a copy before P x V (their
probabilities are 0, but 0 x NaN is NaN).
"""

from __future__ import annotations

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from dcp_plugin.kernels._gluon import PREFIX_PAGE
from dcp_plugin.kernels._launch import LOG2E, Launch, head_strides
from dcp_plugin.kernels._schedule import flat_programs
from dcp_plugin.kernels.gluon_parts import (
    attend_overlap, find_block, head_offset, load_pages, online_step, ring_buffers, store_rows, v_operand,
    write_padding,
)

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup; a program's block is 2 * ROWS rows of one Q head
PAGE = PREFIX_PAGE  # the page size this kernel serves (``_gluon.prefix_takes_gluon``)
PAGES = 2  # pages per key tile
STAGES = 3  # key tiles in flight (two with the last tile's V copies, 192 KiB of shared memory; three: PRODUCER_FIX)
# PRODUCER_FIX: the producer zeroes the last V tile's rows past the context in place (``zero_tail_in_place``), so no
# V copies, and three stages fit; OVERLAP: FA3's order in each consumer warpgroup (``overlap_tile``), which holds
# two stages at a time and so wants three. Both off: each consumer zeroes into its own copy, and a tile's QK^T,
# softmax and P x V run in turn. Both on (with three stages): 634 / 647 TFLOP/s at 2 x 4K rows over 32K / 1 x 2K over
# 128K, 32 Q / 8 KV, against 580 / 584 with both off and 487 / 484 with OVERLAP over two stages
# (code 320db48; docs/kernels.md, prefix pass).
PRODUCER_FIX = True
OVERLAP = True


@gluon.jit
def _attend_rows(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, v_fix, ready, empty, fixed, n_tiles, kv_len, row0,
                 seq_start, seq_len, qk_scale, q_head, out_head, lse_head, stride_qt, stride_ot, stride_lt,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PRODUCER_FIX: gl.constexpr,
                 OVERLAP: gl.constexpr):
    """A consumer warpgroup: query rows ``row0 .. row0 + ROWS`` against every tile, the last one masked; each tile's
    steps in turn, or in FA3's order (``OVERLAP``, ``overlap_tile``)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    q = gl.load(q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1) + q_head
                + gl.expand_dims(cols_io, 0), mask=gl.expand_dims(rows_io < seq_len, 1), other=0.0)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    last = n_tiles - 1
    if OVERLAP:
        acc, m_i, l_i, _ = attend_overlap(q_op, k_smem, v_smem, v_fix, ready, empty, fixed, acc, m_i, l_i, n_tiles,
                                          kv_len, qk_scale, offs_m, offs_n, zero_qk, 0, gl.to_tensor(0), BLOCK_N,
                                          STAGES, PRODUCER_FIX, acc_layout, dtype)
    else:
        for i in range(last):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            acc, l_i, m_i = online_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, acc_layout, dtype)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
        if n_tiles > 0:
            s = last % STAGES
            mbarrier.wait(ready.index(s), (last // STAGES) & 1)
            qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            v_last, _ = v_operand(v_smem, v_fix, fixed, s, gl.to_tensor(0), last, kv_len, BLOCK_N, PRODUCER_FIX)
            qk = gl.where(gl.expand_dims(last * BLOCK_N + offs_n < kv_len, 0), qk, float("-inf"))  # past the context
            acc, l_i, m_i = online_step(acc, l_i, m_i, qk, v_last, qk_scale, acc_layout, dtype)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
    store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len, out_head, lse_head,
               stride_ot, stride_lt, acc_layout, io_layout)  # no cached token: (0, -inf)


# Not specialized on, as in ``prefix_attention_kernel``: per-step sizes and the LSE strides that scale with them, the
# block table's row stride (the engine's table width, which the warm-up cannot know), ``tma_rows``, and the batch
# tables' alignment (a mixed step's requests after its decodes start mid-tensor): one variant serves every step.
@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs", "stride_bt_req", "stride_lr", "stride_lt",
                              "stride_lh", "tma_rows"),
           do_not_specialize_on_alignment=("block_table_ptr", "kv_lens_ptr", "query_start_loc_ptr"))
def gluon_prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, query_start_loc_ptr,
                        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, num_tokens, num_reqs, num_q_programs, qk_scale,
                        q_head_start, q_per_kv, kv_head_start, stride_qt, stride_qh, stride_k_tok, stride_k_h,
                        stride_v_tok, stride_v_h, stride_bt_req, stride_bt_blk, rows_per_block, tma_rows,
                        out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_lr, stride_lt, stride_lh,
                        HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PAGES: gl.constexpr, STAGES: gl.constexpr,
                        PRODUCER_FIX: gl.constexpr, OVERLAP: gl.constexpr):
    """Grid (num_q_programs + 1, local Q heads); programs in reverse (each request's last blocks first); the last
    program of each head writes the padding rows. ``k_scale_ptr``/``v_scale_ptr`` are never read (no fp8)."""
    BLOCK_N: gl.constexpr = PAGE * PAGES
    pid = gl.num_programs(0) - 1 - gl.program_id(0)
    head = gl.program_id(1)
    out_head = head_offset(head, out_heads_per_rank, stride_or, stride_oh)
    lse_head = head_offset(head, out_heads_per_rank, stride_lr, stride_lh)
    if pid >= num_q_programs:
        write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens, out_head, lse_head, stride_ot,
                      stride_lt, 2 * ROWS, HEAD_DIM)
        return
    seq, m_block = find_block(query_start_loc_ptr, num_reqs, pid, 2 * ROWS)
    seq_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    seq_len = (gl.load(query_start_loc_ptr + seq + 1) - gl.load(query_start_loc_ptr + seq)).to(gl.int32)
    m_start = (m_block * (2 * ROWS)).to(gl.int32)
    if (m_start >= 0) & (m_start < seq_len):  # ids before the first request's own (query_start_loc[0] > 0): none
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_len = gl.load(kv_lens_ptr + seq).to(gl.int32)
        n_pages = gl.cdiv(kv_len, PAGE)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        kv_head = ((q_head_start + head) // q_per_kv - kv_head_start).to(gl.int64)
        k_smem, v_smem, ready, empty, fixed, fix_0, fix_1 = ring_buffers(dtype, STAGES, BLOCK_N, HEAD_DIM,
                                                                         PRODUCER_FIX, 2)
        table = block_table_ptr + seq.to(gl.int64) * stride_bt_req
        q_head = head.to(gl.int64) * stride_qh
        gl.warp_specialize([
            (_attend_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, fix_0, ready, empty, fixed, n_tiles, kv_len,
                            m_start, seq_start, seq_len, qk_scale, q_head, out_head, lse_head, stride_qt, stride_ot,
                            stride_lt, BLOCK_N, HEAD_DIM, STAGES, PRODUCER_FIX, OVERLAP)),
            (_attend_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, fix_1, ready, empty, fixed, n_tiles, kv_len,
                            m_start + ROWS, seq_start, seq_len, qk_scale, q_head, out_head, lse_head, stride_qt,
                            stride_ot, stride_lt, BLOCK_N, HEAD_DIM, STAGES, PRODUCER_FIX, OVERLAP)),
            (load_pages, (k_cache_ptr + kv_head * stride_k_h, v_cache_ptr + kv_head * stride_v_h, tma_rows,
                           stride_k_tok, stride_v_tok, k_smem, v_smem, ready, empty, fixed, table, stride_bt_blk,
                           rows_per_block, n_pages, n_tiles, kv_len, HEAD_DIM, PAGE, PAGES, STAGES, PRODUCER_FIX)),
        ], [4, 1], [232, 40])


def plan_gluon_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, *, scale,
                      q_head_start, q_per_kv, kv_head_start, stages: int = STAGES,
                      producer_fix: bool = PRODUCER_FIX, overlap: bool = OVERLAP) -> Launch:
    """``gluon_prefix_kernel`` prepared for tensors like these, called like ``prefix_attention_kernel``'s ``Launch``
    (``(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, k_scale, v_scale)``);
    the caller checked ``_gluon.prefix_takes_gluon``. ``stages``, ``producer_fix``, ``overlap``: ``STAGES``,
    ``PRODUCER_FIX``, ``OVERLAP`` (benchmarks time each)."""
    if stages > 2 and not producer_fix:  # the two V copies and three stages: 256 KiB of shared memory (227 fit)
        raise ValueError(f"stages={stages} needs producer_fix=True (the V copies then leave room); use stages=2")
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs = kv_lens.shape[0]
    num_q_programs = flat_programs(num_tokens, num_reqs, 2 * ROWS.value)
    out_heads_per_rank, stride_or, stride_ot, stride_oh, _ = head_strides(out, 3)
    _, stride_lr, stride_lt, stride_lh = head_strides(lse, 2)
    rows_per_block = key_cache.stride(0) // key_cache.stride(1)
    grid = (num_q_programs + 1, num_q_heads) if num_tokens and num_q_heads else (0,)
    return Launch(
        gluon_prefix_kernel, grid,
        (num_tokens, num_reqs, num_q_programs, float(scale) * LOG2E, q_head_start, q_per_kv, kv_head_start,
         q.stride(0), q.stride(1), key_cache.stride(1), key_cache.stride(2), value_cache.stride(1),
         value_cache.stride(2), *block_table.stride(), rows_per_block, rows_per_block * key_cache.shape[0],
         out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_lr, stride_lt, stride_lh),
        dict(HEAD_DIM=head_dim, PAGE=PAGE, PAGES=PAGES, STAGES=stages, PRODUCER_FIX=bool(producer_fix),
             OVERLAP=bool(overlap)),
        num_warps=4, scratch=True, stand_ins={8: 0, 9: 0})  # no scales: q's pointer stands in (never read)

