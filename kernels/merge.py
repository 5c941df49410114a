"""LSE math over partial attention results: ``merge_states``, ``merge_partials``, ``rescale_partial``.

One kernel serves the three. A partial is ``(O [T, H, D], LSE [T, H])`` over a disjoint key set; the kernel reads
``N`` LSEs per (token, head) (plus an optional extra partial), forms the global LSE and weights exactly as in
docs/design.md section 2 (+inf LSE counts as empty; weight 0 contributes exactly 0, whatever its O holds; a NaN LSE
makes the row NaN), and accumulates the O of a contiguous range of those partials.
"""

from __future__ import annotations

import dataclasses

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import (
    Launch, cdiv, check_heads_out, check_kernel_tensor, check_out, check_shape, head_strides, next_pow2,
)

LSE_DTYPES = (torch.float32,)


@dataclasses.dataclass(frozen=True, slots=True)
class MergeConfig:
    """``block_elems``: O elements per program (heads per program = block_elems // padded head dim)."""

    block_elems: int
    num_warps: int


# Memory-bound: 1K-element (token, head-block) tiles over 64 threads, two 16-byte loads per thread and partial.
# H200, 8192 tokens x 32 heads x D=128, fraction of copy bandwidth: merge bf16 0.87, 4-way a2a merge from a
# packed fp32 buffer + bf16 extra 0.90, rescale 0.82 (4K-element tiles: 0.77 / 0.85 / 0.78).
GPU_CONFIG = MergeConfig(block_elems=1024, num_warps=2)
# The interpreter pays per program: one program per token.
INTERPRET_CONFIG = MergeConfig(block_elems=1 << 30, num_warps=1)


