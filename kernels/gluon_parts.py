"""The pieces the Gluon kernels (``gluon_prefix``, ``gluon_chunk``, ``gluon_decode``) share: where a program's block
lies, the epilogue and the padding rows, the online-softmax steps (each tile's steps in turn, or FA3's order inside a
warpgroup, ``overlap_tile``), the ring of K/V stages and its mbarriers, and the two ways V rows past a request's end
are zeroed before P x V (probability 0 times a NaN there would be NaN): into a consumer's copy, or by the producer in
place (``PRODUCER_FIX``). Imported only where ``_gluon`` allows the Gluon kernels (Triton 3.6, sm_90)."""

from __future__ import annotations

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)


@gluon.jit
def wait_for_previous_grid(PDL: gl.constexpr):
    """``_pdl.wait_for_previous_grid`` in Gluon: with ``PDL`` above 0, wait until the previous kernel's writes are
    visible, and with 1 let the next kernel launch. Call it before the kernel's first load. (A persistent kernel's
    main loop ends at its exit: 2 signals nothing, as 3.)"""
    if PDL > 0:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    if PDL == 1:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def find_block(query_start_loc_ptr, num_reqs, pid, BLOCK: gl.constexpr):
    """``_schedule.find_block`` in Gluon: ``(request, block within it)`` of program ``pid``."""
    lo = 0
    hi = num_reqs
    while lo < hi:  # last b with first(b) <= pid
        mid = (lo + hi) // 2
        if gl.load(query_start_loc_ptr + mid) // BLOCK + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    req = gl.maximum(lo - 1, 0)
    return req, pid - (gl.load(query_start_loc_ptr + req) // BLOCK + req)


@gluon.jit
def head_offset(head, heads_per_rank, stride_r, stride_h):
    """Offset of local Q head ``head`` in a plain (``heads_per_rank`` = all, ``stride_r`` 0) or rank-major output."""
    return (head // heads_per_rank).to(gl.int64) * stride_r + (head % heads_per_rank).to(gl.int64) * stride_h


@gluon.jit
def store_rows(out_ptr, lse_ptr, acc, l_i, m_i, rows_io, cols_io, offs_m, seq_start, seq_len, out_head, lse_head,
               stride_ot, stride_lt, acc_layout: gl.constexpr, io_layout: gl.constexpr):
    """A warpgroup's epilogue: ``acc / l`` and the LSE of its rows that lie in the request (``rows_io`` in
    ``io_layout``, ``offs_m`` in the scores' row layout); a row that saw no key (``l`` 0) gets (0, -inf).
    ``out_head``/``lse_head``: the head's offsets (``head_offset``)."""
    empty_row = l_i == 0.0
    l_acc = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, acc_layout))
    out = gl.convert_layout((acc / gl.expand_dims(l_acc, 1)).to(out_ptr.dtype.element_ty), io_layout)
    gl.store(out_ptr + gl.expand_dims((seq_start + rows_io).to(gl.int64) * stride_ot, 1) + out_head
             + gl.expand_dims(cols_io, 0), out, mask=gl.expand_dims(rows_io < seq_len, 1))
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    gl.store(lse_ptr + (seq_start + offs_m).to(gl.int64) * stride_lt + lse_head, lse, mask=offs_m < seq_len)


