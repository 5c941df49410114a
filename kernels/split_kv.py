"""Split-KV partials of the prefix pass: where they live, the kernel that merges a request's splits by LSE, and the
prepared launch of both stages (``PrefixLaunch``).

A prefix-attention launch with ``S`` splits per request writes ``[T, H, S, D]`` float32 partial outputs and
``[T, H, S]`` LSEs (``split_views``), then ``split_merge_kernel`` merges each (token, head)'s splits into
the final ``out``/``lse``, which may be rank-major (``head_offsets``).
"""

from __future__ import annotations

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import (
    LOG2E, GrownBuffers, Launch, cdiv, device_index, every_variant_wanted, head_strides, next_pow2, num_sms,
)
from dcp_plugin.kernels._pdl import pdl_for, wait_for_previous_grid
from dcp_plugin.kernels._prefix_config import GPU_CONFIGS, INTERPRET_CONFIG, POINTER_CONFIGS
from dcp_plugin.kernels._schedule import MAX_AUTO_SPLITS, PROGRAMS_PER_SM, pick_num_splits

_LOG2E = tl.constexpr(LOG2E)
# The merge's two variants on a GPU, by the splits one step of its loop covers: the wide one takes any automatic split
# count in one step (one memory round trip: a small batch's 8-64 splits), the narrow one up to NARROW_SPLITS without
# computing over 56+ masked splits per (token, head) (a large batch's 2-8; with one KV head and 256 requests the wide
# one took 21 us a launch, more than a third of the decode pass; docs/kernels.md, decode). A step picks by
# its split count; the warm-up runs both (``PrefixLaunch``), so neither compiles while serving.
MERGE_SPLITS = MAX_AUTO_SPLITS
NARROW_SPLITS = 8
NARROW_HEADS = 4  # (token, head)s of one program in the narrow variant: 8 splits x 128 dims is little work
# A balanced decode's last split merges (``PrefixConfig.last_split_merges``) where the plan's bound keeps every request
# within LAST_MERGE_SPLITS splits (an average would not: one long context among short ones takes dozens) and the step
# has at least LAST_MERGE_PROGRAMS (token, head program)s: one program reads a (token, head program)'s partials one
# split after the other, which took longer than a merge launch spreading them over (token, head)s where a request
# takes many splits (1 x 8K, 32 splits: 30.4 against 19.9 us) or one request takes 8 (1 x 1K: 13.4 against 12.2 us),
# and saved the launch elsewhere (8 / 32 / 128 x 1K: 19.2 / 44.3 / 137.1 against 20.0 / 45.1 / 139.2 us; H200, 32 Q
# / 8 KV, 64-token pages; docs/kernels.md, decode).
LAST_MERGE_SPLITS = 8
LAST_MERGE_PROGRAMS = 64


