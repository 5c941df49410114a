"""Decode on Hopper in Triton's Gluon dialect: one query row per request, the Q heads of one KV group as the rows
of a warpgroup MMA, against a KV split of the request's cached tokens over 64-token pages.

The work items are (request, tile of up to ``ROWS`` Q heads of one KV group, KV split), split first, then head tile,
so one request's KV heads are read side by side. One program per SM takes items ``p, p + programs, ..`` in turn
(``PER_SM``): a producer warp copies each key tile's pages through TMA into a ring of shared-memory stages on
mbarriers, through one pair of descriptors over every KV head, and zeroes an item's last V rows past its context in
place (``gluon_parts.copy_tiles``); one consumer warpgroup runs QK^T -> softmax -> P x V in FA3's order
(``gluon_parts.attend_overlap``). Both count the ring's uses across items, so one item's copies run under the
previous item's work. Rows past the KV group are masked, so a KV group fills its share of the 64 rows: hence only
KV groups of more than ``_gluon.GLUON_DECODE_MIN_KV_GROUP`` take it. With 32 Q heads over one KV head it ran at
0.82x-1.02x of FA3's speed, the ``tl`` decode kernel at 0.83x-0.90x, in one run (docs/kernels.md, the Gluon decode).

Semantics are ``prefix_attention``'s decode variant (``max_query_len == 1``): request ``b``'s row is
``query_start_loc[b]`` (none when the request has no row); a request with no cached tokens, and an empty split, get
(0, -inf); rows past ``query_start_loc[num_reqs]`` (a CUDA graph's padding) get (0, -inf) from the items of request
``num_reqs``. ``plan_prefix`` picks it where ``_gluon.decode_takes_gluon`` allows and owns the split partials and their
merge; with one split it writes ``out``/``lse`` (plain or rank-major) directly.
"""

from __future__ import annotations

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dcp_plugin.kernels._gluon import PREFIX_PAGE, head_columns
from dcp_plugin.kernels._launch import LOG2E, Launch, device_index, num_sms
from dcp_plugin.kernels._schedule import head_tiling
from dcp_plugin.kernels._pdl import pdl_for
from dcp_plugin.kernels.gluon_parts import (
    attend_overlap, copy_tiles, head_offset, page_descriptors, ring_buffers, wait_for_previous_grid,
)
from dcp_plugin.kernels.split_kv import PrefixLaunch, auto_splits, split_outputs, with_merge

ROWS = gl.constexpr(64)  # Q heads of one KV group per program: a warpgroup MMA's rows (the heads past it masked)
PAGE = PREFIX_PAGE
# One page per key tile, four in flight: H200, bf16, 64-token pages, at 8 x 1K / 8 x 8K with 8 KV heads and 1 x 32K /
# 32 x 8K / 128 x 8K with one, 18.2 / 71.4 and 19.1 / 45.8 / 131.0 us against 19.8 / 72.2 and 20.2 / 46.9 / 131.1
# for two pages and three stages (128 x 8K, 8 KV heads: 967 against 964); 1 x 6: 20.2 / 74.3 and 20.1 / 47.4 / 134.1
# (docs/kernels.md, the Gluon decode).
PAGES = 1  # pages per key tile
STAGES = 4  # key tiles in flight
PER_SM = 1  # programs per SM (255 registers a thread: one fills an SM), each over work items in turn
# One program per SM over the items, not one per item: on one H200 (code d9e2c49; docs/kernels.md, the Gluon decode)
# 103.9 against 114.2 us at 128 x 8K with contexts of 1K-8K and 32 Q / 1 KV, 43.1 against 46.7 / 26.3 against 27.9 at
# 256 / 128 x 1K with 16 Q / 1 KV, 16.6 against 17.4 at 1 x 8K, within 1% elsewhere; over groups of 4 (which keep the tl
# kernel) 143.1 against 184.3 at 128 x 1K, but 642.2 against 596.0 at 128 x 8K with contexts of 1K-8K: a fixed deal of
# unequal items.


