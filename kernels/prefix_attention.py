"""Queries against the local paged KV cache (the DCP prefix pass): non-causal, GQA-packed, split-KV, with LSE.

Stage 1 runs one program per (query block, head tile, KV split). A tile's rows are ``BLOCK_Q`` query tokens of one
request times ``BLOCK_H`` Q heads of ONE KV group, so each K/V tile is loaded once for every Q head that reads it,
and a tile never mixes two KV heads whatever the KV group size or the offset of the first Q head. A request's cached
tokens are cut into ``num_splits`` ranges of whole ``BLOCK_N`` tiles; with one split stage 1 writes ``out``/``lse``
directly, otherwise it writes fp32 partials that stage 2 merges by LSE. A decode on a GPU cuts each request into
its own number of splits instead (``BALANCED``, ``_schedule.balanced_split``). Softmax runs in base 2 with
``scale * log2(e)`` folded into one multiplier; LSE is stored in natural log.

Three compiled variants serve every step of a serving engine: decode (one query row per request; its programs take
(request, split) work items for each head tile), short queries (speculative-decoding verify rows) and long ones
(prefill chunks); the last two number their query blocks over the whole batch (``_schedule``), so a mixed step
never launches ``requests x longest query`` programs. ``out``/``lse`` may be rank-major (``[R, T, H / R, D]``): the
layout the DCP collectives send.
On sm_90+ a tile that lies inside one page (pages of 64 tokens or more) comes through tensor descriptors, one TMA
copy per K or V tile (``_prefix_tile``); smaller pages are gathered token by token. A prefill step's prefix pass on
sm_90 with Triton 3.6 (unless ``DCP_TRITON_GLUON=0``) runs ``gluon_prefix`` where ``_gluon.prefix_takes_gluon``
allows, and a decode with more than ``GLUON_DECODE_MIN_KV_GROUP`` Q heads per KV group runs ``gluon_decode`` as stage
1 where ``_gluon.decode_takes_gluon`` allows. Over an fp8 cache, ``DCP_TRITON_FP8_PREFILL=copy`` sends a prefill
step's pass through a 16-bit copy of its pages (``fp8_prefill``). The ``tl`` kernel's launch constants:
``_prefix_config``.
"""

from __future__ import annotations

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import (
    LOG2E, Launch, cdiv, device_index, every_variant_wanted, next_pow2, num_sms,
)
from dcp_plugin.kernels import _plan_cache
from dcp_plugin.kernels._gluon import GLUON_DECODE_MIN_KV_GROUP, decode_takes_gluon, prefix_takes_gluon
from dcp_plugin.kernels.fp8_prefill import plan_copy
from dcp_plugin.kernels._prefix_checks import MAX_HEAD_DIM, MAX_SPLITS, checked_outputs, outputs  # noqa: F401
from dcp_plugin.kernels._prefix_config import (  # noqa: F401 - the tuning table is part of this module's API
    DESCRIPTOR_DECODE_CONFIGS, DESCRIPTOR_DECODE_MAX_KV_GROUP, FP8_DESCRIPTOR_DECODE_CONFIGS, GPU_CONFIGS,
    GPU_FP32_CONFIGS, INTERPRET_CONFIG, POINTER_CONFIGS, PrefixConfig, fp8_dot_for, pick_config,
)
from dcp_plugin.kernels._prefix_tile import attend_split, cache_takes_descriptors, narrow_q
from dcp_plugin.kernels._pdl import main_loop_done, pdl_for, wait_for_previous_grid
from dcp_plugin.kernels._schedule import (  # noqa: F401 - the split-count constants are part of this module's API
    MAX_AUTO_SPLITS, MIN_TILES_PER_SPLIT, PROGRAMS_PER_SM, SMALL_GRID_PER_SM, balanced_max_splits, balanced_split,
    find_block, flat_programs, head_tiling, kv_group_head_tile, pick_num_splits,
)
from dcp_plugin.kernels.checks import FP8_DTYPES
from dcp_plugin.kernels.split_kv import (
    LAST_MERGE_PROGRAMS, LAST_MERGE_SPLITS, NARROW_SPLITS, PrefixLaunch, auto_splits, fit_splits, head_offsets,
    merge_split_rows, split_capacity, split_merge_kernel, split_outputs, sync_counters, with_merge,
)

