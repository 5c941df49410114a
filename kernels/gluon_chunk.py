"""The current chunk on Hopper in Triton's Gluon dialect: causal varlen attention of each request's queries to its
own new keys, as a persistent kernel with a schedule ``tl`` cannot express on sm_90.

One program per SM walks the (128-row query block, Q head) tiles, heaviest blocks first (``chunk_attention_kernel``'s
order). Its producer warp streams K/V tiles of 128 keys through TMA into a ring of shared-memory stages on mbarriers,
across tile boundaries, while two consumer warpgroups (64 query rows each) run QK^T -> softmax -> P x V on warpgroup
MMAs at their own pace: no program-wide barrier, and no SM idles between tiles on a program's start and end. H200,
bf16, 32 Q / 8 KV heads, head size 128, graph replay beside the ``tl`` kernel and FA3 in one process: 415 / 436 / 504 /
558 TFLOP/s at 16 x 1024 / 4 x 2048 / 2 x 4096 / 1 x 16384 causal against 324 / 392 / 460 / 537 for the ``tl``
kernel and 438 / 526 / 633 / 642 for FA3 (two stages; ``benchmarks/probes/gluon_chunk_probe.py``, config
``(128, 2, 0, 0, 1)``; docs/kernels.md, current chunk).

K and V are read through descriptors the producer builds over ``[tokens, kv_heads * head_dim]`` (heads
contiguous): a request's last key tile may hold rows past its end (the next request's, or padding). Their scores
are masked out; their V rows are zeroed into a per-warpgroup copy before P x V (probability 0 times a NaN there
would be NaN). Imported only where
``_gluon.chunk_takes_gluon`` allows it (Triton 3.6, sm_90, unless ``DCP_TRITON_GLUON=0``); ``plan_chunk`` then picks
it. Results are ``chunk_attention``'s: rows past ``query_start_loc[num_reqs]`` get (0, -inf).
"""

from __future__ import annotations

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from dcp_plugin.kernels._launch import LOG2E, Launch, device_index, num_sms
from dcp_plugin.kernels._schedule import flat_programs
from dcp_plugin.kernels.gluon_parts import (
    CAUSAL, NO_MASK, find_block, online_step, overlap_tile, ring_buffers, softmax_probs, store_rows, v_operand,
    write_padding, zero_tail_in_place,
)

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup; a tile is 2 * ROWS rows of one Q head
BLOCK_N = 128  # keys per K/V tile
STAGES = 3  # K/V tiles in flight (two with each consumer's V copy, 192 KiB of shared memory; three: PRODUCER_FIX)
# PRODUCER_FIX: the producer zeroes a request's last V tile past its end in place, once the copy landed, and signals
# the consumers on a barrier of its own; no V copies, so three stages fit (192 KiB). Off: each consumer warpgroup
# zeroes into its own copy (``zero_rows_past``).
PRODUCER_FIX = True
# How tiles are dealt to the persistent programs (``_tile_index``, ``_tile``): 0 round-robin, heaviest blocks first;
# 1 (``SNAKE``) the same in rounds of alternating direction; 2 (``PAIRS``) a tile is two blocks of one request and Q
# head, blocks j and n - 1 - j, whose causal costs sum to the same for every j. A model of the H200 probe's timings
# (benchmarks/probes/tile_order_model.py: a tile costs its KV tiles plus a constant) predicted its measured
# differences:
# SNAKE lost 10% at 16 x 1024 and won 7% at 2 x 4096 against round-robin. With PAIRS, requests of one length give
# tiles of one cost, so no program takes more than one tile beyond another (0.97 of ideal at all four shapes).
ROUND_ROBIN, SNAKE, PAIRS = 0, 1, 2
ORDER = PAIRS
# OVERLAP: FA3's order inside a warpgroup: tile i's QK^T and tile i - 1's P x V issued together, tile i's softmax
# under P x V (``_block_overlap``), the causal mask only on the block's diagonal tile, outside the loop. Off: each
# tile's QK^T, softmax and P x V in turn (``_block_serial``). The prototype's overlap (gluon_chunk_probe.py's
# OVERLAP 2) lost 6-15% on the H200: its loop masked every tile (``gluon_chunk_probe.py --compile-only`` prints the
# instructions a key tile takes on sm_90, and whether ptxas serialized the MMAs). The defaults (PAIRS, three stages,
# PRODUCER_FIX, OVERLAP): 405 / 461 / 513 / 590 TFLOP/s at 16 x 1K / 4 x 2K / 2 x 4K / 1 x 16K, 32 Q / 8 KV, against
# 399 / 482 / 519 / 561 for PAIRS with two stages and 367 / 434 / 513 / 558 for SNAKE (code 320db48; docs/kernels.md,
# current chunk); OVERLAP with two stages lost (387-504).
OVERLAP = True