@gluon.jit
def _item(w, heads):
    """Work item ``w`` -> (request, KV split, stored KV head, the item's local Q heads ``head_lo .. head_hi``): items
    run split first, then head tile, then request; request ``num_reqs`` stands for the padding rows. ``heads``:
    ``(num_reqs, num_splits, head_programs, first_kv_head, head_tiles_per_kv_group, q_head_start, q_per_kv,
    kv_head_start, num_q_heads)``."""
    split = w % heads[1]
    rest = w // heads[1]
    pid_h = rest % heads[2]
    kv_head = heads[3] + pid_h // heads[4]
    kv_group_lo = (kv_head + heads[7]) * heads[6] - heads[5]
    head_hi = gl.minimum(kv_group_lo + heads[6], heads[8])
    head_lo = gl.maximum(kv_group_lo, 0) + (pid_h % heads[4]) * ROWS
    return rest // heads[2], split, kv_head, head_lo, head_hi


@gluon.jit
def _span(kv_lens_ptr, query_start_loc_ptr, req, split, head_lo, head_hi, heads, BLOCK_N: gl.constexpr):
    """What item (``req``, ``split``) attends: ``(token, attend, n_tiles, split_len, tile0)``: the request's row,
    whether the item writes it (a real request with a row and heads), its key tiles (0 unless ``attend``), its keys
    from the split's first on (more than its tiles hold but in the last split), its first tile in the request.
    ``heads``: ``_item``'s."""
    real = req < heads[0]
    token = gl.load(query_start_loc_ptr + req, mask=real, other=0).to(gl.int64)
    attend = real & (gl.load(query_start_loc_ptr + req + 1, mask=real, other=0) > token) & (head_lo < head_hi)
    kv_len = gl.load(kv_lens_ptr + req, mask=real, other=0).to(gl.int32)
    tiles = gl.cdiv(kv_len, BLOCK_N)
    per_split = gl.cdiv(tiles, heads[1])
    tile0 = split * per_split
    n_tiles = gl.where(attend, gl.maximum(gl.minimum(per_split, tiles - tile0), 0), 0)
    return token, attend, n_tiles, kv_len - tile0 * BLOCK_N, tile0


@gluon.jit
def _attend_heads(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, fixed, n_tiles, kv_len, head_lo, head_hi,
                  first, fix_phases, qk_scale, stride_qh, out_base, lse_base, out_heads_per_rank, stride_or,
                  stride_oh, stride_lr, stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr):
    """One item in the consumer warpgroup: the tile's heads (row ``r`` = local Q head ``head_lo + r``; q at
    ``q_ptr``, the token's row) against ``n_tiles`` key tiles from the ring's ``first`` use on (keys at or past
    ``kv_len``, counted from the split's first key, masked), then ``acc / l`` and the LSE at ``out_base``/``lse_base``
    (the token's row, and the split's) plus each head's offset; no key: (0, -inf). Returns the ``fixed`` parities."""
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
    acc, m_i, l_i, fix_phases = attend_overlap(q_op, k_smem, v_smem, v_smem.index(0), ready, empty, fixed, acc, m_i,
                                               l_i, n_tiles, kv_len, qk_scale, offs_m, offs_n, zero_qk, first,
                                               fix_phases, BLOCK_N, STAGES, True, acc_layout, dtype)
    empty_row = l_i == 0.0
    l_acc = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, acc_layout))
    out = gl.convert_layout((acc / gl.expand_dims(l_acc, 1)).to(out_ptr.dtype.element_ty), io_layout)
    gl.store(out_ptr + out_base + gl.expand_dims(head_offset(heads_io, out_heads_per_rank, stride_or, stride_oh), 1)
             + gl.expand_dims(cols_io, 0), out, mask=live_io)
    heads_m = head_lo + offs_m
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    gl.store(lse_ptr + lse_base + head_offset(heads_m, out_heads_per_rank, stride_lr, stride_lh), lse,
             mask=heads_m < head_hi)
    return fix_phases


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