@triton.jit
def head_offsets(head, heads_per_rank, stride_r, stride_h):
    """Offset of global head ``head`` in a plain (heads_per_rank = all) or rank-major output."""
    return (head // heads_per_rank).to(tl.int64) * stride_r + (head % heads_per_rank).to(tl.int64) * stride_h



@triton.jit
def merge_split_rows(part_out_ptr, part_lse_ptr, first_row, num_splits, dims, row_mask, dim_mask, head_dim,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(out, lse)`` of ``BLOCK_M`` rows merged by LSE from their ``num_splits`` partials (row ``r``'s at partial
    rows ``first_row[r] + s``, ``[rows, head_dim]`` float32 and ``[rows]``), one split after the other with a
    running maximum: the split pass's own merge (``LAST_MERGES``). The partials of other programs are read from L2
    (``.cg``), never from a stale L1 line. Every split empty: (0, -inf); a NaN LSE gives NaN. Every LSE in one
    load, then the partials four at a time with their loads independent of one another, was slower than the merge
    launch at 4-8 splits over 64-token pages (8 x 1K: 21.4 against 20.1 us in one run, where this loop took 19.2
    against 20.0 in another; over 16-token pages it gained, 20.9 against 21.6 us; docs/kernels.md, decode)."""
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(part_lse_ptr + first_row + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_out_ptr + (first_row + s)[:, None] * head_dim + dims[None, :],
                       mask=(row_mask & (lse != float("-inf")))[:, None] & dim_mask[None, :], other=0.0,
                       cache_modifier=".cg")
        new_max = tl.maximum(lse_max, lse)
        max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp2((lse_max - max_safe) * _LOG2E)
        weight = tl.exp2((lse - max_safe) * _LOG2E)
        acc = acc * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        lse_max = new_max
    total_safe = tl.where(total == 0.0, 1.0, total)
    return acc / total_safe[:, None], tl.where(total == 0.0, float("-inf"), lse_max + tl.log(total_safe))


@triton.jit(do_not_specialize=("num_splits", "stride_pl_t", "stride_pl_h", "stride_lse_r", "stride_lse_t",
                               "stride_lse_h"))
def split_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, split_counts_ptr,
    num_q_heads, num_splits, head_dim,
    stride_po_t, stride_po_h, stride_po_s, stride_po_d,
    stride_pl_t, stride_pl_h, stride_pl_s,
    out_heads_per_rank, stride_o_r, stride_o_t, stride_o_h, stride_o_d,
    stride_lse_r, stride_lse_t, stride_lse_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ELEMENTWISE: tl.constexpr = False,
    COUNTED: tl.constexpr = False,  # a balanced decode's partials: each token's own split count (below)
    PDL: tl.constexpr = 0,  # above 0: a programmatic dependent launch (_pdl): stage 1 may still be finishing
):
    """Merge the splits of BLOCK_H heads of one token by LSE, BLOCK_S splits per step with a running maximum, so
    any split count runs the same compiled kernel.
    ``ELEMENTWISE`` (the narrow variant): a step's BLOCK_S splits are unrolled and merged one after the other into
    each thread's own (head, dim) elements, so no sum or maximum crosses threads (the ``[S, H, D]`` sum over splits
    went through shared memory with bank conflicts in 84% of its traffic, Nsight Compute). The partial of a split
    whose LSE is -inf (no keys) is never read.
    ``COUNTED`` (a balanced decode): token ``t`` has ``split_counts[t]`` splits, the rest of its partials unwritten;
    with one, stage 1 wrote ``out``/``lse`` itself and there is nothing to merge."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    if COUNTED:  # at most the plan's count: a count left unwritten (a bug) cannot send the loop out of the buffer
        num_splits = tl.minimum(tl.load(split_counts_ptr + token), num_splits)
        if num_splits == 1:
            return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_q_heads
    dim_mask = dims < head_dim
    offs_s = tl.arange(0, BLOCK_S)
    lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    hd_mask = head_mask[:, None] & dim_mask[None, :]
    if ELEMENTWISE:
        lse_row = part_lse_ptr + token * stride_pl_t + heads.to(tl.int64) * stride_pl_h  # [H]
        part_rows = part_out_ptr + token * stride_po_t + heads.to(tl.int64)[:, None] * stride_po_h \
            + dims[None, :] * stride_po_d  # [H, D]
        for s_start in range(0, num_splits, BLOCK_S):
            for j in tl.static_range(BLOCK_S):
                live = head_mask & (tl.zeros([BLOCK_H], tl.int32) + s_start + j < num_splits)  # [H]
                lse = tl.load(lse_row + (s_start + j) * stride_pl_s, mask=live, other=float("-inf"))
                part = tl.load(part_rows + (s_start + j) * stride_po_s,
                               mask=(live & (lse != float("-inf")))[:, None] & dim_mask[None, :], other=0.0)
                new_max = tl.maximum(lse_max, lse)
                max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
                alpha = tl.exp2((lse_max - max_safe) * _LOG2E)
                weight = tl.exp2((lse - max_safe) * _LOG2E)  # NaN for a NaN LSE: total, out and lse follow
                acc = acc * alpha[:, None] + part * weight[:, None]
                total = total * alpha + weight
                lse_max = new_max
    else:
        lse_base = part_lse_ptr + token * stride_pl_t + heads.to(tl.int64)[None, :] * stride_pl_h  # [1, H]
        part_base = part_out_ptr + token * stride_po_t + heads.to(tl.int64)[None, :, None] * stride_po_h \
            + dims[None, None, :] * stride_po_d  # [1, H, D]
        for s_start in range(0, num_splits, BLOCK_S):
            split = s_start + offs_s
            lse = tl.load(lse_base + split[:, None] * stride_pl_s,
                          mask=(split < num_splits)[:, None] & head_mask[None, :], other=float("-inf"))  # [S, H]
            new_max = tl.maximum(lse_max, tl.max(lse, 0))
            max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            alpha = tl.exp2((lse_max - max_safe) * _LOG2E)  # 0 while nothing was seen
            weight = tl.exp2((lse - max_safe[None, :]) * _LOG2E)  # exactly 0 for an empty split (its O is 0)
            part = tl.load(part_base + split[:, None, None] * stride_po_s,
                           mask=(lse != float("-inf"))[:, :, None] & hd_mask[None, :, :], other=0.0)  # [S, H, D]
            acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 0)
            total = total * alpha + tl.sum(weight, 0)
            lse_max = new_max
    # Every split empty: (0, -inf). A NaN split LSE (from a NaN input) leaves total NaN, and out and lse with it.
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = acc / total_safe[:, None]
    lse = tl.where(total == 0.0, float("-inf"), lse_max + tl.log(total_safe))
    out_rows = out_ptr + token * stride_o_t + head_offsets(heads, out_heads_per_rank, stride_o_r, stride_o_h)
    tl.store(out_rows[:, None] + dims[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    lse_rows = lse_ptr + token * stride_lse_t + head_offsets(heads, out_heads_per_rank, stride_lse_r, stride_lse_h)
    tl.store(lse_rows, lse, mask=head_mask)


def merge_tiling(num_splits: int, num_heads: int, *, narrow: bool | None = None) -> tuple[int, int, bool]:
    """``(BLOCK_H, BLOCK_S, ELEMENTWISE)`` of the merge of ``num_splits`` splits of ``num_heads`` heads: on a GPU the
    narrow variant (elementwise) for up to ``NARROW_SPLITS`` splits, else the wide one (``narrow`` forces either);
    under the interpreter, where every program costs Python time, one program takes all heads of a token, 8 splits
    a step, summed as one tensor."""
    if narrow is None:
        if INTERPRET:
            return next_pow2(num_heads), 8, False
        narrow = num_splits <= NARROW_SPLITS
    return (min(NARROW_HEADS, next_pow2(num_heads)), NARROW_SPLITS, True) if narrow else (1, MERGE_SPLITS, False)


def plan_split_merge(part_out, part_lse, out, lse, *, narrow: bool | None = None, counted: bool = False) -> Launch:
    """The merge of ``S`` split partials (``split_views``) into ``out [T, H, D]``/``lse [T, H]`` (plain or
    rank-major); call it with ``(part_out, part_lse, out, lse, split_counts)``: ``split_counts`` ``[T]`` int32 with
    ``counted`` (each token's own split count), else None. ``narrow``: ``merge_tiling``'s."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    block_d = max(16, next_pow2(head_dim))
    heads, splits, elementwise = merge_tiling(num_splits, num_heads, narrow=narrow)
    pdl = pdl_for(part_out.device)
    return Launch(split_merge_kernel, (num_tokens, cdiv(num_heads, heads)),
                  (num_heads, num_splits, head_dim, *part_out.stride(), *part_lse.stride(),
                   *head_strides(out, 3), *head_strides(lse, 2)[1:]),
                  dict(BLOCK_H=heads, BLOCK_D=block_d, BLOCK_S=splits, ELEMENTWISE=elementwise, COUNTED=counted,
                       PDL=pdl),
                  num_warps=4 if block_d <= 128 else 8, stand_ins=None if counted else {4: 0}, pdl=pdl)


class PrefixLaunch:
    """``prefix_attention`` prepared for one step's tensor shapes; call it with ``(q, key_cache, value_cache,
    block_table, kv_lens, query_start_loc, out, lse)`` and, for an fp8 cache, ``k_scale, v_scale``. With
    several splits, stage 1 writes the partials into buffers the plan holds and stage 2 merges them into
    ``out``/``lse``; inside ``every_variant()`` (the warm-up) the merge's other variant (``merge_other``) runs
    first on the same partials, so a later step that picks it finds it compiled. ``split_counts`` (a balanced
    decode): stage 1 writes ``out``/``lse`` for the tokens of one split, the partials and each token's split count
    for the rest, and the merge reads those counts."""

    __slots__ = ("stage1", "merge", "merge_other", "part_out", "part_lse", "num_splits", "split_counts",
                 "_extra", "stage1_other")

    def __init__(self, stage1: Launch, merge: Launch | None, part_out, part_lse, num_splits: int,
                 merge_other: Launch | None = None, split_counts=None, stage1_extra: tuple = (),
                 stage1_other: tuple | None = None) -> None:
        self.stage1, self.merge, self.part_out, self.part_lse = stage1, merge, part_out, part_lse
        self.num_splits, self.merge_other, self.split_counts = num_splits, merge_other, split_counts
        self._extra = stage1_extra  # stage 1's trailing tensors: the tl kernel's partials and counts (or stand-ins)
        self.stage1_other = stage1_other  # (launch, its trailing tensors): the other LAST_MERGES choice (warm-up)

    def __call__(self, q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse,
                 k_scale=None, v_scale=None) -> None:
        counts = self.split_counts
        if self.stage1_other is not None and every_variant_wanted():  # writes out/lse, rewritten next
            launch, extra = self.stage1_other
            launch(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, k_scale,
                   v_scale, *extra)
        to_out = self.merge is None or counts is not None  # stage 1 writes out/lse (a balanced decode: some rows)
        self.stage1(q, key_cache, value_cache, block_table, kv_lens, query_start_loc,
                    out if to_out else self.part_out, lse if to_out else self.part_lse, k_scale, v_scale, *self._extra)
        if self.merge is None:
            return
        if self.merge_other is not None and every_variant_wanted():
            self.merge_other(self.part_out, self.part_lse, out, lse, counts)  # the same merge: rewritten next
        self.merge(self.part_out, self.part_lse, out, lse, counts)


# Split counters of standalone launches whose last split merges (``plan_prefix`` without ``split_sync``): zeroed, one
# buffer per device and stream, and every launch leaves them zero. Engines pass their workspace's own.
_SYNC = GrownBuffers(lambda count, key: torch.zeros(count, dtype=torch.int32, device=torch.device(*key[:2])))


def sync_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 split counters on ``device`` for launches on its current stream."""
    return _SYNC.on_stream(device, count)


def split_capacity(head_dim: int, device: torch.device) -> int:
    """float32 elements that hold the split partials of any automatic split count on ``device`` (``plan_prefix``'s
    ``split_buffer``): the split count keeps stage 1 within ``PROGRAMS_PER_SM`` programs per SM of at most
    ``block_m`` rows each, and a row's partial is ``head_dim + 1`` floats."""
    sms = num_sms(torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index or 0)
    block_m = max(c.block_m for c in (INTERPRET_CONFIG, *GPU_CONFIGS.values(), *POINTER_CONFIGS.values()))
    return PROGRAMS_PER_SM * sms * block_m * (head_dim + 1)


def split_views(buffer, num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device, *,
                counted: bool = False):
    """``[T, H, S, D]`` partial outputs, ``[T, H, S]`` LSEs and, with ``counted``, ``[T]`` int32 split counts (else
    None), carved from ``buffer`` (float32; or new)."""
    out_size, lse_size = num_tokens * num_heads * num_splits * head_dim, num_tokens * num_heads * num_splits
    size = out_size + lse_size + counted * num_tokens
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.float32, device=device)
    part_out = buffer[:out_size].view(num_tokens, num_heads, num_splits, head_dim)
    part_lse = buffer[out_size:out_size + lse_size].view(num_tokens, num_heads, num_splits)
    counts = buffer[out_size + lse_size:size].view(torch.int32) if counted else None
    return part_out, part_lse, counts