@gluon.jit
def softmax_step(acc, l_i, m_i, qk, v_tile, qk_scale, offs_m, offs_n, n_start, MASKED: gl.constexpr,
                 qk_layout: gl.constexpr, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """``online_step`` over keys ``n_start + offs_n``, causal where ``MASKED``; P x V in flight on return."""
    if MASKED:
        qk = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(n_start + offs_n, 0), qk, float("-inf"))
    return online_step(acc, l_i, m_i, qk, v_tile, qk_scale, acc_layout, dtype)


@gluon.jit
def _tile_index(k, ORDER: gl.constexpr):
    """The tile this program takes in round ``k``: tile ``k * P + program`` (P programs), or with ``SNAKE`` the
    rounds alternate direction (``k * P + P - 1 - program`` in odd rounds), so the program that took a round's
    heaviest tile takes the next round's lightest: tiles run heaviest first, and dealt round-robin the first programs
    would take the heaviest of every round."""
    programs = gl.num_programs(0)
    pid = gl.program_id(0)
    if ORDER == 1:
        pid = gl.where(k % 2 == 1, programs - 1 - pid, pid)
    return k * programs + pid


@gluon.jit
def _tile(query_start_loc_ptr, num_reqs, num_q_programs, num_heads, t, sub, ORDER: gl.constexpr):
    """Tile ``t``'s block ``sub`` -> (padding tile, has rows, request start, request length, first row, head).
    ``t // num_heads`` counts flat programs (of 128-row blocks, or with ``PAIRS`` of 256-row pairs) from the last
    (the heaviest blocks first), every head of one before the next; the next ``num_heads`` tiles write the rows past
    the last request (one per head, at ``sub`` 0); tiles after those do nothing. A pair j of a request of n blocks
    is its blocks j (``sub`` 0) and n - 1 - j (``sub`` 1, when that is another block)."""
    idx = t // num_heads
    head = t % num_heads
    is_pad = (idx == num_q_programs) & (sub == 0)  # past it (a program's last round): nothing
    active = idx < num_q_programs  # (never with no requests: nothing is read then)
    pid = gl.maximum(num_q_programs - 1 - idx, 0)
    if ORDER == 2:
        seq, j = find_block(query_start_loc_ptr, num_reqs, pid, 4 * ROWS)
    else:
        seq, j = find_block(query_start_loc_ptr, num_reqs, pid, 2 * ROWS)
    start = gl.load(query_start_loc_ptr + seq, mask=active, other=0)
    seq_len = (gl.load(query_start_loc_ptr + seq + 1, mask=active, other=0) - start).to(gl.int32)
    if ORDER == 2:
        n_blocks = gl.cdiv(seq_len, 2 * ROWS)
        m_block = gl.where(sub == 0, j, n_blocks - 1 - j)
        own = (j >= 0) & gl.where(sub == 0, 2 * j < n_blocks, n_blocks - 1 - j > j)
    else:
        m_block = j
        own = j >= 0  # < 0 for ids before the first request's (query_start_loc[0] > 0)
    m_start = (m_block * (2 * ROWS)).to(gl.int32)
    return is_pad, active & own & (m_start < seq_len), start.to(gl.int64), seq_len, m_start, head