@triton.jit
def _sanitized_lse(lse_ptrs, mask):
    lse = tl.load(lse_ptrs, mask=mask, other=float("-inf"))
    # +inf LSE means "no keys" (FA2 reports +inf for empty rows). A NaN LSE stays NaN: it came from a NaN input and
    # makes the row's weights, output and LSE NaN below, as unsharded attention would, never a finite wrong answer.
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit(do_not_specialize=("stride_pln",))  # LSE strides scale with the token count (LSE loads are scalar)
def merge_kernel(
    parts_out_ptr, parts_lse_ptr, extra_out_ptr, extra_lse_ptr, out_ptr, lse_out_ptr,
    num_heads, num_parts, o_part_start, num_o_parts,
    stride_pon, stride_pot, stride_poh, stride_pod,
    stride_pln, stride_plt, stride_plh,
    stride_eot, stride_eoh, stride_eod,
    stride_elt, stride_elh,
    out_heads_per_rank, stride_or, stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
):
    """out[t, h] = sum_i w_i O_i over parts [o_part_start, o_part_start + num_o_parts) (+ the extra partial),
    w_i = exp(lse_i - lse_total); lse_out = lse_total over all num_parts parts (+ extra). parts_out is indexed by
    the same part index as parts_lse (stride_pon may be 0). Head h of out lives at rank slot h // out_heads_per_rank
    (stride_or), head h % out_heads_per_rank there."""
    LOG2E: tl.constexpr = 1.4426950408889634
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = offs_h < num_heads
    hd_mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]

    # [BLOCK_H, BLOCK_P]
    lses = _sanitized_lse(
        parts_lse_ptr + token * stride_plt + offs_h[:, None] * stride_plh + offs_p[None, :].to(tl.int64) * stride_pln,
        h_mask[:, None] & (offs_p < num_parts)[None, :],
    )
    lse_max = tl.max(lses, axis=1)  # [BLOCK_H]
    if HAS_EXTRA:
        extra_lse = _sanitized_lse(extra_lse_ptr + token * stride_elt + offs_h * stride_elh, h_mask)
        lse_max = tl.maximum(lse_max, extra_lse)
    # All-empty rows: shift by 0 so every exp below is exp(-inf) = 0, not exp(-inf - -inf) = NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_sum = tl.sum(tl.exp2((lses - lse_max[:, None]) * LOG2E), axis=1)
    if HAS_EXTRA:
        weight_sum += tl.exp2((extra_lse - lse_max) * LOG2E)
    # All-empty rows keep weight_sum 0 and every scale exactly 0; dividing by 1 there avoids inf * 0. A NaN LSE
    # makes weight_sum and every scale NaN: no O is loaded (scale > 0 fails) and 0 * NaN is NaN.
    is_empty = weight_sum == 0
    inv_sum = 1.0 / tl.where(is_empty, 1.0, weight_sum)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for i in range(num_o_parts):
        part = (o_part_start + i).to(tl.int64)
        part_lse = _sanitized_lse(parts_lse_ptr + part * stride_pln + token * stride_plt + offs_h * stride_plh, h_mask)
        scale = tl.exp2((part_lse - lse_max) * LOG2E) * inv_sum  # [BLOCK_H]
        # Empty partials are not read at all: their O may hold garbage (NaN) that must not leak.
        part_o = tl.load(
            parts_out_ptr + part * stride_pon + token * stride_pot + offs_h[:, None] * stride_poh
            + offs_d[None, :] * stride_pod,
            mask=hd_mask & (scale > 0)[:, None], other=0.0,
        )
        acc += part_o.to(tl.float32) * scale[:, None]
    if HAS_EXTRA:
        scale = tl.exp2((extra_lse - lse_max) * LOG2E) * inv_sum
        extra_o = tl.load(
            extra_out_ptr + token * stride_eot + offs_h[:, None] * stride_eoh + offs_d[None, :] * stride_eod,
            mask=hd_mask & (scale > 0)[:, None], other=0.0,
        )
        acc += extra_o.to(tl.float32) * scale[:, None]

    out_rows = (offs_h // out_heads_per_rank).to(tl.int64) * stride_or + (offs_h % out_heads_per_rank) * stride_oh
    tl.store(out_ptr + token * stride_ot + out_rows[:, None] + offs_d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=hd_mask)
    lse_total = tl.where(is_empty, float("-inf"), lse_max + tl.log(tl.where(is_empty, 1.0, weight_sum)))
    tl.store(lse_out_ptr + token * stride_lt + offs_h * stride_lh, lse_total, mask=h_mask)


def plan_merge(parts_out, parts_lse, extra_out, extra_lse, out, lse, *, o_part_start: int = 0,
               num_o_parts: int | None = None) -> Launch:
    """The merge kernel prepared for tensors shaped like these (no checks): ``parts_out [N, T, H, D]`` (only parts
    ``o_part_start .. o_part_start + num_o_parts - 1`` are read, default all; stride 0 allowed), ``parts_lse
    [N, T, H]``, ``extra_*`` or ``None``, ``out [T, H, D]`` or rank-major ``[R, T, H / R, D]``, ``lse [T, H]``.
    Call it with the same six arguments (``None`` where ``extra_*`` was ``None``)."""
    num_parts, num_tokens, num_heads = parts_lse.shape
    head_dim = out.shape[-1]
    config = INTERPRET_CONFIG if INTERPRET else GPU_CONFIG
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, config.block_elems // block_d))
    has_extra = extra_out is not None
    # Without an extra partial its strides are zeros and its pointers stand-ins: out's and lse's, never read.
    extra_strides = (*extra_out.stride(), *extra_lse.stride()) if has_extra else (0,) * 5
    grid = (num_tokens, cdiv(num_heads, block_h)) if num_tokens and num_heads else (0,)
    scalars = (num_heads, num_parts, o_part_start, num_parts if num_o_parts is None else num_o_parts,
               *parts_out.stride(), *parts_lse.stride(), *extra_strides, *head_strides(out, 3), *lse.stride())
    return Launch(merge_kernel, grid, scalars,
                  dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_P=next_pow2(num_parts),
                       HAS_EXTRA=has_extra),
                  num_warps=config.num_warps, stand_ins=None if has_extra else {2: 4, 3: 5})


def _outputs(out, lse, shape: tuple, out_dtype: torch.dtype, device: torch.device, *, rank_major_out=False):
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    elif rank_major_out:
        check_heads_out("out", out, shape, device)
    else:
        check_out("out", out, shape, device)
    if lse is None:
        lse = torch.empty(shape[:2], dtype=torch.float32, device=device)
    else:
        check_out("lse", lse, shape[:2], device, dtypes=LSE_DTYPES)
    return out, lse


def _check_partial(out_name: str, part_out, lse_name: str, part_lse, device) -> None:
    check_kernel_tensor(out_name, part_out, ndim=3, device=device)
    check_kernel_tensor(lse_name, part_lse, ndim=2, dtypes=LSE_DTYPES, device=device)
    check_shape(lse_name, part_lse, tuple(part_out.shape[:2]))


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """Merge two partial attention results over disjoint key sets.

    ``out_a``, ``out_b``: ``[T, H, D]`` fp16/bf16/fp32 (dtypes may differ, any strides); ``lse_a``, ``lse_b``:
    ``[T, H]`` float32, natural log. Returns ``(out [T, H, D], lse [T, H] float32)``; ``out`` defaults to
    ``out_b``'s dtype. An empty side (LSE -inf or +inf) contributes exactly nothing; a NaN LSE gives NaN.

    Example: ``o, l = merge_states(prefix_o_f32, prefix_lse, chunk_o_bf16, chunk_lse)  # o is bf16``
    """
    device = out_b.device if isinstance(out_b, torch.Tensor) else None
    _check_partial("out_a", out_a, "lse_a", lse_a, device)
    check_kernel_tensor("out_b", out_b, ndim=3, device=device)
    check_shape("out_b", out_b, tuple(out_a.shape))
    _check_partial("out_b", out_b, "lse_b", lse_b, device)
    out, lse = _outputs(out, lse, tuple(out_b.shape), out_b.dtype, device)
    parts = (out_a.unsqueeze(0), lse_a.unsqueeze(0), out_b, lse_b, out, lse)
    plan_merge(*parts)(*parts)
    return out, lse