@gluon.jit
def write_padding(out_ptr, lse_ptr, query_start_loc_ptr, num_reqs, num_tokens, out_head, lse_head, stride_ot,
                  stride_lt, ROWS_AT_ONCE: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The rows past ``query_start_loc[num_reqs]`` (a CUDA graph's padding) of one head as (0, -inf), by one
    warpgroup, ``ROWS_AT_ONCE`` rows a step."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows0 = gl.arange(0, ROWS_AT_ONCE, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for first in range(gl.load(query_start_loc_ptr + num_reqs).to(gl.int64), num_tokens, ROWS_AT_ONCE):
        rows = first + rows0
        keep = rows < num_tokens
        gl.store(out_ptr + gl.expand_dims(rows * stride_ot, 1) + out_head + gl.expand_dims(cols, 0),
                 gl.zeros([ROWS_AT_ONCE, HEAD_DIM], out_ptr.dtype.element_ty, layout=layout),
                 mask=gl.expand_dims(keep, 1))
        gl.store(lse_ptr + rows * stride_lt + lse_head,
                 gl.full([ROWS_AT_ONCE], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout)), mask=keep)


@gluon.jit
def online_step(acc, l_i, m_i, qk, v_tile, qk_scale, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """One online-softmax step over a key tile's scores ``qk`` (masked keys already -inf; scores in base 2); P x V is
    issued and in flight on return. Every row sees a key, so its maximum is finite."""
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    return warpgroup_mma(p_op, v_tile, acc, is_async=True), l_i, m_new


@gluon.jit
def zero_rows_past(v_tile, v_fix, valid, BLOCK_N: gl.constexpr):
    """``v_fix`` = ``v_tile`` with rows ``valid ..`` zeroed, 32 rows at a time (this warpgroup's own copy)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(BLOCK_N // 32):
        part = v_tile.slice(c * 32, 32).load(layout)
        v_fix.slice(c * 32, 32).store(gl.where(gl.expand_dims(c * 32 + rows < valid, 1), part, 0.0).to(part.dtype))
    fence_async_shared()


@gluon.jit
def zero_tail_in_place(v_tile, valid, BLOCK_N: gl.constexpr):
    """The producer warp: rows ``valid ..`` of a landed V tile set to 0 in place, 8 rows at a time, then fenced for
    the consumers' warpgroup MMAs (``PRODUCER_FIX``)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(BLOCK_N // 8):
        if (c + 1) * 8 > valid:
            part = v_tile.slice(c * 8, 8).load(layout)
            v_tile.slice(c * 8, 8).store(gl.where(gl.expand_dims(c * 8 + rows < valid, 1), part, 0.0).to(part.dtype))
    fence_async_shared()


@gluon.jit
def v_operand(v_smem, v_fix, fixed, s, fix_phases, i, kv_len, BLOCK_N: gl.constexpr, PRODUCER_FIX: gl.constexpr):
    """Key tile ``i``'s V tile in stage ``s`` for P x V: rows past ``kv_len`` hold anything (NaN too: probability 0
    times NaN is NaN), so a tile that passes it is waited for until the producer zeroed them (``fixed``;
    ``fix_phases`` holds a parity bit per stage), or zeroed into this warpgroup's copy ``v_fix``."""
    v_tile = v_smem.index(s)
    if (i + 1) * BLOCK_N > kv_len:
        if PRODUCER_FIX:
            mbarrier.wait(fixed.index(s), (fix_phases >> s) & 1)
            fix_phases = fix_phases ^ (1 << s)
        else:
            zero_rows_past(v_smem.index(s), v_fix, kv_len - i * BLOCK_N, BLOCK_N)
            v_tile = v_fix
    return v_tile, fix_phases


# softmax_probs' masks: none, keys past the row (causal), keys at or past kv_len.
NO_MASK, CAUSAL, PAST_END = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)


@gluon.jit
def softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, n_start, kv_len, MASK: gl.constexpr,
                  acc_layout: gl.constexpr, dtype: gl.constexpr):
    """A key tile's softmax from its raw scores (keys ``n_start + offs_n``, masked as ``MASK`` says): P as P x V's
    register operand, the new row maxima and sums, and the factor that takes the accumulator to the new maxima."""
    if MASK == CAUSAL:
        qk = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(n_start + offs_n, 0), qk, float("-inf"))
    if MASK == PAST_END:
        qk = gl.where(gl.expand_dims(n_start + offs_n < kv_len, 0), qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    return p_op, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout))


