"""The inner loop of the prefix pass (``prefix_attention_kernel``): a split's tiles of cached tokens read through the
block table (``attend_split``), each folded into the online softmax of a tile of query rows (``attend_cached_tile``)."""

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import descriptor_ready, next_pow2, tma_available

_INTERPRET = tl.constexpr(INTERPRET)

# Tiles whose descriptor rows are read at once (``tile_rows``). A copy whose coordinates come from a load in the same
# loop iteration is an indirect load to Triton's pipeliner, which then keeps one tile in flight whatever
# num_stages says; rows read a chunk ahead leave the loop without loads, and num_stages - 1 copies stay in flight.
TMA_CHUNK = tl.constexpr(32)


@triton.jit
def tile_rows(table_ptr, first, end, stride_bt_blk, rows_per_block, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              CHUNK: tl.constexpr):
    """The descriptor rows of the ``CHUNK`` tiles from token ``first`` on (row ``page * rows_per_block + token in
    page``); tiles at or past ``end`` get row 0 and must not be read."""
    starts = first + tl.arange(0, CHUNK) * BLOCK_N
    pages = tl.load(table_ptr + (starts // PAGE_SIZE) * stride_bt_blk, mask=starts < end, other=0).to(tl.int32)
    return pages * rows_per_block + (starts % PAGE_SIZE).to(tl.int32)  # < 2^31: checked on the host


@triton.jit
def pick_row(rows, j, CHUNK: tl.constexpr):
    """Element ``j`` of ``tile_rows``' result, a scalar."""
    return tl.sum(tl.where(tl.arange(0, CHUNK) == j, rows, 0))


@triton.jit
def _row_here(table_ptr, n_start, stride_bt_blk, rows_per_block, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              USE_TMA: tl.constexpr):
    """The descriptor row of the tile at ``n_start``, read now (0 without descriptors: unused)."""
    row = 0
    if USE_TMA:
        row = pick_row(tile_rows(table_ptr, n_start, n_start + 1, stride_bt_blk, rows_per_block, PAGE_SIZE, BLOCK_N,
                                 1), 0, 1)
    return row


@triton.jit
def narrow_q(q, qk_scale, FP8_DOT: tl.constexpr, FP8_VIA_FP16: tl.constexpr):
    """``(q, qk_scale)`` for the products over an fp8 cache: with ``FP8_DOT``, q in e4m3 for fp8 products; with
    ``FP8_VIA_FP16`` (bf16 q, 16-bit products) q in fp16, because fp8 widens to fp16 in one instruction per two
    values and to bf16 in several, enough to make decode compute-bound. Either way q is first scaled by a power of
    two (exact) and the factor moves into the score scale: for e4m3 so that the tile's largest |q| lies in
    (2^7, 2^8] (e4m3's largest value is 448, and below 2^-6 it keeps fewer than its 3 mantissa bits), for fp16 down
    into |q| <= 2^15 only. A NaN or inf in q still gives NaN. Otherwise ``q`` as it is."""
    if FP8_DOT or FP8_VIA_FP16:
        q_f32 = q.to(tl.float32)
        top = tl.ceil(tl.log2(tl.max(tl.abs(q_f32))))
        if FP8_DOT:
            q_shift = tl.maximum(top - 8.0, -64.0)  # an all-zero tile: any shift
            q = (q_f32 * tl.exp2(-q_shift)).to(tl.float8e4nv)
        else:
            q_shift = tl.maximum(top - 15.0, 0.0)
            q = (q_f32 * tl.exp2(-q_shift)).to(tl.float16)
        qk_scale = qk_scale * tl.exp2(q_shift)
    return q, qk_scale


@triton.jit
def attend_split(q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, kv_start, kv_end, dims, dim_mask, qk_scale,
                 stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok, stride_vc_d, stride_bt_blk,
                 rows_per_block, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FP8_WIDEN: tl.constexpr, FP8_DOT: tl.constexpr,
                 USE_TMA: tl.constexpr, ROWS_AHEAD: tl.constexpr):
    """The online softmax of ``q`` [BLOCK_M, BLOCK_D] over cached tokens ``[kv_start, kv_end)`` (a split starts on a
    tile boundary): ``(acc, l_i, m_i)``, scores in base-2 units. ``ROWS_AHEAD`` (with ``USE_TMA``): descriptor rows
    read a chunk of tiles ahead; otherwise each tile's row is read in its own iteration. ``FP8_DOT`` (an e4m3
    cache, ``PrefixConfig.fp8_dot``): ``q`` is e4m3 and the products run in fp8 (1: Q x K, 2: P x V too)."""
    BLOCK_M: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Whole tiles first, with no token mask; then the split's last, partial tile (at most one), masked.
    full_end = kv_start + tl.maximum(kv_end - kv_start, 0) // BLOCK_N * BLOCK_N
    if USE_TMA and ROWS_AHEAD:  # the tiles' descriptor rows a chunk ahead (TMA_CHUNK says why)
        for chunk in range(kv_start, full_end, TMA_CHUNK * BLOCK_N):
            rows_ahead = tile_rows(table_ptr, chunk, full_end, stride_bt_blk, rows_per_block, PAGE_SIZE, BLOCK_N,
                                   TMA_CHUNK)
            for j in range(0, tl.minimum(TMA_CHUNK, (full_end - chunk) // BLOCK_N)):
                acc, l_i, m_i = attend_cached_tile(
                    acc, l_i, m_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, chunk + j * BLOCK_N,
                    kv_end, pick_row(rows_ahead, j, TMA_CHUNK), dims, dim_mask, qk_scale, stride_kc_blk,
                    stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok, stride_vc_d, stride_bt_blk,
                    PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, MASK_TOKENS=False, EVEN_D=EVEN_D,
                    DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8, FP8_WIDEN=FP8_WIDEN, FP8_DOT=FP8_DOT,
                    USE_TMA=USE_TMA)
    else:
        for n_start in range(kv_start, full_end, BLOCK_N):
            acc, l_i, m_i = attend_cached_tile(
                acc, l_i, m_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, n_start, kv_end,
                _row_here(table_ptr, n_start, stride_bt_blk, rows_per_block, PAGE_SIZE, BLOCK_N, USE_TMA), dims,
                dim_mask, qk_scale, stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok,
                stride_vc_d, stride_bt_blk, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, MASK_TOKENS=False, EVEN_D=EVEN_D,
                DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8, FP8_WIDEN=FP8_WIDEN, FP8_DOT=FP8_DOT,
                USE_TMA=USE_TMA)
    for n_start in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = attend_cached_tile(
            acc, l_i, m_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, n_start, kv_end,
            _row_here(table_ptr, n_start, stride_bt_blk, rows_per_block, PAGE_SIZE, BLOCK_N, USE_TMA), dims,
            dim_mask, qk_scale, stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk, stride_vc_tok, stride_vc_d,
            stride_bt_blk, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, MASK_TOKENS=True, EVEN_D=EVEN_D,
            DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8, FP8_WIDEN=FP8_WIDEN, FP8_DOT=FP8_DOT, USE_TMA=USE_TMA)

    return acc, l_i, m_i


@triton.jit
def attend_cached_tile(acc, l_i, m_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, table_ptr, n_start, kv_end, row,
                       dims, dim_mask, qk_scale, stride_kc_blk, stride_kc_tok, stride_kc_d, stride_vc_blk,
                       stride_vc_tok, stride_vc_d, stride_bt_blk, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASK_TOKENS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       KV_FP8: tl.constexpr, FP8_WIDEN: tl.constexpr, FP8_DOT: tl.constexpr,
                       USE_TMA: tl.constexpr):
    """One online-softmax step over cached tokens ``n_start + [0, BLOCK_N)``; scores in base-2 units.
    ``MASK_TOKENS``: the tile may pass ``kv_end`` (it always holds at least one token before it). ``USE_TMA``: the
    tile lies inside one page (``BLOCK_N`` divides ``PAGE_SIZE``) and comes through the tensor descriptors from
    their row ``row`` (``tile_rows``); otherwise ``row`` is unused and each token's page is looked up."""
    pos = n_start + tl.arange(0, BLOCK_N)
    pos_mask = pos < kv_end
    if USE_TMA:
        k = k_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
        v = v_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
        if MASK_TOKENS:  # the page's rows past kv_end hold anything (NaN too): they must add exactly nothing
            v = tl.where(pos_mask[:, None], v, tl.zeros_like(v))
        k = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    else:
        # Per-token page lookup: any page size works, tiles may span pages.
        if MASK_TOKENS:
            page = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_bt_blk, mask=pos_mask, other=0).to(tl.int64)
        else:
            page = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_bt_blk).to(tl.int64)
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        k_ptrs = k_head_ptr + (page * stride_kc_blk + in_page * stride_kc_tok)[None, :] + dims[:, None] * stride_kc_d
        v_ptrs = v_head_ptr + (page * stride_vc_blk + in_page * stride_vc_tok)[:, None] + dims[None, :] * stride_vc_d
        if MASK_TOKENS:
            k = tl.load(k_ptrs, mask=dim_mask[:, None] & pos_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(v_ptrs, mask=pos_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif not EVEN_D:
            k = tl.load(k_ptrs, mask=dim_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if KV_FP8 and FP8_DOT == 0:  # dequantize in registers (the scales are applied to scores and output)
        if FP8_WIDEN == 2:  # FP8_WIDEN: PrefixConfig.fp8_widen
            k = widen_fp8(k, q.dtype)
        else:
            k = k.to(q.dtype)
        if FP8_WIDEN >= 1:
            v = widen_fp8(v, q.dtype)
        else:
            v = v.to(q.dtype)
    elif KV_FP8 and FP8_DOT == 1:  # K meets the e4m3 q as stored; V widened for a 16-bit P x V
        v = widen_fp8(v, tl.float16)
    # FP8_DOT == 2: K and V as stored, P goes to e4m3 for P x V (probabilities <= 1: in range)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASK_TOKENS:
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
    # The scale (> 0) is applied to the row maximum and folded into the exponent's argument: one FMA per score.
    # Every tile holds a cached token, so each row's max is finite (no -inf - -inf).
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def widen_fp8(x, dtype: tl.constexpr):
    """``x.to(dtype)``. An fp8 tile widening to fp16 on a GPU goes through an opaque conversion instead (inline
    assembly Triton cannot see through): Triton would otherwise move the tile's shared-memory round trip to before
    ``.to``, and an 8-bit tile read as P x V's second operand (along its tokens) comes out of shared memory a byte
    at a time (benchmarks/probes/fp8_decode_sass.py counts the loop). e4m3: the hardware's paired conversion;
    e5m2: the byte is the top half of its fp16 value."""
    if (not _INTERPRET) and (dtype == tl.float16) and (x.dtype == tl.float8e4nv):
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    if (not _INTERPRET) and (dtype == tl.float16) and (x.dtype == tl.float8e5):
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, z, $2, 0x5040; prmt.b32 $1, z, $2, 0x7060; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(dtype)


def cache_takes_descriptors(key_cache, value_cache, head_dim: int, block_n: int) -> bool:
    """Whether whole tiles can come through tensor descriptors: the GPU has them (``tma_available``), a tile lies
    inside one page (``block_n`` divides the page size), the head dim is a power of two, and each cache reads as a
    2-D tensor of token rows (per KV head; unit stride along D, 16-byte aligned base and strides, the block stride a
    whole number of token strides, the same for K and V, and fewer than 2^31 rows: 32-bit descriptor offsets)."""
    num_blocks, page_size = key_cache.shape[:2]
    if not tma_available(key_cache.device) or head_dim != next_pow2(head_dim) or page_size % block_n:
        return False
    blk, tok = key_cache.stride()[:2]
    if tok < 1 or blk % tok:
        return False
    if not all(t.stride()[:2] == (blk, tok) and descriptor_ready(t, (0, 1, 2)) for t in (key_cache, value_cache)):
        return False
    return num_blocks * (blk // tok) < 2 ** 31