def merge_partials(parts_out, parts_lse, *, out=None, lse=None, extra_out=None, extra_lse=None):
    """Exact LSE-weighted merge of ``N`` partial results over disjoint key sets.

    ``parts_out``: ``[N, T, H, D]`` fp16/bf16/fp32, ``parts_lse``: ``[N, T, H]`` float32 (any strides, e.g.
    views of one received all-to-all buffer holding each rank's outputs and, bit-cast, their float32 LSEs).
    Optionally one more partial ``extra_out [T, H, D]`` / ``extra_lse [T, H]`` (the current chunk) joins in the
    same launch. Returns ``(out [T, H, D] in parts_out's dtype by default, lse [T, H] float32)``; all-empty rows
    give (0, -inf).

    Example (a fp32 buffer packed ``[N, T, H, D + 1]``, LSE last)::

        o, l = merge_partials(recv[..., :D], recv[..., D], extra_out=o_cur, extra_lse=lse_cur, out=o)
    """
    device = parts_out.device if isinstance(parts_out, torch.Tensor) else None
    check_kernel_tensor("parts_out", parts_out, ndim=4, device=device)
    check_kernel_tensor("parts_lse", parts_lse, ndim=3, dtypes=LSE_DTYPES, device=device)
    check_shape("parts_lse", parts_lse, tuple(parts_out.shape[:3]))
    if parts_out.shape[0] == 0:
        raise ValueError("parts_out must hold at least one partial (N >= 1), got N = 0")
    if (extra_out is None) != (extra_lse is None):
        raise ValueError("extra_out and extra_lse must be given together (or neither)")
    shape = tuple(parts_out.shape[1:])
    if extra_out is not None:
        _check_partial("extra_out", extra_out, "extra_lse", extra_lse, device)
        check_shape("extra_out", extra_out, shape)
    out, lse = _outputs(out, lse, shape, parts_out.dtype, device)
    parts = (parts_out, parts_lse, extra_out, extra_lse, out, lse)
    plan_merge(*parts)(*parts)
    return out, lse


def rescale_partial(part_out, lse_all, rank, *, out=None, lse=None):
    """The ``ag_rs`` merge's local step: scale rank ``rank``'s partial by its share of the global softmax mass.

    ``part_out``: ``[T, H, D]`` fp16/bf16/fp32; ``lse_all``: ``[N, T, H]`` float32, every rank's LSE (all-gathered).
    ``out`` may be ``[T, H, D]`` or rank-major ``[R, T, H / R, D]`` (head ``h`` at ``[h // (H / R), t, h % (H / R)]``:
    what a reduce-scatter along dim 0 gives each rank its heads from), any float dtype.
    Returns ``(scaled [T, H, D] float32 by default, lse [T, H] float32)`` with
    ``scaled = part_out * exp(lse_all[rank] - logsumexp(lse_all, 0))`` (exactly 0 where this rank is empty);
    summing ``scaled`` over ranks (the reduce-scatter) gives the merged output, ``lse`` is the merged LSE.

    Example: ``scaled, lse = rescale_partial(o_pre, gathered_lse, group.rank_in_group)``
    """
    device = part_out.device if isinstance(part_out, torch.Tensor) else None
    check_kernel_tensor("part_out", part_out, ndim=3, device=device)
    check_kernel_tensor("lse_all", lse_all, ndim=3, dtypes=LSE_DTYPES, device=device)
    check_shape("lse_all", lse_all, (None, *part_out.shape[:2]))
    num_ranks = lse_all.shape[0]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, {num_ranks}) (lse_all holds {num_ranks} ranks), got {rank!r}")
    out, lse = _outputs(out, lse, tuple(part_out.shape), torch.float32, device, rank_major_out=True)
    # Stride 0 over ranks: slot `rank` of this view is part_out, and only that slot is read.
    parts = (part_out.unsqueeze(0).expand(num_ranks, *part_out.shape), lse_all, None, None, out, lse)
    plan_merge(*parts, o_part_start=rank, num_o_parts=1)(*parts)
    return out, lse
