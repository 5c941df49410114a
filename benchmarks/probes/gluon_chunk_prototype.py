"""Prototype: the DCP current chunk (causal varlen attention of a chunk's queries to its own keys) in Gluon for
sm_90, with the schedule Triton's ``tl`` cannot express there: a producer warp streams K/V tiles through TMA into a
ring of shared-memory stages (mbarriers, no program-wide barrier), and two consumer warpgroups, each owning 64 of
the block's 128 query rows, run their QK^T -> softmax -> PV loops independently, so one's softmax can overlap the
other's tensor-core work (FA3's ping-pong, left to drift rather than enforced).

Launched like ``chunk_attention_kernel`` (``plan_chunk``'s grid and arguments, 128-row blocks); head size 128,
bf16/fp16, K and V readable through tensor descriptors.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from dcp_plugin.kernels.gluon_chunk import softmax_step
from dcp_plugin.kernels.gluon_parts import find_block, store_rows, write_padding

@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, ready, empty, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer partition: tile i of K and V into stage i % STAGES once both consumers released it."""
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier's previous phase counts as done
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i * BLOCK_N, 0], ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [i * BLOCK_N, 0], ready.index(s), v_smem.index(s))


@gluon.jit
def _rescale(acc, m_i, qk, qk_scale, offs_m, offs_n, n_start, MASKED: gl.constexpr, acc_layout: gl.constexpr):
    """The first half of a softmax step: the new row maxima and the accumulator rescaled to them."""
    if MASKED:
        keep = gl.expand_dims(offs_m, 1) >= gl.expand_dims(n_start + offs_n, 0)
        qk = gl.where(keep, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
    return acc, qk, m_new, alpha


@gluon.jit
def _probs_pv(acc, l_i, alpha, qk, m_new, v_tile, qk_scale, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """The second half: probabilities, row sums, and P x V issued (in flight on return)."""
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    return warpgroup_mma(p_op, v_tile, acc, is_async=True), l_i


@gluon.jit
def _attend_rows(q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, n_tiles, n_unmasked, row0, seq_start,
                 seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                 ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 NUM_WARPS: gl.constexpr):
    """A consumer partition: query rows row0 .. row0 + ROWS of the sequence against every tile, the last masked."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    row_ok = gl.expand_dims(rows_io < seq_len, 1)
    q_ptrs = (q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1) + head.to(gl.int64) * stride_qh
              + gl.expand_dims(cols_io, 0))
    q = gl.load(q_ptrs, mask=row_ok, other=0.0)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))

    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    for i in range(n_unmasked):  # tiles wholly below the block's first row
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_m, offs_n, i * BLOCK_N,
                                      False, qk_layout, acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    for i in range(n_unmasked, n_tiles):  # the tiles the causal mask cuts
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v_smem.index(s), qk_scale, offs_m, offs_n, i * BLOCK_N,
                                      True, qk_layout, acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)

    store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len,
                head.to(gl.int64) * stride_oh, head.to(gl.int64) * stride_lh, stride_ot, stride_lt, acc_layout,
                io_layout)


@gluon.jit
def _attend_rows_overlap(q_ptr, out_ptr, lse_ptr, q_tile, k_smem, v_smem, ready, empty, n_tiles, n_unmasked, row0,
                         seq_start, seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                         stride_lh, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """``_attend_rows`` with tile i + 1's QK^T in flight on the tensor cores while tile i's softmax runs (FA3's
    intra-warpgroup overlap); a stage is released once the PV product that reads it is known complete."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    row_ok = gl.expand_dims(rows_io < seq_len, 1)
    q_ptrs = (q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1) + head.to(gl.int64) * stride_qh
              + gl.expand_dims(cols_io, 0))
    q_tile.store(gl.load(q_ptrs, mask=row_ok, other=0.0))  # the A operand from shared memory
    fence_async_shared()
    q_op = q_tile

    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    # Tile i + 1's QK^T is issued after tile i's rescale (which reads the accumulator) and waited for with tile i's
    # P x V at the end of the iteration: nothing reads a product in flight, so ptxas keeps the wgmmas asynchronous.
    mbarrier.wait(ready.index(0), 0)
    qk = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    for i in range(n_unmasked):  # tile i + 1 exists: the diagonal tile n_unmasked always does
        s_next = (i + 1) % STAGES
        acc, qk, m_new, alpha = _rescale(acc, m_i, qk, qk_scale, offs_m, offs_n, i * BLOCK_N, False, acc_layout)
        mbarrier.wait(ready.index(s_next), ((i + 1) // STAGES) & 1)
        qk_next = warpgroup_mma(q_op, k_smem.index(s_next).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        acc, l_i = _probs_pv(acc, l_i, alpha, qk, m_new, v_smem.index(i % STAGES), qk_scale, acc_layout, dtype)
        m_i = m_new
        qk, acc = warpgroup_mma_wait(num_outstanding=0, deps=(qk_next, acc))
        mbarrier.arrive(empty.index(i % STAGES), count=1)
    for i in range(n_unmasked, n_tiles):  # the masked tiles (one, or two when BLOCK_N is half the block)
        if i > n_unmasked:
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            qk = warpgroup_mma(q_op, k_smem.index(i % STAGES).permute((1, 0)), zero_qk, use_acc=False,
                               is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        acc, qk, m_new, alpha = _rescale(acc, m_i, qk, qk_scale, offs_m, offs_n, i * BLOCK_N, True, acc_layout)
        acc, l_i = _probs_pv(acc, l_i, alpha, qk, m_new, v_smem.index(i % STAGES), qk_scale, acc_layout, dtype)
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(i % STAGES), count=1)

    store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len,
                head.to(gl.int64) * stride_oh, head.to(gl.int64) * stride_lh, stride_ot, stride_lt, acc_layout,
                io_layout)


@gluon.jit
def _probs_next(qk, m_i, l_i, qk_scale, offs_m, offs_n, n_start, masked, acc_layout: gl.constexpr,
                dtype: gl.constexpr):
    """Tile ``n_start``'s softmax from its raw scores: the new row maxima, the factor that rescales the accumulator
    to them, the updated row sums and the probabilities as P x V's register operand. ``masked``: a runtime flag, the
    causal mask applies (the tiles the block's diagonal cuts)."""
    if masked:
        keep = gl.expand_dims(offs_m, 1) >= gl.expand_dims(n_start + offs_n, 0)
        qk = gl.where(keep, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    return p_op, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout))


@gluon.jit
def _attend_rows_fa3(q_ptr, out_ptr, lse_ptr, q_tile, k_smem, v_smem, ready, empty, my_turn, other_turn, n_tiles,
                     n_unmasked, row0, seq_start, seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_lt, stride_lh, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                     PINGPONG: gl.constexpr, FIRST: gl.constexpr, RESCALE_EARLY: gl.constexpr):
    """FA3's order within a warpgroup: tile i + 1's QK^T and tile i's P x V issued together, the scores waited for
    alone (the product stays in flight), tile i + 1's softmax under P x V, then the accumulator rescaled.
    ``PINGPONG``: the two consumer warpgroups take turns issuing (``my_turn`` / ``other_turn`` mbarriers, the
    ``FIRST`` one starts), so one's tensor-core work runs under the other's softmax. ``RESCALE_EARLY``: the
    accumulator's rescale for tile i between the two issues (under QK^T, FA3's place), not after P x V."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows_io = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    cols_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    row_ok = gl.expand_dims(rows_io < seq_len, 1)
    q_ptrs = (q_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_qt, 1) + head.to(gl.int64) * stride_qh
              + gl.expand_dims(cols_io, 0))
    q_tile.store(gl.load(q_ptrs, mask=row_ok, other=0.0))
    fence_async_shared()

    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qk_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=qk_layout)
    turn = 0  # issues so far: the turn mbarriers' phase
    mbarrier.wait(ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(my_turn, (turn & 1) ^ FIRST)
    qk = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn, count=1)
    turn += 1
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    p_op, m_i, l_i, alpha = _probs_next(qk, m_i, l_i, qk_scale, offs_m, offs_n, 0, n_unmasked == 0, acc_layout,
                                        dtype)
    for i in range(n_tiles - 1):
        s = i % STAGES
        s_next = (i + 1) % STAGES
        mbarrier.wait(ready.index(s_next), ((i + 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, (turn & 1) ^ FIRST)
        qk = warpgroup_mma(q_tile, k_smem.index(s_next).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        if RESCALE_EARLY:  # FA3: the accumulator rescaled for tile i while tile i + 1's QK^T runs
            acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn, count=1)
        turn += 1
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
        p_op, m_i, l_i, alpha = _probs_next(qk, m_i, l_i, qk_scale, offs_m, offs_n, (i + 1) * BLOCK_N,
                                            i + 1 >= n_unmasked, acc_layout, dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
        if not RESCALE_EARLY:
            acc = acc * gl.expand_dims(alpha, 1)
    last = n_tiles - 1
    if PINGPONG:
        mbarrier.wait(my_turn, (turn & 1) ^ FIRST)
    if RESCALE_EARLY:
        acc = acc * gl.expand_dims(alpha, 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn, count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(last % STAGES), count=1)

    store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len,
                head.to(gl.int64) * stride_oh, head.to(gl.int64) * stride_lh, stride_ot, stride_lt, acc_layout,
                io_layout)


@gluon.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def chunk_prototype_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr, num_tokens, num_reqs,
                           num_q_programs, qk_scale, q_head_start, q_per_kv, kv_head_start, stride_qt, stride_qh,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           OVERLAP: gl.constexpr, PINGPONG: gl.constexpr = False):
    """Grid (num_q_programs + 1, local Q heads), the numbering of ``chunk_attention_kernel``: programs in reverse
    (each sequence's last blocks, which see the most keys, start first), and the last program of each head writes
    (0, -inf) to the rows past query_start_loc[num_reqs]."""
    ROWS: gl.constexpr = 64  # per consumer warpgroup; the program's block is 2 * ROWS
    pid = gl.num_programs(0) - 1 - gl.program_id(0)
    head = gl.program_id(1)
    if pid >= num_q_programs:
        write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens, head.to(gl.int64) * stride_oh,
                       head.to(gl.int64) * stride_lh, stride_ot, stride_lt, 2 * ROWS, HEAD_DIM)
        return
    seq, m_block = find_block(query_start_loc_ptr, num_reqs, pid, 2 * ROWS)
    seq_start = gl.load(query_start_loc_ptr + seq).to(gl.int64)
    seq_len = (gl.load(query_start_loc_ptr + seq + 1) - gl.load(query_start_loc_ptr + seq)).to(gl.int32)
    m_start = (m_block * (2 * ROWS)).to(gl.int32)
    if m_start < seq_len:
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_head = ((q_head_start + head) // q_per_kv - kv_head_start).to(gl.int64)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        k_desc = tma.make_tensor_descriptor(k_ptr + seq_start * stride_kt + kv_head * stride_kh,
                                            shape=[seq_len, HEAD_DIM], strides=[stride_kt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=smem_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr + seq_start * stride_vt + kv_head * stride_vh,
                                            shape=[seq_len, HEAD_DIM], strides=[stride_vt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=smem_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        if OVERLAP != 0:
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
            q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
        n_tiles = gl.cdiv(gl.minimum(m_start + 2 * ROWS, seq_len), BLOCK_N)
        n_unmasked = m_start // BLOCK_N  # tiles wholly below the block's first row
        if OVERLAP >= 2:
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(2):
                mbarrier.init(turn.index(w), count=1)
            gl.warp_specialize([
                (_attend_rows_fa3, (q_ptr, out_ptr, lse_ptr, q_smem.index(0), k_smem, v_smem, ready, empty,
                                    turn.index(0), turn.index(1), n_tiles, n_unmasked, m_start, seq_start, seq_len,
                                    qk_scale, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                                    ROWS, BLOCK_N, HEAD_DIM, STAGES, 4, PINGPONG, 1, OVERLAP == 3)),
                (_attend_rows_fa3, (q_ptr, out_ptr, lse_ptr, q_smem.index(1), k_smem, v_smem, ready, empty,
                                    turn.index(1), turn.index(0), n_tiles, n_unmasked, m_start + ROWS, seq_start,
                                    seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                                    stride_lh, ROWS, BLOCK_N, HEAD_DIM, STAGES, 4, PINGPONG, 0, OVERLAP == 3)),
                (_load_kv, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_tiles, BLOCK_N, STAGES)),
            ], [4, 1], [232, 40])
        elif OVERLAP == 1:
            gl.warp_specialize([
                (_attend_rows_overlap, (q_ptr, out_ptr, lse_ptr, q_smem.index(0), k_smem, v_smem, ready, empty,
                                        n_tiles, n_unmasked, m_start, seq_start, seq_len, qk_scale, head,
                                        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                                        ROWS, BLOCK_N, HEAD_DIM, STAGES, 4)),
                (_attend_rows_overlap, (q_ptr, out_ptr, lse_ptr, q_smem.index(1), k_smem, v_smem, ready, empty,
                                        n_tiles, n_unmasked, m_start + ROWS, seq_start, seq_len, qk_scale, head,
                                        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                                        ROWS, BLOCK_N, HEAD_DIM, STAGES, 4)),
                (_load_kv, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_tiles, BLOCK_N, STAGES)),
            ], [4, 1], [232, 40])
        else:
            gl.warp_specialize([
                (_attend_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, n_tiles, n_unmasked,
                                m_start, seq_start, seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot,
                                stride_oh, stride_lt, stride_lh, ROWS, BLOCK_N, HEAD_DIM, STAGES, 4)),
                (_attend_rows, (q_ptr, out_ptr, lse_ptr, k_smem, v_smem, ready, empty, n_tiles, n_unmasked,
                                m_start + ROWS, seq_start, seq_len, qk_scale, head, stride_qt, stride_qh, stride_ot,
                                stride_oh, stride_lt, stride_lh, ROWS, BLOCK_N, HEAD_DIM, STAGES, 4)),
                (_load_kv, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_tiles, BLOCK_N, STAGES)),
            ], [4, 1], [232, 40])
