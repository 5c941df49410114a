"""The DCP current chunk: causal varlen attention of each sequence's queries to that sequence's own new K/V.

Flash-attention forward, one program per (query block, local Q head); query blocks are numbered over the whole
varlen batch (``_schedule``), so a step of many one-token rows and one long chunk launches about one program per
row plus the chunk's blocks. Key blocks strictly below the
query block's first row need no mask (the off-diagonal part); the keys inside the query block's own rows form the
diagonal part, masked causally. A step may instead bring a mask of its own (``chunk_mask``: a speculative verify
step's tree, where a draft token sees its ancestors only): every key block of the sequence is then read and masked
by it. Softmax runs in base 2 with ``scale * log2(e)`` folded into one multiplier; the LSE is converted
to natural log once, at the end. On sm_90 with Triton 3.6 (unless ``DCP_TRITON_GLUON=0``),
``plan_chunk`` runs the persistent Gluon kernel (``gluon_chunk``) where ``_gluon.chunk_takes_gluon`` allows.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import (
    INDEX_DTYPES, LOG2E, Launch, check_head_map, check_int, check_kernel_tensor, check_out, check_shape,
    descriptor_ready, next_pow2, tma_available,
)
from dcp_plugin.kernels import _plan_cache
from dcp_plugin.kernels._gluon import chunk_takes_gluon
from dcp_plugin.kernels._schedule import find_block, flat_programs
from dcp_plugin.kernels.checks import check_chunk_mask

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V tiles through tensor descriptors (sm_90+ TMA), where the tensors allow (``_tma_ok``)


# Hopper defaults for fp16/bf16 by padded head dim (the benchmark sweeps candidates through ``config=``). H200, bf16, 2
# x 4096 causal, 32 Q / 8 KV heads: D=128 with K/V through tensor descriptors 479 TFLOP/s, against 394 with pointer
# loads; D=64 304, no other candidate more than 2% faster (docs/kernels.md, current chunk). D=256 (16 Q / 2 KV heads,
# 16 x 1024 and 4 x 4096), H100: 128 x 64 tiles through tensor descriptors 306 and 458 TFLOP/s against 278 and 412
# with pointer loads, the best of 6 candidates that fit sm_90's shared memory (H200 with pointer loads 289 and 408,
# 0.55x and 0.64x FA3's; docs/kernels.md, head size 256).
GPU_CONFIGS = {
    64: ChunkConfig(block_m=128, block_n=128, num_warps=4, num_stages=3),
    128: ChunkConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=True),
    256: ChunkConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=True),
}
# Steps whose chunks hold at most SHORT_CHUNK rows (max_query_len): D=128 in 64-row tiles, four warps, two programs
# per SM (162 registers, 113 KiB of shared memory on sm_90), whose starts and ends then overlap: H200, bf16, 32 Q /
# 8 KV heads, 325 TFLOP/s at 16 x 1024 and 395 at 4 x 2048 against 288 and 389 for GPU_CONFIGS' 128-row tiles, which
# win at 2 x 4096 (461 against 437; docs/kernels.md, current chunk).
SHORT_CHUNK = 2048
GPU_SHORT_CONFIGS = {128: ChunkConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)}
# fp32 tiles take twice the shared memory; fp32 is for tests, so one small tile fits every head dim.
GPU_FP32_CONFIG = ChunkConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
# The interpreter pays per tile operation: small tiles keep CPU tests fast.
INTERPRET_CONFIG = ChunkConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


@triton.jit
def _attend_key_block(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, n_start, seq_len, offs_m, offs_n, offs_d,
                      qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, mask_base, stride_mi, stride_mj,
                      HEAD_DIM: tl.constexpr, IS_DIAGONAL: tl.constexpr, MASK_KV: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, USE_MASK: tl.constexpr):
    """One online-softmax step over keys ``n_start + offs_n``; scores in base-2 units. ``USE_TMA``: the tiles come
    through the sequence's tensor descriptors, which read rows past its end as zeros, as the masked loads do.
    ``USE_MASK``: the step's own mask (``mask_base``: the sequence's ``[rows, keys]``) decides which keys a row sees;
    a row may then see none in a block, so the running maximum stays -inf safely (0 stands in for it)."""
    offs_kn = n_start + offs_n  # int32: positions inside one sequence
    if USE_TMA:
        k = k_desc.load([tl.cast(n_start, tl.int32), 0])  # [BLOCK_N, BLOCK_D]; descriptor offsets are 32-bit
        v = v_desc.load([tl.cast(n_start, tl.int32), 0])  # [BLOCK_N, BLOCK_D]
    else:  # element offsets in 64 bits: a token stride times a position can pass 2^31
        k_ptrs = k_base + offs_kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :] * stride_vd
        if MASK_KV:
            kv_mask = (offs_kn < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if USE_MASK:
        seen = tl.load(mask_base + offs_m[:, None] * stride_mi + offs_kn[None, :] * stride_mj,
                       mask=(offs_m < seq_len)[:, None] & (offs_kn < seq_len)[None, :], other=0)
        qk = tl.where(seen != 0, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return acc, l_i, m_new
    if IS_DIAGONAL:
        # Rows past the sequence end see masked (zero) keys too; they are never stored.
        qk = tl.where(offs_m[:, None] >= offs_kn[None, :], qk, float("-inf"))
    # Every row sees at least one key (off-diagonal: all; diagonal: its own), so m_new is finite: no NaN guard.
    # The scale (> 0) is applied to the row maximum and folded into the exponent's argument: one FMA per score.
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Per-step sizes are not specialized on: one compiled variant serves every step.
@triton.jit(do_not_specialize=("num_tokens", "num_reqs", "num_q_programs"))
def chunk_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr, mask_ptr,
    num_tokens, num_reqs, num_q_programs, qk_scale, q_head_start, q_per_kv, kv_head_start,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_mb, stride_mi, stride_mj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, USE_MASK: tl.constexpr,
):
    """Grid (num_q_programs + 1, local Q heads); the last program of each head writes (0, -inf) to the padding rows
    past query_start_loc[num_reqs], however many (a CUDA graph's padding: a few rows, as a rule). ``USE_MASK``: row
    ``i`` of sequence ``b`` sees its key ``j`` where ``mask[b, i, j]`` is nonzero (uint8), instead of ``j <= i``."""
    LN2: tl.constexpr = 0.6931471805599453
    # Reversed: the tail (cheap) and each sequence's last query blocks (the most keys) start first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    out_head = out_ptr + head.to(tl.int64) * stride_oh
    lse_head = lse_ptr + head.to(tl.int64) * stride_lh

    if pid >= num_q_programs:
        for first in range(tl.load(query_start_loc_ptr + num_reqs).to(tl.int64), num_tokens, BLOCK_M):
            rows = first + offs_m
            row_mask = rows < num_tokens
            tl.store(out_head + rows[:, None] * stride_ot + offs_d[None, :] * stride_od,
                     tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & d_mask[None, :])
            tl.store(lse_head + rows * stride_lt, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_mask)
        return

    seq, m_block = find_block(query_start_loc_ptr, num_reqs, pid, BLOCK_M)
    seq_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # Positions inside a sequence in 32 bits (the loops, masks and descriptor offsets); addresses in 64.
    seq_len = (tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)).to(tl.int32)
    m_start = (m_block * BLOCK_M).to(tl.int32)
    if m_start >= seq_len:
        return

    kv_head = ((q_head_start + head) // q_per_kv - kv_head_start).to(tl.int64)
    offs_m += m_start
    q_rows = seq_start + offs_m  # [BLOCK_M] int64
    m_mask = offs_m < seq_len
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = k_ptr + seq_start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + seq_start * stride_vt + kv_head * stride_vh
    if USE_TMA:  # descriptors over this sequence's rows of this KV head (stride 1 along D: checked on the host)
        k_desc = tl.make_tensor_descriptor(k_base, shape=[seq_len, HEAD_DIM], strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[seq_len, HEAD_DIM], strides=[stride_vt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = k_base
        v_desc = v_base

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    mask_base = mask_ptr + seq.to(tl.int64) * stride_mb
    if USE_MASK:  # the step's mask decides, over all the sequence's keys (a verify step's few)
        for n_start in range(0, seq_len, BLOCK_N):
            acc, l_i, m_i = _attend_key_block(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, n_start, seq_len, offs_m, offs_n, offs_d,
                qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, mask_base, stride_mi, stride_mj,
                HEAD_DIM=HEAD_DIM, IS_DIAGONAL=False, MASK_KV=True, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
                USE_MASK=True,
            )
    else:
        # Keys [0, m_start) all lie below every row of this block and inside the sequence: no mask.
        for n_start in range(0, m_start, BLOCK_N):
            acc, l_i, m_i = _attend_key_block(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, n_start, seq_len, offs_m, offs_n, offs_d,
                qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, mask_base, stride_mi, stride_mj,
                HEAD_DIM=HEAD_DIM, IS_DIAGONAL=False, MASK_KV=BLOCK_D != HEAD_DIM, DOT_PRECISION=DOT_PRECISION,
                USE_TMA=USE_TMA, USE_MASK=False,
            )
        for n_start in range(m_start, tl.minimum(m_start + BLOCK_M, seq_len), BLOCK_N):
            acc, l_i, m_i = _attend_key_block(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, n_start, seq_len, offs_m, offs_n, offs_d,
                qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, mask_base, stride_mi, stride_mj,
                HEAD_DIM=HEAD_DIM, IS_DIAGONAL=True, MASK_KV=True, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
                USE_MASK=False,
            )

    if USE_MASK:  # a row whose mask shows it no key: (0, -inf), the empty set's convention
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    else:
        out = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * LN2
    tl.store(out_head + q_rows[:, None] * stride_ot + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_head + q_rows * stride_lt, lse, mask=m_mask)


def _pick_config(head_dim: int, dtype: torch.dtype, config: ChunkConfig | None,
                 max_query_len: int | None = None) -> ChunkConfig:
    if config is None:
        padded = min(d for d in GPU_CONFIGS if d >= head_dim)
        if INTERPRET:
            config = INTERPRET_CONFIG
        elif dtype == torch.float32:
            config = GPU_FP32_CONFIG
        elif max_query_len is not None and max_query_len <= SHORT_CHUNK and padded in GPU_SHORT_CONFIGS:
            config = GPU_SHORT_CONFIGS[padded]
        else:
            config = GPU_CONFIGS[padded]
    if not isinstance(config, ChunkConfig) or config.block_m % config.block_n:
        raise ValueError(f"config must be an ChunkConfig whose block_m is a multiple of block_n, got {config!r}")
    return config


def chunk_attention(q, k, v, query_start_loc, max_query_len, *, scale, q_head_start, q_per_kv, kv_head_start,
                    out=None, lse=None, chunk_mask=None, config: ChunkConfig | None = None):
    """Causal attention of each sequence's queries to that sequence's own new keys (the DCP current chunk).

    ``q``: ``[T, Hq, D]`` (this rank's local Q heads), ``k``/``v``: ``[T, Hk, D]`` (the stored KV heads), all one
    dtype of fp16/bf16/fp32, any strides. ``query_start_loc``: ``[B + 1]`` int32/int64 on q's device; sequence ``b``
    is rows ``query_start_loc[b]:query_start_loc[b + 1]`` and query row ``i`` of it sees its key rows ``0..i``.
    ``max_query_len``: host int bounding every sequence length; it picks the tile sizes (any bound is correct: the
    grid covers any mix of lengths). Local Q head ``i`` reads KV head ``(q_head_start + i) // q_per_kv -
    kv_head_start``. D in 64/80/96/128/256.
    Returns ``(out [T, Hq, D], lse [T, Hq] float32, natural log)``; ``out`` (any float dtype, defaults to q's) and
    ``lse`` are written in place when given. Rows past ``query_start_loc[B]`` get (0, -inf). ``chunk_mask``
    (bool or uint8 ``[>= B, M, M]`` with ``M >= max_query_len``, on q's device): query row ``i`` of sequence ``b``
    sees key row ``j`` where ``chunk_mask[b, i, j]`` is true, instead of ``j <= i`` (a speculative tree); a row
    that sees no key gets (0, -inf). ``config`` overrides the tile table (benchmarks only).

    Example (rank with local Q heads 8..15 of a 32 Q / 2 KV model, k holding KV heads 0..1):
    ``o, l = chunk_attention(q, k, v, cu, 4096, scale=128**-0.5, q_head_start=8, q_per_kv=16, kv_head_start=0)``
    """
    # A call laid out like a recent one whose arguments passed the checks replays its plan (``_plan_cache``); a config
    # of its own or a chunk mask (bound to its plan) is checked and plans afresh.
    launch, (out, lse) = _plan_cache.checked(
        "chunk", (q, k, v, out, lse, query_start_loc), (max_query_len, scale, q_head_start, q_per_kv, kv_head_start),
        check=lambda: _checked_outputs(q, k, v, query_start_loc, max_query_len, scale=scale, q_head_start=q_head_start,
                                       q_per_kv=q_per_kv, kv_head_start=kv_head_start, out=out, lse=lse,
                                       chunk_mask=chunk_mask, config=config),
        outputs=lambda: _outputs(q, out, lse),
        plan=lambda o, o_lse: plan_chunk(q, k, v, o, o_lse, query_start_loc, max_query_len, scale=scale,
                                         q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=kv_head_start,
                                         chunk_mask=chunk_mask, config=None if config is None else
                                         _pick_config(q.shape[-1], q.dtype, config, max_query_len)),
        keep=config is None and chunk_mask is None)
    launch(q, k, v, out, lse, query_start_loc)
    return out, lse


def _checked_outputs(q, k, v, query_start_loc, max_query_len, *, scale, q_head_start, q_per_kv, kv_head_start, out,
                     lse, chunk_mask, config) -> tuple:
    """``chunk_attention``'s arguments checked, one clear line for a bad one -> ``(out, lse)``, made where None."""
    device = q.device if isinstance(q, torch.Tensor) else None
    check_kernel_tensor("q", q, ndim=3, device=device)
    check_kernel_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device)
    check_kernel_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=device)
    check_kernel_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_tokens, num_q_heads, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    check_shape("v", v, tuple(k.shape))
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} of q is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold B + 1 >= 1 offsets, got an empty tensor")
    check_int("max_query_len", max_query_len, low=0)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    check_head_map(num_q_heads=num_q_heads, q_head_start=q_head_start, q_per_kv=q_per_kv,
                   kv_head_start=kv_head_start, num_kv_heads=k.shape[1], kv_name="k")
    if chunk_mask is not None:
        check_chunk_mask(chunk_mask, query_start_loc.shape[0] - 1, max_query_len, device)
    if out is not None:
        check_out("out", out, tuple(q.shape), device)
    if lse is not None:
        check_out("lse", lse, (num_tokens, num_q_heads), device, dtypes=(torch.float32,))
    _pick_config(head_dim, q.dtype, config, max_query_len)  # a given config is checked here
    return _outputs(q, out, lse)


def _outputs(q, out, lse) -> tuple:
    """``(out, lse)``, each made where None: ``out`` like q, ``lse`` ``[T, Hq]`` float32."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse


def plan_chunk(q, k, v, out, lse, query_start_loc, max_query_len, *, scale, q_head_start, q_per_kv, kv_head_start,
               chunk_mask=None, config: ChunkConfig | None = None) -> Launch:
    """``chunk_attention`` prepared for tensors shaped like these (no checks): call it with ``(q, k, v, out, lse,
    query_start_loc)``. ``max_query_len`` picks the tiles (``SHORT_CHUNK``); the grid covers any mix of sequence
    lengths. ``chunk_mask`` is bound to the launch (the step's own tensor, read at every call)."""
    num_tokens, num_q_heads, head_dim = q.shape
    # sm_90, Triton 3.6 (DCP_TRITON_GLUON):
    if config is None and chunk_mask is None and chunk_takes_gluon(q, k, v, out):
        from dcp_plugin.kernels.gluon_chunk import plan_gluon_chunk

        return plan_gluon_chunk(q, k, v, out, lse, query_start_loc, scale=scale, q_head_start=q_head_start,
                                q_per_kv=q_per_kv, kv_head_start=kv_head_start)
    cfg = config or _pick_config(head_dim, q.dtype, None, max_query_len)
    num_reqs = query_start_loc.shape[0] - 1
    num_q_programs = flat_programs(num_tokens, num_reqs, cfg.block_m)
    grid = (num_q_programs + 1, num_q_heads) if num_tokens and num_q_heads else (0,)  # + 1: the padding rows
    # Without a mask the kernel never reads mask_ptr: query_start_loc stands in (a fixed pointer type, one variant).
    mask = query_start_loc if chunk_mask is None else chunk_mask.view(torch.uint8)
    mask_strides = (0, 0, 0) if chunk_mask is None else mask.stride()
    scalars = (num_tokens, num_reqs, num_q_programs, float(scale) * LOG2E, q_head_start, q_per_kv, kv_head_start,
               *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), *mask_strides)
    # fp32 inputs: exact fp32 products (TF32 would cost ~1e-3 relative error).
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                      USE_TMA=cfg.tma and _tma_ok(q, k, v, head_dim), USE_MASK=chunk_mask is not None)
    return Launch(chunk_attention_kernel, grid, scalars, constexprs, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, scratch=constexprs["USE_TMA"], bound=(mask,))


def _tma_ok(q, k, v, head_dim: int) -> bool:
    """Whether K and V can be read through tensor descriptors: ``tma_available``, the head dim is a power of two, and
    each tensor's base address, token stride and head stride are multiples of 16 bytes with unit stride along D (a
    TMA copy's requirements)."""
    if not tma_available(k.device) or head_dim != next_pow2(head_dim):
        return False
    return all(descriptor_ready(t, (0, 1)) for t in (k, v))