@gluon.jit
def _consume(q_ptr, out_ptr, lse_ptr, kv_lens_ptr, query_start_loc_ptr, k_smem, v_smem, ready, empty, fixed,
             pid, num_programs, num_items, heads, num_tokens, qk_scale, stride_qt, stride_qh, out_heads_per_rank,
             stride_or, stride_ot, stride_oh, stride_os, stride_lr, stride_lt, stride_lh, stride_ls,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The consumer warpgroup: items ``pid, pid + num_programs, ..`` in turn, the ring's uses counted across them.
    ``heads``: ``_item``'s head-map arguments."""
    used = gl.to_tensor(0)
    fix_phases = gl.to_tensor(0)
    for w in range(pid, num_items, num_programs):
        req, split, _, head_lo, head_hi = _item(w, heads)
        token, attend, n_tiles, split_len, _ = _span(kv_lens_ptr, query_start_loc_ptr, req, split, head_lo,
                                                     head_hi, heads, BLOCK_N)
        out_split = split.to(gl.int64) * stride_os
        lse_split = split.to(gl.int64) * stride_ls
        if attend:
            fix_phases = _attend_heads(q_ptr + token * stride_qt, out_ptr, lse_ptr, k_smem, v_smem, ready, empty,
                                       fixed, n_tiles, split_len, head_lo, head_hi, used, fix_phases, qk_scale,
                                       stride_qh, token * stride_ot + out_split, token * stride_lt + lse_split,
                                       out_heads_per_rank, stride_or, stride_oh, stride_lr, stride_lh, BLOCK_N,
                                       HEAD_DIM, STAGES)
        if req >= heads[0]:  # request num_reqs: the padding rows
            _write_padding(out_ptr, lse_ptr, gl.load(query_start_loc_ptr + heads[0]).to(gl.int64), num_tokens,
                           head_lo, head_hi, out_split, lse_split, out_heads_per_rank, stride_or, stride_ot,
                           stride_oh, stride_lr, stride_lt, stride_lh, HEAD_DIM)
        used += n_tiles


@gluon.jit
def _produce(k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, query_start_loc_ptr, k_smem, v_smem, ready,
             empty, fixed, pid, num_programs, num_items, heads, tma_rows, width, stride_k_tok, stride_k_h,
             stride_v_tok, stride_v_h, stride_bt_req, stride_bt_blk, rows_per_block, HEAD_DIM: gl.constexpr,
             PAGE: gl.constexpr, PAGES: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: the same items' key tiles into the ring (``copy_tiles``), through one pair of descriptors
    over every KV head's token rows (``width`` elements of each): KV head ``h`` starts ``h * stride_k_h`` elements
    in, as ``(row, column)`` of that 2-D view."""
    k_desc, v_desc = page_descriptors(k_cache_ptr, v_cache_ptr, tma_rows, width, stride_k_tok, stride_v_tok,
                                      HEAD_DIM, PAGE)
    used = gl.to_tensor(0)
    for w in range(pid, num_items, num_programs):
        req, split, kv_head, head_lo, head_hi = _item(w, heads)
        _, _, n_tiles, split_len, tile0 = _span(kv_lens_ptr, query_start_loc_ptr, req, split, head_lo, head_hi,
                                                heads, PAGE * PAGES)
        k_at = kv_head * stride_k_h
        v_at = kv_head * stride_v_h
        table = block_table_ptr + req.to(gl.int64) * stride_bt_req + (tile0 * PAGES).to(gl.int64) * stride_bt_blk
        copy_tiles(k_desc, v_desc, k_at // stride_k_tok, k_at % stride_k_tok, v_at // stride_v_tok,
                   v_at % stride_v_tok, k_smem, v_smem, ready, empty, fixed, table, stride_bt_blk, rows_per_block,
                   gl.cdiv(split_len, PAGE), n_tiles, split_len, used, PAGE, PAGES, STAGES, True)
        used += n_tiles


# Not specialized on, as in ``prefix_attention_kernel``: per-step sizes, the split count and the strides that scale
# with them, the block table's row stride, ``tma_rows``, and the batch tables' alignment: one variant per split-or-not
# serves every step.
@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_splits", "num_items", "stride_bt_req", "stride_ot",
                              "stride_os", "stride_lr", "stride_lt", "stride_lh", "stride_ls", "tma_rows"),
           do_not_specialize_on_alignment=("block_table_ptr", "kv_lens_ptr", "query_start_loc_ptr"))
def gluon_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, query_start_loc_ptr,
                        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, num_tokens, num_reqs, num_q_heads, num_splits,
                        num_items, qk_scale, q_head_start, q_per_kv, kv_head_start, first_kv_head,
                        head_tiles_per_kv_group, head_programs, stride_qt, stride_qh, stride_k_tok, stride_k_h,
                        stride_v_tok, stride_v_h, stride_bt_req, stride_bt_blk, rows_per_block, tma_rows, width,
                        out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_os, stride_lr, stride_lt,
                        stride_lh, stride_ls, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PAGES: gl.constexpr,
                        STAGES: gl.constexpr, PDL: gl.constexpr = 0):
    """Grid (programs,): program ``p`` takes work items ``p, p + programs, ..`` of ``num_items`` = (num_reqs + 1)
    x head programs x splits (``_item``; request ``num_reqs``'s items write the padding rows), its producer warp and
    consumer warpgroup counting the ring's uses across items, so one item's copies run under the previous item's
    work. Head tiles as ``_schedule.kv_group_head_tile`` numbers them, ``ROWS`` heads each. ``k_scale_ptr``/
    ``v_scale_ptr``: never read. ``PDL``: launched as a programmatic dependent launch (``_pdl``)."""
    wait_for_previous_grid(PDL)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    heads = (num_reqs, num_splits, head_programs, first_kv_head, head_tiles_per_kv_group, q_head_start, q_per_kv,
             kv_head_start, num_q_heads)
    k_smem, v_smem, ready, empty, fixed, _, _ = ring_buffers(dtype, STAGES, PAGE * PAGES, HEAD_DIM, True, 1)
    gl.warp_specialize([
        (_consume, (q_ptr, out_ptr, lse_ptr, kv_lens_ptr, query_start_loc_ptr, k_smem, v_smem, ready, empty,
                    fixed, pid, num_programs, num_items, heads, num_tokens, qk_scale, stride_qt, stride_qh,
                    out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_os, stride_lr, stride_lt, stride_lh,
                    stride_ls, PAGE * PAGES, HEAD_DIM, STAGES)),
        (_produce, (k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, query_start_loc_ptr, k_smem, v_smem,
                    ready, empty, fixed, pid, num_programs, num_items, heads, tma_rows, width,
                    stride_k_tok, stride_k_h, stride_v_tok, stride_v_h, stride_bt_req, stride_bt_blk, rows_per_block,
                    HEAD_DIM, PAGE, PAGES, STAGES)),
    ], [1], [40])


def plan_gluon_decode(q, key_cache, value_cache, block_table, kv_lens, *, scale, q_head_start, q_per_kv,
                      kv_head_start, first_kv_head, head_tiles_per_kv_group, num_kv_groups, num_splits, out_strides,
                      lse_strides, pages: int = PAGES, stages: int = STAGES, programs: int | None = None) -> Launch:
    """Stage 1 of ``plan_prefix``'s decode on sm_90, called like ``prefix_attention_kernel``'s ``Launch``
    (``(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, k_scale, v_scale)``, where
    ``out``/``lse`` are the split partials with more than one split); ``out_strides``: ``(heads_per_rank, stride_r,
    stride_t, stride_h, stride_split, stride_d)``, ``lse_strides``: ``(stride_r, stride_t, stride_h, stride_split)``
    (``plan_prefix``'s); head tiles as ``_schedule.head_tiling`` gives them for ``ROWS``; the caller checked
    ``_gluon.decode_takes_gluon``. ``pages``, ``stages``: ``PAGES``, ``STAGES`` (benchmarks time others);
    ``programs``: how many programs take the work items in turn (None: ``PER_SM`` a SM; 0: a program per item)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs = kv_lens.shape[0]
    rows_per_block = key_cache.stride(0) // key_cache.stride(1)
    heads_per_rank, stride_or, stride_ot, stride_oh, stride_os, _ = out_strides
    head_programs = num_kv_groups * head_tiles_per_kv_group
    num_items = (num_reqs + 1) * head_programs * num_splits
    if programs is None:
        programs = num_sms(device_index(q)) * PER_SM
    grid = (min(num_items, programs or num_items),) if num_tokens and num_q_heads else (0,)
    pdl = pdl_for(q.device, "stage1")
    return Launch(
        gluon_decode_kernel, grid,
        (num_tokens, num_reqs, num_q_heads, num_splits, num_items, float(scale) * LOG2E, q_head_start, q_per_kv,
         kv_head_start, first_kv_head, head_tiles_per_kv_group, head_programs, q.stride(0), q.stride(1),
         key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
         *block_table.stride(), rows_per_block, rows_per_block * key_cache.shape[0],
         max(head_columns(key_cache), head_columns(value_cache)), heads_per_rank, stride_or, stride_ot, stride_oh,
         stride_os, *lse_strides),
        dict(HEAD_DIM=head_dim, PAGE=PAGE, PAGES=pages, STAGES=stages, PDL=pdl),
        num_warps=4, scratch=True, stand_ins={8: 0, 9: 0}, pdl=pdl)  # no scales: q's pointer stands in (never read)


def plan_prefix_gluon_decode(q, key_cache, value_cache, block_table, kv_lens, out, lse, *, scale,
                             q_head_start, q_per_kv, kv_head_start, max_kv_len, num_splits, split_buffer,
                             tiles) -> PrefixLaunch:
    """``plan_prefix`` for a decode ``gluon_decode`` serves: its head tiles, split count (at most ``PER_SM``
    programs per SM) and stage 1. ``tiles``: ``(pages, stages[, programs])`` of ``plan_gluon_decode``, or its own."""
    pages, stages, programs = (*tiles, None)[:3] if tiles else (PAGES, STAGES, None)
    num_tokens, num_q_heads, head_dim = q.shape
    first_kv_head, num_kv_groups, head_tiles_per_kv_group = head_tiling(
        num_q_heads=num_q_heads, q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=kv_head_start,
        block_h=ROWS.value)
    if num_splits is None:
        num_splits = auto_splits(q, programs=kv_lens.shape[0] * num_kv_groups * head_tiles_per_kv_group,
                                 max_kv_len=max_kv_len, block_n=PAGE * pages,
                                 split_buffer=split_buffer, per_sm=PER_SM)
    part_out, part_lse, _, out_strides, lse_strides = split_outputs(q, out, lse, num_splits, split_buffer)
    stage1 = plan_gluon_decode(
        q, key_cache, value_cache, block_table, kv_lens, scale=scale, q_head_start=q_head_start,
        q_per_kv=q_per_kv, kv_head_start=kv_head_start, first_kv_head=first_kv_head,
        head_tiles_per_kv_group=head_tiles_per_kv_group, num_kv_groups=num_kv_groups, num_splits=num_splits,
        out_strides=out_strides, lse_strides=lse_strides, pages=pages, stages=stages, programs=programs)
    return with_merge(stage1, part_out, part_lse, out, lse, num_splits)