def with_split_stride(strides: tuple, split_stride: int) -> tuple:
    """(heads_per_rank, stride_r, stride_t, stride_h, stride_d) -> the kernel's order with the split stride."""
    heads_per_rank, stride_r, stride_t, stride_h, stride_d = strides
    return heads_per_rank, stride_r, stride_t, stride_h, split_stride, stride_d


def auto_splits(q, *, programs: int, max_kv_len: int, block_n: int, split_buffer,
                per_sm: int = PROGRAMS_PER_SM) -> int:
    """``pick_num_splits`` on q's GPU (1 under the interpreter), lowered until the partials fit in
    ``split_buffer``."""
    if INTERPRET:
        return 1
    return fit_splits(q, pick_num_splits(programs=programs, max_kv_len=max_kv_len, block_n=block_n,
                                         sms=num_sms(device_index(q)), per_sm=per_sm), split_buffer)


def fit_splits(q, splits: int, split_buffer, *, counted: bool = False) -> int:
    """``splits``, lowered until the partials of ``q``'s rows (and with ``counted`` their split counts) fit in
    ``split_buffer`` (None: any)."""
    if split_buffer is None:
        return splits
    per_split = max(q.shape[0] * q.shape[1] * (q.shape[2] + 1), 1)
    return max(1, min(splits, (split_buffer.numel() - counted * q.shape[0]) // per_split))


def split_outputs(q, out, lse, num_splits: int, split_buffer, *, balanced: bool = False):
    """Where stage 1 writes: ``(part_out, part_lse, split_counts, out_strides, lse_strides)``, the strides in the
    kernels' order (``with_split_stride``) of ``out``/``lse`` themselves with one split, else of the split partials
    (``split_views``), but of ``out``/``lse`` for a ``balanced`` decode (its one-split tokens go there; its views
    are there with one split too)."""
    plain = with_split_stride(head_strides(out, 3), 0), (*head_strides(lse, 2)[1:], 0)
    if num_splits == 1 and not balanced:
        return None, None, None, *plain
    num_tokens, num_q_heads, head_dim = q.shape
    part_out, part_lse, counts = split_views(split_buffer, num_tokens, num_q_heads, num_splits * (num_splits > 1),
                                             head_dim, q.device, counted=balanced)
    if balanced:  # with one split, empty views (never touched) of the dtypes the kernel's one variant takes
        return part_out, part_lse, counts, *plain
    return part_out, part_lse, None, (num_q_heads, 0, *part_out.stride()), (0, *part_lse.stride())


def with_merge(stage1: Launch, part_out, part_lse, out, lse, num_splits: int, split_counts=None,
               stage1_extra: tuple = (), narrow: bool | None = None, stage1_other: tuple | None = None) -> PrefixLaunch:
    """Stage 1 and, with several splits, the merge of its partials (and, planned inside ``every_variant()``, the
    warm-up, the merge's other variant); ``split_counts`` for a balanced decode (the merge reads them). ``narrow``:
    the merge's variant (None: by the split count, ``merge_tiling``)."""
    if num_splits == 1:
        return PrefixLaunch(stage1, None, part_out, part_lse, num_splits, stage1_extra=stage1_extra)
    counted = split_counts is not None
    if INTERPRET:
        narrow = None  # merge_tiling's interpreter tiling
    elif narrow is None:
        narrow = num_splits <= NARROW_SPLITS
    merge = plan_split_merge(part_out, part_lse, out, lse, counted=counted, narrow=narrow)
    other = plan_split_merge(part_out, part_lse, out, lse, counted=counted, narrow=not narrow) \
        if every_variant_wanted() and not INTERPRET else None  # planned for the warm-up only
    return PrefixLaunch(stage1, merge, part_out, part_lse, num_splits, merge_other=other, split_counts=split_counts,
                        stage1_extra=stage1_extra, stage1_other=stage1_other)