@gluon.jit
def overlap_tile(q_op, k_smem, v_smem, ready, empty, it, s, acc, p_op, m_i, l_i, qk_scale, offs_m, offs_n, n_start,
                 kv_len, zero_qk, MASK: gl.constexpr, STAGES: gl.constexpr, acc_layout: gl.constexpr,
                 dtype: gl.constexpr):
    """FA3's order in a consumer warpgroup (``OVERLAP``): the ring's next key tile (keys ``n_start + offs_n``) has its
    QK^T issued with the previous tile's P x V (stage ``s``), its softmax run while P x V does, then the accumulator
    (with the previous tile in it) taken to the new maxima and the previous stage released. A masked tile's softmax
    waits for P x V (under it, ptxas serializes every warpgroup MMA of the kernel: C7513). Returns the new ring
    counter and stage, and the running state."""
    s_prev = s
    it += 1
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_smem.index(s_prev), acc, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # QK^T done (issued first); P x V in flight
    if MASK != NO_MASK:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    p_next, m_i, l_i, alpha = softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, n_start, kv_len, MASK,
                                            acc_layout, dtype)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(s_prev), count=1)
    return it, s, acc * gl.expand_dims(alpha, 1), p_next, m_i, l_i


@gluon.jit
def page_descriptors(k_base, v_base, tma_rows, width, stride_k_tok, stride_v_tok, HEAD_DIM: gl.constexpr,
                     PAGE: gl.constexpr):
    """Tensor descriptors over a paged cache's token rows (row = page * rows_per_block + token in page), ``width``
    elements of each, copied ``PAGE`` rows x ``HEAD_DIM`` at a time. Built by the warp that copies through them, so
    the warp that issues the copies is the one that fenced them."""
    page_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, HEAD_DIM], k_base.dtype.element_ty)
    k_desc = tma.make_tensor_descriptor(k_base, shape=[tma_rows, width], strides=[stride_k_tok, 1],
                                        block_shape=[PAGE, HEAD_DIM], layout=page_layout)
    v_desc = tma.make_tensor_descriptor(v_base, shape=[tma_rows, width], strides=[stride_v_tok, 1],
                                        block_shape=[PAGE, HEAD_DIM], layout=page_layout)
    return k_desc, v_desc