__all__ = ["PrefixConfig", "prefix_attention", "prefix_attention_kernel", "split_merge_kernel", "plan_prefix",
           "split_capacity"]

_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (jit functions read only constexpr globals)
SHORT_QUERY = 8  # at most this many query rows per request: the short-query variant (speculative verify steps)


# Per-step sizes (and the LSE strides, which scale with them) are not specialized on: every step of an engine runs
# one of the three compiled variants. Nor is the block table's row stride (the engine's table width, which the
# warm-up cannot know; only a row's start depends on it). Output strides stay specialized: vectorized stores need
# them, and the DCP core's buffers keep them multiples of 16 at every token count, so their specialization never
# changes.
@triton.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs", "num_splits", "head_programs",
                               "stride_bt_req", "stride_lse_r", "stride_lse_t", "stride_lse_h", "stride_lse_s",
                               "tma_rows", "split_slots", "small_slots"),
            # the batch tables may start mid-tensor (a mixed step's requests after its decodes); scalar loads anyway
            do_not_specialize_on_alignment=("block_table_ptr", "kv_lens_ptr", "query_start_loc_ptr",
                                            "part_lse_ptr", "split_counts_ptr", "split_sync_ptr"))
def prefix_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, kv_lens_ptr, query_start_loc_ptr,
    out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, part_out_ptr, part_lse_ptr, split_counts_ptr, split_sync_ptr,
    num_tokens, num_reqs, num_q_heads, head_dim, num_q_programs,
    qk_scale, q_head_start, q_per_kv, kv_head_start, first_kv_head, head_tiles_per_kv_group, num_splits, head_programs,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kc_blk, stride_kc_tok, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_h, stride_vc_d,
    stride_bt_req, stride_bt_blk,
    out_heads_per_rank, stride_o_r, stride_o_t, stride_o_h, stride_o_s, stride_o_d,
    stride_lse_r, stride_lse_t, stride_lse_h, stride_lse_s,
    rows_per_block, tma_rows, split_slots, small_slots,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # BLOCK_D == head_dim: no mask along the head dim
    DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds value / scale in fp8: scale the scores by k_scale, the output by v_scale
    FP8_VIA_FP16: tl.constexpr,  # bf16 q over an fp8 cache: compute in fp16 (below)
    FP8_WIDEN: tl.constexpr,  # fp8 tiles widened before their shared-memory round trip: 0 none, 1 V, 2 K and V
    FP8_DOT: tl.constexpr,  # an e4m3 cache's products in fp8: 0 none, 1 Q x K (q to e4m3 below), 2 P x V too
    USE_TMA: tl.constexpr,  # whole tiles of one page through tensor descriptors (``cache_takes_descriptors``)
    ROWS_AHEAD: tl.constexpr,  # with USE_TMA: descriptor rows read a chunk of tiles ahead (PrefixConfig.rows_ahead)
    BALANCED: tl.constexpr = False,  # DECODE: each request's own split count (_schedule.balanced_split); out/lse
    # are then the final outputs, written by a request of one split, and part_out/part_lse ([T, Hq, num_splits, D]
    # and [T, Hq, num_splits]) take the partials of the others, split_counts ([T]) every token's split count
    LAST_MERGES: tl.constexpr = False,  # BALANCED: the last split of a (token, head program) to finish merges its
    # splits (split_sync: [T x head_programs] int32 counters, zero between launches); no merge launch, no counts
    PDL: tl.constexpr = 0,  # above 0: a programmatic dependent launch (_pdl.TRIGGER says where it signals)
):
    wait_for_previous_grid(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    if DECODE:  # a request's head programs next to each other: they read the same pages (a token's KV heads are
        pid_q = tl.program_id(0) // head_programs  # adjacent in vLLM's cache)
        pid_h = tl.program_id(0) % head_programs
    else:
        pid_q = tl.program_id(0)
        pid_h = tl.program_id(1)
    split = tl.program_id(2)
    if BALANCED:  # program row pid_q is a work row: (request, split) pairs, then the padding rows
        pid_q, split, req_splits = balanced_split(kv_lens_ptr, query_start_loc_ptr, num_reqs, pid_q,
                                                  split_slots, small_slots, head_programs, num_splits, BLOCK_N)

    # Programs past num_q_programs cover rows after query_start_loc[-1] (CUDA-graph padding) as a request with
    # no cached tokens, so every row of out/lse is written, with (0, -inf) there.
    is_tail = pid_q >= num_q_programs
    if DECODE:  # one row per request: program b is request b
        req = pid_q
        q_block = pid_q * 0
    else:
        req, q_block = find_block(query_start_loc_ptr, num_reqs, pid_q, BLOCK_Q)
    req = tl.where(is_tail, num_reqs, req)
    q_block = tl.where(is_tail, pid_q - num_q_programs, q_block)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + req + 1, mask=~is_tail, other=0).to(tl.int64)
    q_end = tl.where(is_tail, num_tokens, q_end)
    kv_len = tl.load(kv_lens_ptr + req, mask=~is_tail, other=0).to(tl.int32)
    if (q_block < 0) | (q_block * BLOCK_Q >= q_end - q_start):
        return
    if BALANCED and not LAST_MERGES:  # a decode's token row: q_start + q_block (one split at most: no counts)
        if (split == 0) & (pid_h == 0) & (num_splits > 1):
            tl.store(split_counts_ptr + q_start + q_block, req_splits)

    kv_head, tile_lo, head_hi = kv_group_head_tile(pid_h, first_kv_head, head_tiles_per_kv_group, q_head_start,
                                                   q_per_kv, kv_head_start, num_q_heads, BLOCK_H)
    if tile_lo >= head_hi:
        return

    rows = tl.arange(0, BLOCK_M)
    token = q_start + q_block * BLOCK_Q + rows // BLOCK_H  # [BLOCK_M]
    head = tile_lo + rows % BLOCK_H  # [BLOCK_M]
    row_mask = (token < q_end) & (head < head_hi)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head.to(tl.int64)[:, None] * stride_q_h
                + dims[None, :] * stride_q_d, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    q, qk_scale = narrow_q(q, qk_scale, FP8_DOT=FP8_DOT, FP8_VIA_FP16=FP8_VIA_FP16)
    # This split's whole tiles of the request's cached tokens.
    num_tiles = (kv_len + BLOCK_N - 1) // BLOCK_N
    if BALANCED:
        tiles_per_split = (num_tiles + req_splits - 1) // req_splits
    else:
        tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    kv_start = split * tiles_per_split * BLOCK_N
    kv_end = tl.minimum(kv_len, kv_start + tiles_per_split * BLOCK_N)

    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_h
    table_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    if USE_TMA:  # the cache's token rows of this KV head as one 2-D tensor: row = page * rows_per_block + token
        k_desc = tl.make_tensor_descriptor(k_head_ptr, shape=[tma_rows, BLOCK_D], strides=[stride_kc_tok, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_head_ptr, shape=[tma_rows, BLOCK_D], strides=[stride_vc_tok, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = k_head_ptr
        v_desc = v_head_ptr
    acc, l_i, m_i = attend_split(
        q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, kv_start, kv_end, dims, dim_mask, qk_scale,
        stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok, stride_vc_d, stride_bt_blk,
        rows_per_block, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
        KV_FP8=KV_FP8, FP8_WIDEN=FP8_WIDEN, FP8_DOT=FP8_DOT, USE_TMA=USE_TMA, ROWS_AHEAD=ROWS_AHEAD)
    main_loop_done(PDL)

    # No cached tokens: acc = 0, l_i = 0, m_i = -inf -> (0, -inf). A NaN input leaves l_i NaN: NaN out and lse.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    lse = (m_i + tl.log2(l_safe)) / _LOG2E
    out_rows = out_ptr + token * stride_o_t + head_offsets(head, out_heads_per_rank, stride_o_r, stride_o_h)
    lse_rows = lse_ptr + token * stride_lse_t + head_offsets(head, out_heads_per_rank, stride_lse_r, stride_lse_h)
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if BALANCED:
        if req_splits > 1:  # this split's partial, in [T, Hq, num_splits, D] and [T, Hq, num_splits]
            part_row = (token * num_q_heads + head) * num_splits + split
            tl.store(part_out_ptr + part_row[:, None] * head_dim + dims[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + part_row, lse, mask=row_mask)
            if LAST_MERGES:
                # Every thread's partial stored before one thread counts this split done (release, GPU scope); the
                # program that counts last reads every split's partial (acquire) and writes the answer. Triton runs
                # a scalar atomic in one thread and hands its result to the others through a barrier, so their
                # reads follow the acquire.
                tl.debug_barrier()
                sync = split_sync_ptr + (q_start + q_block) * head_programs + pid_h
                if tl.atomic_add(sync, 1, sem="acq_rel", scope="gpu") == req_splits - 1:
                    tl.store(sync, 0)  # zero again for the next launch (stream order)
                    out, lse = merge_split_rows(part_out_ptr, part_lse_ptr, part_row - split, req_splits, dims,
                                                row_mask, dim_mask, head_dim, BLOCK_M, BLOCK_D)
                    tl.store(out_rows[:, None] + dims[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
                             mask=out_mask)
                    tl.store(lse_rows, lse, mask=row_mask)
        else:  # the request's only split: the final output, no merge
            tl.store(out_rows[:, None] + dims[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(lse_rows, lse, mask=row_mask)
    else:
        split_off = split.to(tl.int64)
        tl.store(out_rows[:, None] + split_off * stride_o_s + dims[None, :] * stride_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_rows + split_off * stride_lse_s, lse, mask=row_mask)


def prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, *, scale, q_head_start,
                     q_per_kv, kv_head_start, max_kv_len, max_query_len=None, num_splits=None, out=None, lse=None,
                     config: PrefixConfig | None = None, k_scale=None, v_scale=None):
    """Every query row of request ``b`` attends, non-causally, to its cached tokens ``[0, kv_lens[b])``.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32, any strides; request ``b`` owns rows
            ``query_start_loc[b]:query_start_loc[b + 1]``; rows past ``query_start_loc[-1]`` get (0, -inf).
        key_cache, value_cache: ``[num_blocks, block_size, Hk, D]``, q's dtype or fp8 (e4m3fn / e5m2, holding
            value / scale: then ``k_scale``/``v_scale``, one-element float32 tensors, are required), any strides
            (vLLM's views of one buffer are fine). Cached token ``j`` of request ``b`` is row
            ``j % block_size`` of page ``block_table[b, j // block_size]``.
        block_table: ``[>= B, max_blocks]`` int32/int64. kv_lens: ``[B]`` int. query_start_loc: ``[B + 1]``
            int, ``query_start_loc[0] == 0``.
        scale: softmax scale. q_head_start, q_per_kv, kv_head_start: local Q head ``i`` reads stored KV head
            ``(q_head_start + i) // q_per_kv - kv_head_start``.
        max_kv_len: host int >= every ``kv_lens[b]`` (the most cached tokens a row attends to); only tunes
            the split count.
        max_query_len: host int >= every request's query rows, or None (unknown). 1 selects the decode variant,
            ``<= 8`` the short-query one.
        num_splits: KV splits per request (None: chosen to fill the GPU; 1 on CPU).
        out: ``[T, Hq, D]`` or rank-major ``[R, T, Hq / R, D]`` (head ``h`` at ``[h // (Hq / R), t, h % (Hq / R)]``),
            any float dtype (default: ``[T, Hq, D]`` in q's dtype). lse: ``[T, Hq]`` float32, rank-major
            ``[R, T, Hq / R]`` with a rank-major ``out``. Written in place.
        config: a ``PrefixConfig`` overriding the tuning table (benchmarks).

    Returns:
        ``(out, lse)``: lse is the natural-log sum of exp of the scaled scores; no cached tokens -> (0, -inf).

    Example:
        >>> out, lse = prefix_attention(q, kc, vc, block_table, kv_lens, query_start_loc, scale=D ** -0.5,
        ...                            q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=4096,
        ...                            max_query_len=1)
    """
    tensors = (q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse)
    # A call laid out like a recent one whose arguments passed the checks replays its plan (``_plan_cache``); a config
    # of its own is checked and plans afresh.
    launch, (out, lse) = _plan_cache.checked(
        "prefix", (*tensors, k_scale, v_scale),
        (scale, q_head_start, q_per_kv, kv_head_start, max_kv_len, max_query_len, num_splits),
        check=lambda: checked_outputs(*tensors[:6], scale=scale, q_head_start=q_head_start, q_per_kv=q_per_kv,
                                      kv_head_start=kv_head_start, max_kv_len=max_kv_len, max_query_len=max_query_len,
                                      num_splits=num_splits, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale),
        outputs=lambda: outputs(q, out, lse),
        plan=lambda o, o_lse: plan_prefix(
            *tensors[:6], o, o_lse, scale=scale, q_head_start=q_head_start, q_per_kv=q_per_kv,
            kv_head_start=kv_head_start, max_kv_len=max_kv_len, max_query_len=max_query_len, num_splits=num_splits,
            fewer_launches=True, config=None if config is None else pick_config(
                q.shape[-1], decode=max_query_len == 1, dtype=q.dtype, config=config)),
        keep=config is None)
    launch(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, k_scale, v_scale)
    return out, lse


def plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, *, scale,
                q_head_start, q_per_kv, kv_head_start, max_kv_len, max_query_len=None, num_splits=None,
                split_buffer: torch.Tensor | None = None, config: PrefixConfig | None = None,
                gluon_decode: tuple[int, ...] | None = None, split_slots: int | None = None,
                split_sync: torch.Tensor | None = None, fewer_launches: bool = False) -> PrefixLaunch:
    """``prefix_attention`` prepared for tensors shaped like these (no checks). ``split_buffer``: float32 scratch of
    ``split_capacity`` elements for the split partials (default: allocated here); an automatic split count is
    lowered until the partials fit in it. ``gluon_decode``: ``(pages, stages[, programs])`` of ``gluon_decode``
    for a decode it can serve, whatever the KV group size (benchmarks). ``split_slots``: a decode the ``tl`` kernel
    serves with automatic splits takes each request's own split count (``_schedule.balanced_split``) over that many
    programs; None: ``PROGRAMS_PER_SM`` per SM on a GPU, none under the interpreter (one split, as ``auto_splits``);
    0: one count for every request. ``split_sync``: int32 counters, zero, at least tokens x head programs (the
    workspace's ``split_sync``), for a balanced decode whose config has ``last_split_merges`` (default:
    ``split_kv.sync_counters``); too few: the merge runs apart. ``fewer_launches``: that merge also in a step of
    fewer (token, head program)s than ``LAST_MERGE_PROGRAMS`` (a one-shot call, where a launch's host time outweighs
    the GPU time the merge launch saves there)."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = key_cache.shape[1]
    num_reqs = kv_lens.shape[0]
    decode = max_query_len == 1
    if config is None and not decode and key_cache.dtype in FP8_DTYPES:  # DCP_TRITON_FP8_PREFILL=copy (fp8_prefill)
        copied = plan_copy(q, key_cache, value_cache, block_table, kv_lens, max_kv_len, lambda kc, vc, pages: (
            plan_prefix(q, kc, vc, pages, kv_lens, query_start_loc, out, lse, scale=scale, q_head_start=q_head_start,
                        q_per_kv=q_per_kv, kv_head_start=kv_head_start, max_kv_len=max_kv_len,
                        max_query_len=max_query_len, num_splits=num_splits, split_buffer=split_buffer,
                        split_slots=split_slots, split_sync=split_sync)))
        if copied is not None:
            return copied
    cfg = config or pick_config(head_dim, decode=decode, dtype=q.dtype)
    wide = min(q_per_kv, num_q_heads) > GLUON_DECODE_MIN_KV_GROUP  # the KV group first: no tensor checks for most steps
    if config is None and decode and (gluon_decode is not None or wide) \
            and decode_takes_gluon(q, key_cache, value_cache, out):
        from dcp_plugin.kernels.gluon_decode import plan_prefix_gluon_decode

        return plan_prefix_gluon_decode(q, key_cache, value_cache, block_table, kv_lens, out, lse, scale=scale,
                                        q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=kv_head_start,
                                        max_kv_len=max_kv_len, num_splits=num_splits, split_buffer=split_buffer,
                                        tiles=gluon_decode)
    if config is None and decode and not INTERPRET and q.dtype != torch.float32 \
            and min(q_per_kv, num_q_heads) <= DESCRIPTOR_DECODE_MAX_KV_GROUP:
        table = FP8_DESCRIPTOR_DECODE_CONFIGS if key_cache.dtype in FP8_DTYPES else DESCRIPTOR_DECODE_CONFIGS
        cfg = table.get(next_pow2(head_dim), cfg)
    use_tma = cfg.tma and cache_takes_descriptors(key_cache, value_cache, head_dim, cfg.block_n)
    if config is None and cfg.tma and not use_tma:  # the same work through pointer loads
        cfg = POINTER_CONFIGS.get(cfg, pick_config(head_dim, decode=decode, dtype=q.dtype))
    # Tile rows: BLOCK_Q query tokens x BLOCK_H Q heads of one KV group; at least min_rows (16 for tl.dot).
    block_h = min(next_pow2(min(q_per_kv, num_q_heads)), cfg.block_m)
    block_q = max(1, cfg.block_m // block_h)
    if decode:
        block_q = 1
    elif max_query_len is not None and max_query_len <= SHORT_QUERY:
        block_q = min(block_q, SHORT_QUERY)
    block_h = max(block_h, cfg.min_rows // block_q)
    first_kv_head, num_kv_groups, head_tiles_per_kv_group = head_tiling(
        num_q_heads=num_q_heads, q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=kv_head_start,
        block_h=block_h)
    num_q_programs = num_reqs if decode else flat_programs(num_tokens, num_reqs, block_q)
    head_programs = num_kv_groups * head_tiles_per_kv_group
    slots = split_slots if split_slots is not None else 0 if INTERPRET else PROGRAMS_PER_SM * num_sms(device_index(q))
    balanced = decode and num_splits is None and slots > 0
    if balanced:
        num_splits = fit_splits(q, balanced_max_splits(max_kv_len=max_kv_len, block_n=cfg.block_n, slots=slots,
                                                       head_programs=head_programs), split_buffer, counted=True)
        # One split too (tiny contexts): every decode then runs the one compiled variant, which writes out directly.
    if num_splits is None:
        num_splits = auto_splits(q, programs=num_q_programs * head_programs, max_kv_len=max_kv_len,
                                 block_n=cfg.block_n, split_buffer=split_buffer)
    if config is None and num_splits == 1 and not decode and (max_query_len or 0) > SHORT_QUERY \
            and prefix_takes_gluon(q, key_cache, value_cache, out):  # a prefill step's prefix pass on Hopper
        from dcp_plugin.kernels.gluon_prefix import plan_gluon_prefix

        return PrefixLaunch(plan_gluon_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc,
                                              out, lse, scale=scale, q_head_start=q_head_start, q_per_kv=q_per_kv,
                                              kv_head_start=kv_head_start), None, None, None, 1)
    part_out, part_lse, counts, out_strides, lse_strides = split_outputs(q, out, lse, num_splits, split_buffer,
                                                                         balanced=balanced)
    # The last split merges where the plan's bound keeps every request within a few splits and the step has enough
    # (token, head program)s (``split_kv.LAST_MERGE_SPLITS``).
    mergeable = balanced and num_splits > 1 and cfg.last_split_merges
    sync = sync_counters(q.device, num_tokens * head_programs) if mergeable and split_sync is None else split_sync
    mergeable = mergeable and sync.numel() >= num_tokens * head_programs
    last_merges = mergeable and num_splits <= LAST_MERGE_SPLITS \
        and (fewer_launches or num_reqs * head_programs >= LAST_MERGE_PROGRAMS)
    rows = cdiv(slots, head_programs) + num_tokens if balanced else num_q_programs + cdiv(num_tokens, block_q)
    grid = ((rows * head_programs, 1, 1 if balanced else num_splits) if decode else (rows, head_programs, num_splits)) \
        if num_tokens else (0,)
    block_d = max(16, next_pow2(head_dim))
    kv_fp8 = key_cache.dtype in FP8_DTYPES
    fp8_dot = 0 if decode else fp8_dot_for(cfg, key_cache.dtype)  # decode: no better on sm_90 (_prefix_config)
    rows_per_block = key_cache.stride(0) // key_cache.stride(1) if use_tma else 0
    pdl = pdl_for(q.device, "stage1")

    def stage1_launch(last: bool) -> Launch:
        return Launch(
            prefix_attention_kernel, grid,
            (num_tokens, num_reqs, num_q_heads, head_dim, num_q_programs, float(scale) * LOG2E, q_head_start,
             q_per_kv, kv_head_start, first_kv_head, head_tiles_per_kv_group, num_splits, head_programs, *q.stride(),
             *key_cache.stride(), *value_cache.stride(), *block_table.stride(), *out_strides, *lse_strides,
             rows_per_block, rows_per_block * key_cache.shape[0], max(slots, 1),
             max(1, slots * SMALL_GRID_PER_SM // PROGRAMS_PER_SM)),
            dict(PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
                 EVEN_D=block_d == head_dim, DECODE=decode,
                 DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                 KV_FP8=kv_fp8, FP8_VIA_FP16=kv_fp8 and q.dtype == torch.bfloat16 and not fp8_dot,
                 FP8_WIDEN=cfg.fp8_widen * kv_fp8, FP8_DOT=fp8_dot,
                 USE_TMA=use_tma,
                 ROWS_AHEAD=use_tma and cfg.rows_ahead, BALANCED=balanced, LAST_MERGES=last, PDL=pdl),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=None if INTERPRET else cfg.max_registers,
            pdl=pdl, scratch=use_tma,  # q's pointer stands in for what is
            stand_ins=({} if kv_fp8 else {8: 0, 9: 0}) | ({13: 0} if balanced and not last else {})
            | ({} if balanced else {10: 0, 11: 0, 12: 0, 13: 0}))  # never read

    stage1 = stage1_launch(last_merges)
    if not balanced:
        return with_merge(stage1, part_out, part_lse, out, lse, num_splits, stage1_extra=(None, None, None, None))
    def extra(last: bool) -> tuple:  # a balanced stage 1's trailing tensors: the counters only where it merges
        return part_out, part_lse, counts, sync if last else None

    # The warm-up's steps are small: with ``every_variant()`` the other choice of LAST_MERGES runs first too (on the
    # same buffers, rewritten next), so a step of either kind finds its kernel compiled.
    other = (stage1_launch(not last_merges), extra(not last_merges)) if mergeable and every_variant_wanted() else None
    if last_merges:  # stage 1 merges: no second launch
        return PrefixLaunch(stage1, None, part_out, part_lse, num_splits, stage1_extra=extra(True), stage1_other=other)
    # The merge's variant by the splits a request takes on average: about slots / (requests x head programs).
    return with_merge(stage1, part_out, part_lse, out, lse, num_splits, split_counts=counts,
                      stage1_extra=extra(False), stage1_other=other,
                      narrow=num_reqs * head_programs * NARROW_SPLITS >= slots)