@gluon.jit
def _load_tiles(k_ptr, v_ptr, num_tokens, kv_width, stride_kt, stride_vt, k_smem, v_smem, ready, empty, fixed,
                query_start_loc_ptr, num_reqs, num_q_programs, num_heads, q_head_start, q_per_kv, kv_head_start,
                BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                PRODUCER_FIX: gl.constexpr):
    """The producer: every tile's K/V tiles into the ring, one counter across tiles (the consumers keep the same).
    It builds the descriptors it copies through, so the warp that issues the copies is the one that fenced them."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], k_ptr.dtype.element_ty)
    k_desc = tma.make_tensor_descriptor(k_ptr, shape=[num_tokens, kv_width], strides=[stride_kt, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, shape=[num_tokens, kv_width], strides=[stride_vt, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=layout)
    it = 0
    for k in range(gl.cdiv((num_q_programs + 1) * num_heads, gl.num_programs(0))):
        t = _tile_index(k, ORDER)
        for sub in range(2 if ORDER == 2 else 1):
            is_pad, valid, seq_start, seq_len, m_start, head = _tile(query_start_loc_ptr, num_reqs, num_q_programs,
                                                                     num_heads, t, sub, ORDER)
            if valid:
                column = ((q_head_start + head) // q_per_kv - kv_head_start) * HEAD_DIM
                row0 = seq_start.to(gl.int32)  # < 2^31 rows: checked on the host
                for i in range(gl.cdiv(gl.minimum(m_start + 2 * ROWS, seq_len), BLOCK_N)):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier's last phase: done
                    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, column], ready.index(s),
                                                    k_smem.index(s))
                    tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, column], ready.index(s),
                                                    v_smem.index(s))
                    if PRODUCER_FIX:
                        if (i + 1) * BLOCK_N > seq_len:  # rows past the request hold anything (NaN too)
                            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                            zero_tail_in_place(v_smem.index(s), seq_len - i * BLOCK_N, BLOCK_N)
                            mbarrier.arrive(fixed.index(s), count=1)
                    it += 1


@gluon.jit
def _block_serial(q_op, k_smem, v_smem, v_fix, ready, empty, fixed, it, fix_phases, m_start, seq_len, qk_scale,
                  offs_m, offs_n, zero_qk, acc, l_i, m_i, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  PRODUCER_FIX: gl.constexpr, qk_layout: gl.constexpr, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """A block's key tiles in turn: QK^T, softmax, P x V, each waited for. ``it``: the ring's tile counter."""
    n_tiles = gl.cdiv(gl.minimum(m_start + 2 * ROWS, seq_len), BLOCK_N)
    n_unmasked = m_start // BLOCK_N
    for i in range(n_unmasked):  # tiles wholly below the tile's first row, inside the request
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_m, offs_n, i * BLOCK_N,
                                     False, qk_layout, acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    for i in range(n_unmasked, n_tiles):  # the tiles the causal mask cuts (the last may pass the end)
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        v_tile, fix_phases = v_operand(v_smem, v_fix, fixed, s, fix_phases, i, seq_len, BLOCK_N, PRODUCER_FIX)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v_tile, qk_scale, offs_m, offs_n, i * BLOCK_N,
                                     True, qk_layout, acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    return acc, l_i, m_i, it, fix_phases


@gluon.jit
def _block_overlap(q_op, k_smem, v_smem, v_fix, ready, empty, fixed, it, fix_phases, m_start, seq_len, qk_scale,
                   offs_m, offs_n, zero_qk, acc, l_i, m_i, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   PRODUCER_FIX: gl.constexpr, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """A block's key tiles in FA3's order (``OVERLAP``). With 128-key tiles and 128-row blocks the causal mask cuts
    only the last tile, the block's diagonal ``m_start // BLOCK_N``. A tile's stage is released once P x V read it,
    so two stages are held at a time: with two in the ring, a tile's copy starts when the tile before it is needed
    (three stages, with ``PRODUCER_FIX``, keep one tile of slack as ``_block_serial`` has with two)."""
    gl.static_assert(BLOCK_N == 2 * ROWS)
    last = m_start // BLOCK_N  # the diagonal tile; tiles 0 .. last - 1 lie below the block's first row
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    if last == 0:
        p_op, m_i, l_i, _ = softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, 0, 0, CAUSAL, acc_layout, dtype)
    else:
        p_op, m_i, l_i, _ = softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, 0, 0, NO_MASK, acc_layout, dtype)
    for i in range(1, last):
        it, s, acc, p_op, m_i, l_i = overlap_tile(q_op, k_smem, v_smem, ready, empty, it, s, acc, p_op, m_i, l_i,
                                                  qk_scale, offs_m, offs_n, i * BLOCK_N, 0, zero_qk, NO_MASK, STAGES,
                                                  acc_layout, dtype)
    if last > 0:  # the diagonal tile (tile 0 was, if it is the only one)
        it, s, acc, p_op, m_i, l_i = overlap_tile(q_op, k_smem, v_smem, ready, empty, it, s, acc, p_op, m_i, l_i,
                                                  qk_scale, offs_m, offs_n, last * BLOCK_N, 0, zero_qk, CAUSAL,
                                                  STAGES, acc_layout, dtype)
    v_tile, fix_phases = v_operand(v_smem, v_fix, fixed, s, fix_phases, last, seq_len, BLOCK_N, PRODUCER_FIX)
    acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(s), count=1)
    return acc, l_i, m_i, it + 1, fix_phases


@gluon.jit
def _attend_tiles(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, v_fix, ready, empty, fixed, query_start_loc_ptr,
                  num_tokens, num_reqs, num_q_programs, num_heads, qk_scale, row_offset, stride_qt, stride_qh,
                  stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, ORDER: gl.constexpr, PRODUCER_FIX: gl.constexpr, OVERLAP: gl.constexpr,
                  WRITES_PADDING: gl.constexpr):
    """A consumer warpgroup: rows ``row_offset .. row_offset + ROWS`` of every tile; ``WRITES_PADDING``: this one
    writes the padding tiles' rows as (0, -inf)."""
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
    fix_phases = 0
    for k in range(gl.cdiv((num_q_programs + 1) * num_heads, gl.num_programs(0))):
        t = _tile_index(k, ORDER)
        for sub in range(2 if ORDER == 2 else 1):
            is_pad, valid, seq_start, seq_len, m_start, head = _tile(query_start_loc_ptr, num_reqs, num_q_programs,
                                                                     num_heads, t, sub, ORDER)
            out_head = head.to(gl.int64) * stride_oh
            lse_head = head.to(gl.int64) * stride_lh
            if is_pad:
                if WRITES_PADDING:
                    write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens, out_head, lse_head,
                                  stride_ot, stride_lt, ROWS, HEAD_DIM)
            elif valid:
                row0 = m_start + row_offset
                rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
                q = gl.load(q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1)
                            + head.to(gl.int64) * stride_qh + gl.expand_dims(cols_io, 0),
                            mask=gl.expand_dims(rows_io < seq_len, 1), other=0.0)
                q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
                offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
                m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
                l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
                acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
                if OVERLAP:
                    acc, l_i, m_i, it, fix_phases = _block_overlap(
                        q_op, k_smem, v_smem, v_fix, ready, empty, fixed, it, fix_phases, m_start, seq_len, qk_scale,
                        offs_m, offs_n, zero_qk, acc, l_i, m_i, BLOCK_N, STAGES, PRODUCER_FIX, acc_layout, dtype)
                else:
                    acc, l_i, m_i, it, fix_phases = _block_serial(
                        q_op, k_smem, v_smem, v_fix, ready, empty, fixed, it, fix_phases, m_start, seq_len, qk_scale,
                        offs_m, offs_n, zero_qk, acc, l_i, m_i, BLOCK_N, STAGES, PRODUCER_FIX, qk_layout, acc_layout,
                        dtype)
                store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len, out_head,
                           lse_head, stride_ot, stride_lt, acc_layout, io_layout)