@gluon.jit
def copy_tiles(k_desc, v_desc, k_row, k_col, v_row, v_col, k_smem, v_smem, ready, empty, fixed, table_ptr,
               stride_bt_blk, rows_per_block, n_pages, n_tiles, kv_len, first, PAGE: gl.constexpr,
               PAGES: gl.constexpr, STAGES: gl.constexpr, PRODUCER_FIX: gl.constexpr):
    """The producer's copies of ``n_tiles`` key tiles into the ring from its ``first`` use on: tile i is pages
    ``PAGES * i ..`` of the table at ``table_ptr`` (page 0 past its ``n_pages``: those keys are masked), rows
    ``page * rows_per_block + k_row`` and columns from ``k_col`` (``v_row``, ``v_col`` for V), one mbarrier for all its
    copies. ``PRODUCER_FIX``: the last tile's V rows past ``kv_len`` zeroed here, in place, once they landed
    (``fixed`` tells the consumers)."""
    for i in range(n_tiles):
        use = first + i
        s = use % STAGES
        mbarrier.wait(empty.index(s), ((use // STAGES) & 1) ^ 1)  # a fresh barrier's previous phase counts as done
        mbarrier.expect(ready.index(s), PAGES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for j in gl.static_range(PAGES):
            entry = i * PAGES + j
            page = gl.load(table_ptr + entry * stride_bt_blk, mask=entry < n_pages, other=0).to(gl.int32)
            tma.async_copy_global_to_shared(k_desc, [page * rows_per_block + k_row, k_col], ready.index(s),
                                            k_smem.index(s).slice(j * PAGE, PAGE))
            tma.async_copy_global_to_shared(v_desc, [page * rows_per_block + v_row, v_col], ready.index(s),
                                            v_smem.index(s).slice(j * PAGE, PAGE))
        if PRODUCER_FIX:
            if (i + 1) * (PAGE * PAGES) > kv_len:  # the last tile: rows past the context hold anything (NaN too)
                mbarrier.wait(ready.index(s), (use // STAGES) & 1)
                zero_tail_in_place(v_smem.index(s), kv_len - i * (PAGE * PAGES), PAGE * PAGES)
                mbarrier.arrive(fixed.index(s), count=1)


@gluon.jit
def load_pages(k_head, v_head, tma_rows, stride_k_tok, stride_v_tok, k_smem, v_smem, ready, empty, fixed, table_ptr,
               stride_bt_blk, rows_per_block, n_pages, n_tiles, kv_len, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
               PAGES: gl.constexpr, STAGES: gl.constexpr, PRODUCER_FIX: gl.constexpr):
    """The producer of a program that streams one KV head's tiles once: ``copy_tiles`` through descriptors over
    that head's token rows (``page_descriptors`` at ``k_head``/``v_head``, ``HEAD_DIM`` wide)."""
    k_desc, v_desc = page_descriptors(k_head, v_head, tma_rows, HEAD_DIM, stride_k_tok, stride_v_tok, HEAD_DIM, PAGE)
    copy_tiles(k_desc, v_desc, 0, 0, 0, 0, k_smem, v_smem, ready, empty, fixed, table_ptr, stride_bt_blk,
               rows_per_block, n_pages, n_tiles, kv_len, 0, PAGE, PAGES, STAGES, PRODUCER_FIX)


@gluon.jit
def attend_overlap(q_op, k_smem, v_smem, v_fix, ready, empty, fixed, acc, m_i, l_i, n_tiles, kv_len, qk_scale,
                   offs_m, offs_n, zero_qk, first, fix_phases, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   PRODUCER_FIX: gl.constexpr, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """A consumer warpgroup's pass over ``n_tiles`` key tiles of the ring from its ``first`` use on, in FA3's order
    (``overlap_tile``): keys ``0 .. n_tiles * BLOCK_N`` of which those at or past ``kv_len`` are masked (only the
    last tile may hold any). ``fix_phases``: ``v_operand``'s parity bits. Returns ``(acc, m_i, l_i, fix_phases)``,
    unchanged when there is no tile."""
    last = n_tiles - 1
    if n_tiles > 0:
        it = first
        s = first % STAGES
        mbarrier.wait(ready.index(s), (first // STAGES) & 1)
        qk = warpgroup_mma(q_op, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        if last == 0:
            p_op, m_i, l_i, _ = softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, 0, kv_len, PAST_END,
                                              acc_layout, dtype)
        else:
            p_op, m_i, l_i, _ = softmax_probs(qk, m_i, l_i, qk_scale, offs_m, offs_n, 0, kv_len, NO_MASK,
                                              acc_layout, dtype)
        for i in range(1, last):
            it, s, acc, p_op, m_i, l_i = overlap_tile(q_op, k_smem, v_smem, ready, empty, it, s, acc, p_op, m_i, l_i,
                                                      qk_scale, offs_m, offs_n, i * BLOCK_N, kv_len, zero_qk, NO_MASK,
                                                      STAGES, acc_layout, dtype)
        if last > 0:
            it, s, acc, p_op, m_i, l_i = overlap_tile(q_op, k_smem, v_smem, ready, empty, it, s, acc, p_op, m_i, l_i,
                                                      qk_scale, offs_m, offs_n, last * BLOCK_N, kv_len, zero_qk,
                                                      PAST_END, STAGES, acc_layout, dtype)
        v_last, fix_phases = v_operand(v_smem, v_fix, fixed, s, fix_phases, last, kv_len, BLOCK_N, PRODUCER_FIX)
        acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    return acc, m_i, l_i, fix_phases


@gluon.jit
def ring_buffers(dtype: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 PRODUCER_FIX: gl.constexpr, CONSUMERS: gl.constexpr):
    """The ring the Gluon kernels stream K/V through: ``STAGES`` K and V tiles, their ``ready`` / ``empty``
    mbarriers (each of the ``CONSUMERS`` consumer warpgroups releases a stage), and where V rows past the end get
    zeroed: per stage a ``fixed`` mbarrier the producer arrives on (``PRODUCER_FIX``), or a V copy per consumer
    (``fix_0``, ``fix_1``). Returns ``(k_smem, v_smem, ready, empty, fixed, fix_0, fix_1)``; the unused ones stand
    in for others."""
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    if PRODUCER_FIX:
        fixed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(fixed.index(s), count=1)
        fix_0 = v_smem.index(0)
        fix_1 = v_smem.index(0)
    else:
        v_fix = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem_layout)  # a last V tile each
        fix_0 = v_fix.index(0)
        fix_1 = v_fix.index(1)
        fixed = ready
    return k_smem, v_smem, ready, empty, fixed, fix_0, fix_1
