"""Decode on Hopper in Triton's Gluon dialect: one query row per request, the Q heads of one KV group as the rows
of a warpgroup MMA, against a KV split of the request's cached tokens over 64-token pages.

A program owns (request, tile of up to ``ROWS`` Q heads of one KV group, KV split). A producer warp copies each key
tile's pages through TMA into a ring of shared-memory stages on mbarriers and zeroes the last tile's V rows past the
context in place (``gluon_prefix``'s producer); one consumer warpgroup runs QK^T -> softmax -> P x V in FA3's order
(``gluon_parts.attend_overlap``). Rows past the group are masked, so a group fills its share of the 64 rows: hence
only groups of more than ``_gluon.GLUON_DECODE_MIN_GROUP`` take it. The ``tl`` decode kernel waits on its copies in
the same instruction stream that computes: with 32 Q heads over one KV head and 64-token pages it ran at 0.83x-0.92x
of FA3's speed, this one at 0.84x-1.02x, in one run (benchmarks/results/kernels_h200_gluon_decode.json, runs[1]).

Semantics are ``paged_attention``'s decode variant (``max_query_len == 1``): request ``b``'s row is
``query_start_loc[b]`` (none when the request has no row); a request with no cached tokens, and an empty split, get
(0, -inf); rows past ``query_start_loc[num_reqs]`` (a CUDA graph's padding) get (0, -inf) from the last program of
each (head tile, split). ``plan_paged`` picks it where ``_gluon.decode_takes_gluon`` allows and owns the split
partials and their merge; with one split it writes ``out``/``lse`` (plain or rank-major) directly.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dcp_plugin.kernels._gluon import PREFIX_PAGE
from dcp_plugin.kernels._launch import LOG2E, Launch
from dcp_plugin.kernels.gluon_parts import attend_overlap, head_offset, load_pages, ring_buffers

ROWS = gl.constexpr(64)  # Q heads of one KV group per program: a warpgroup MMA's rows (the heads past it masked)
PAGE = PREFIX_PAGE
# One page per key tile, four in flight: H200, bf16, 64-token pages, at 8 x 1K / 8 x 8K with 8 KV heads and 1 x 32K /
# 32 x 8K / 128 x 8K with one, 18.2 / 71.4 and 19.1 / 45.8 / 131.0 us against 19.8 / 72.2 and 20.2 / 46.9 / 131.1
# for two pages and three stages (128 x 8K, 8 KV heads: 967 against 964); 1 x 6: 20.2 / 74.3 and 20.1 / 47.4 / 134.1
# (benchmarks/results/kernels_h200_gluon_decode.json, runs[0]).
PAGES = 1  # pages per key tile
STAGES = 4  # key tiles in flight


@gluon.jit
def _attend_heads(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, fixed, n_tiles, kv_len, token, head_lo,
                  head_hi, qk_scale, stride_qh, out_base, lse_base, out_heads_per_rank, stride_or, stride_oh,
                  stride_lr, stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The consumer warpgroup: the tile's heads (row ``r`` = local Q head ``head_lo + r``) against the split's
    ``n_tiles`` key tiles (keys at or past ``kv_len``, counted from the split's first key, masked), then
    ``acc / l`` and the LSE at ``out_base``/``lse_base`` (the token's row, and the split's) plus each head's offset;
    no key: (0, -inf)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads_io = head_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    live_io = gl.expand_dims(heads_io < head_hi, 1)
    q = gl.load(q_ptr + gl.expand_dims(heads_io.to(gl.int64) * stride_qh, 1) + gl.expand_dims(cols_io, 0),
                mask=live_io, other=0.0)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
    offs_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    acc, m_i, l_i = attend_overlap(q_op, k_smem, v_smem, v_smem.index(0), ready, empty, fixed, acc, m_i, l_i,
                                   n_tiles, kv_len, qk_scale, offs_m, offs_n, zero_qk, BLOCK_N, STAGES, True,
                                   acc_layout, dtype)
    empty_row = l_i == 0.0
    l_acc = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, acc_layout))
    out = gl.convert_layout((acc / gl.expand_dims(l_acc, 1)).to(out_ptr.dtype.element_ty), io_layout)
    gl.store(out_ptr + out_base + gl.expand_dims(head_offset(heads_io, out_heads_per_rank, stride_or, stride_oh), 1)
             + gl.expand_dims(cols_io, 0), out, mask=live_io)
    heads_m = head_lo + offs_m
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    gl.store(lse_ptr + lse_base + head_offset(heads_m, out_heads_per_rank, stride_lr, stride_lh), lse,
             mask=heads_m < head_hi)


@gluon.jit
def _write_padding(out_ptr, lse_ptr, first, num_tokens, head_lo, head_hi, out_split, lse_split, out_heads_per_rank,
                   stride_or, stride_ot, stride_oh, stride_lr, stride_lt, stride_lh, HEAD_DIM: gl.constexpr):
    """Rows ``first .. num_tokens`` of the tile's heads (this split's partial, or ``out``/``lse``) as (0, -inf)."""
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = head_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    live = heads < head_hi
    out_heads = gl.expand_dims(head_offset(heads, out_heads_per_rank, stride_or, stride_oh), 1) \
        + gl.expand_dims(cols, 0)
    lse_heads = head_offset(heads, out_heads_per_rank, stride_lr, stride_lh)
    zeros = gl.zeros([ROWS, HEAD_DIM], out_ptr.dtype.element_ty, layout=io_layout)
    minus_inf = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, io_layout))
    for t in range(first, num_tokens):
        gl.store(out_ptr + (t * stride_ot + out_split) + out_heads, zeros, mask=gl.expand_dims(live, 1))
        gl.store(lse_ptr + (t * stride_lt + lse_split) + lse_heads, minus_inf, mask=live)


# Not specialized on, as in ``paged_attention_kernel``: per-step sizes, the split count and the strides that scale
# with them, the block table's row stride, ``tma_rows``, and the batch tables' alignment: one variant per split-or-not
# serves every step.
@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_splits", "stride_bt_req", "stride_ot", "stride_os",
                              "stride_lr", "stride_lt", "stride_lh", "stride_ls", "tma_rows"),
           do_not_specialize_on_alignment=("block_table_ptr", "context_lens_ptr", "query_start_loc_ptr"))
def gluon_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr, query_start_loc_ptr,
                        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, num_tokens, num_reqs, num_q_heads, num_splits,
                        qk_scale, q_head_start, q_per_kv, kv_head_start, first_kv_head, head_tiles_per_group,
                        stride_qt, stride_qh, stride_k_tok, stride_k_h, stride_v_tok, stride_v_h, stride_bt_req,
                        stride_bt_blk, rows_per_block, tma_rows, out_heads_per_rank, stride_or, stride_ot, stride_oh,
                        stride_os, stride_lr, stride_lt, stride_lh, stride_ls, HEAD_DIM: gl.constexpr,
                        PAGE: gl.constexpr, PAGES: gl.constexpr, STAGES: gl.constexpr):
    """Grid (num_reqs + 1, head tiles, splits): program ``num_reqs`` writes the padding rows. Head tiles as
    ``_schedule.group_head_tile`` numbers them, ``ROWS`` heads each. ``k_scale_ptr``/``v_scale_ptr``: never read."""
    BLOCK_N: gl.constexpr = PAGE * PAGES
    req = gl.program_id(0)
    pid_h = gl.program_id(1)
    split = gl.program_id(2)
    kv_head = first_kv_head + pid_h // head_tiles_per_group
    group_lo = (kv_head + kv_head_start) * q_per_kv - q_head_start
    head_hi = gl.minimum(group_lo + q_per_kv, num_q_heads)
    head_lo = gl.maximum(group_lo, 0) + (pid_h % head_tiles_per_group) * ROWS
    out_split = split.to(gl.int64) * stride_os
    lse_split = split.to(gl.int64) * stride_ls
    if req >= num_reqs:
        _write_padding(out_ptr, lse_ptr, gl.load(query_start_loc_ptr + num_reqs).to(gl.int64), num_tokens, head_lo,
                       head_hi, out_split, lse_split, out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_lr,
                       stride_lt, stride_lh, HEAD_DIM)
        return
    token = gl.load(query_start_loc_ptr + req).to(gl.int64)
    if (gl.load(query_start_loc_ptr + req + 1) > token) & (head_lo < head_hi):
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_len = gl.load(context_lens_ptr + req).to(gl.int32)
        tiles = gl.cdiv(kv_len, BLOCK_N)
        per_split = gl.cdiv(tiles, num_splits)
        tile0 = split * per_split
        n_tiles = gl.maximum(gl.minimum(per_split, tiles - tile0), 0)
        split_len = kv_len - tile0 * BLOCK_N  # keys from the split's first on (more than its tiles hold but last)
        n_pages = gl.cdiv(kv_len, PAGE) - tile0 * PAGES
        k_smem, v_smem, ready, empty, fixed, _, _ = ring_buffers(dtype, STAGES, BLOCK_N, HEAD_DIM, True, 1)
        table = block_table_ptr + req.to(gl.int64) * stride_bt_req + (tile0 * PAGES).to(gl.int64) * stride_bt_blk
        kv_group = kv_head.to(gl.int64)
        gl.warp_specialize([
            (_attend_heads, (q_ptr + token * stride_qt, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, fixed,
                             n_tiles, split_len, token, head_lo, head_hi, qk_scale, stride_qh,
                             token * stride_ot + out_split, token * stride_lt + lse_split, out_heads_per_rank,
                             stride_or, stride_oh, stride_lr, stride_lh, BLOCK_N, HEAD_DIM, STAGES)),
            (load_pages, (k_cache_ptr + kv_group * stride_k_h, v_cache_ptr + kv_group * stride_v_h, tma_rows,
                           stride_k_tok, stride_v_tok, k_smem, v_smem, ready, empty, fixed, table, stride_bt_blk,
                           rows_per_block, n_pages, n_tiles, split_len, HEAD_DIM, PAGE, PAGES, STAGES, True)),
        ], [1], [40])


def plan_gluon_decode(q, key_cache, value_cache, block_table, context_lens, *, scale, q_head_start, q_per_kv,
                      kv_head_start, first_kv_head, head_tiles_per_group, num_groups, num_splits, out_strides,
                      lse_strides, pages: int = PAGES, stages: int = STAGES) -> Launch:
    """Stage 1 of ``plan_paged``'s decode on sm_90, called like ``paged_attention_kernel``'s ``Launch``
    (``(q, key_cache, value_cache, block_table, context_lens, query_start_loc, out, lse, k_scale, v_scale)``, where
    ``out``/``lse`` are the split partials with more than one split); ``out_strides``: ``(heads_per_rank, stride_r,
    stride_t, stride_h, stride_split, stride_d)``, ``lse_strides``: ``(stride_r, stride_t, stride_h, stride_split)``
    (``plan_paged``'s); head tiles as ``_schedule.head_tiling`` gives them for ``ROWS``; the caller checked
    ``_gluon.decode_takes_gluon``. ``pages``, ``stages``: ``PAGES``, ``STAGES`` (benchmarks time others)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs = context_lens.shape[0]
    rows_per_block = key_cache.stride(0) // key_cache.stride(1)
    heads_per_rank, stride_or, stride_ot, stride_oh, stride_os, _ = out_strides
    grid = (num_reqs + 1, num_groups * head_tiles_per_group, num_splits) if num_tokens and num_q_heads else (0,)
    return Launch(
        gluon_decode_kernel, grid,
        (num_tokens, num_reqs, num_q_heads, num_splits, float(scale) * LOG2E, q_head_start, q_per_kv, kv_head_start,
         first_kv_head, head_tiles_per_group, q.stride(0), q.stride(1), key_cache.stride(1), key_cache.stride(2),
         value_cache.stride(1), value_cache.stride(2), *block_table.stride(), rows_per_block,
         rows_per_block * key_cache.shape[0], heads_per_rank, stride_or, stride_ot, stride_oh, stride_os,
         *lse_strides),
        dict(HEAD_DIM=head_dim, PAGE=PAGE, PAGES=pages, STAGES=stages),
        num_warps=4, scratch=True, stand_ins={8: 0, 9: 0})  # no scales: q's pointer stands in (never read)