@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def gluon_chunk_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr, num_tokens, num_reqs,
                       num_q_programs, num_heads, qk_scale, q_head_start, q_per_kv, kv_head_start, stride_qt, stride_qh,
                       stride_kt, stride_vt, stride_ot, stride_oh, stride_lt, stride_lh, kv_width,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                       PRODUCER_FIX: gl.constexpr, OVERLAP: gl.constexpr):
    """Grid (programs,), at most one per SM; ``num_q_programs``: ``_schedule.flat_programs`` of 128-row blocks
    (256-row pairs with ``PAIRS``);
    ``num_heads``: local Q heads; ``kv_width``: stored KV heads x head size (the descriptors' row width)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    k_smem, v_smem, ready, empty, fixed, fix_0, fix_1 = ring_buffers(dtype, STAGES, BLOCK_N, HEAD_DIM, PRODUCER_FIX,
                                                                     2)
    gl.warp_specialize([
        (_attend_tiles, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, fix_0, ready, empty, fixed, query_start_loc_ptr,
                         num_tokens, num_reqs, num_q_programs, num_heads, qk_scale, 0, stride_qt, stride_qh,
                         stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES, ORDER, PRODUCER_FIX,
                         OVERLAP, True)),
        (_attend_tiles, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, fix_1, ready, empty, fixed, query_start_loc_ptr,
                         num_tokens, num_reqs, num_q_programs, num_heads, qk_scale, ROWS, stride_qt, stride_qh,
                         stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_N, HEAD_DIM, STAGES, ORDER, PRODUCER_FIX,
                         OVERLAP, False)),
        (_load_tiles, (k_ptr, v_ptr, num_tokens, kv_width, stride_kt, stride_vt, k_smem, v_smem, ready, empty, fixed,
                       query_start_loc_ptr, num_reqs, num_q_programs, num_heads, q_head_start, q_per_kv,
                       kv_head_start, BLOCK_N, HEAD_DIM, STAGES, ORDER, PRODUCER_FIX)),
    ], [4, 1], [232, 40])


def plan_gluon_chunk(q, k, v, out, lse, query_start_loc, *, scale, q_head_start, q_per_kv, kv_head_start,
                     order: int = ORDER, stages: int = STAGES, producer_fix: bool = PRODUCER_FIX,
                     overlap: bool = OVERLAP) -> Launch:
    """``gluon_chunk_kernel`` prepared for tensors like these, called like ``chunk_attention_kernel``'s ``Launch``
    (``(q, k, v, out, lse, query_start_loc)``); the caller checked ``_gluon.chunk_takes_gluon``. ``order``: how
    tiles are dealt (``ROUND_ROBIN``, ``SNAKE``, ``PAIRS``); ``stages``, ``producer_fix``, ``overlap``: ``STAGES``,
    ``PRODUCER_FIX``, ``OVERLAP`` (benchmarks time each)."""
    if stages > 2 and not producer_fix:  # the two V copies and three stages: 256 KiB of shared memory (227 fit)
        raise ValueError(f"stages={stages} needs producer_fix=True (the V copies then leave room); use stages=2")
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs = query_start_loc.shape[0] - 1
    num_q_programs = flat_programs(num_tokens, num_reqs, (4 if order == PAIRS else 2) * ROWS.value)
    tiles = (num_q_programs + 1) * num_q_heads
    grid = (min(num_sms(device_index(q)), tiles),) if num_tokens and num_q_heads else (0,)
    return Launch(
        gluon_chunk_kernel, grid,
        (num_tokens, num_reqs, num_q_programs, num_q_heads, float(scale) * LOG2E, q_head_start, q_per_kv,
         kv_head_start, q.stride(0), q.stride(1), k.stride(0), v.stride(0), out.stride(0), out.stride(1),
         lse.stride(0), lse.stride(1), k.shape[1] * head_dim),
        dict(HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, STAGES=stages, ORDER=order, PRODUCER_FIX=bool(producer_fix),
             OVERLAP=bool(overlap)),
        num_warps=4, scratch=True)
