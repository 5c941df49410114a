"""A step's per-request lengths in one launch: what ``DcpBatch`` derives from ``query_start_loc`` and ``seq_lens``.

``query_lens = qsl[b + 1] - qsl[b]``, ``context_lens = seq_lens - query_lens`` and the rank's share of each,
``local_len(L) = (L // (N * I)) * I + clamp(L - (L // (N * I)) * N * I - r * I, 0, I)`` (docs/design.md section 2),
written into four int32 buffers. On a GPU this replaces a dozen small torch ops (each a launch and host work) per
step with one launch, and keeps the outputs in the caller's persistent buffers (CUDA-graph safe).
"""

from __future__ import annotations

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import Launch, cdiv

BLOCK = 1024


@triton.jit
def _local_len(length, span, interleave, rank_offset):
    full = length // span
    rest = tl.minimum(tl.maximum(length - full * span - rank_offset, 0), interleave)
    return full * interleave + rest


@triton.jit(do_not_specialize=("num_reqs",))
def batch_lengths_kernel(query_start_loc_ptr, seq_lens_ptr, query_lens_ptr, context_lens_ptr, local_context_lens_ptr,
                         local_seq_lens_ptr, num_reqs, span, interleave, rank_offset, BLOCK_R: tl.constexpr):
    reqs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = reqs < num_reqs
    start = tl.load(query_start_loc_ptr + reqs, mask=mask, other=0)
    end = tl.load(query_start_loc_ptr + reqs + 1, mask=mask, other=0)
    seq_len = tl.load(seq_lens_ptr + reqs, mask=mask, other=0)
    query_len = end - start
    context_len = seq_len - query_len
    tl.store(query_lens_ptr + reqs, query_len, mask=mask)
    tl.store(context_lens_ptr + reqs, context_len, mask=mask)
    tl.store(local_context_lens_ptr + reqs, _local_len(context_len, span, interleave, rank_offset), mask=mask)
    tl.store(local_seq_lens_ptr + reqs, _local_len(seq_len, span, interleave, rank_offset), mask=mask)


def plan_batch_lengths(num_reqs: int, *, dcp_size: int, dcp_rank: int, interleave: int) -> Launch:
    """A prepared launch for ``num_reqs`` requests: call it with ``(query_start_loc [num_reqs + 1], seq_lens,
    query_lens, context_lens, local_context_lens, local_seq_lens)``, all int32 on one GPU, the last four written.
    Keep it for the next step of the same size: a replay skips Triton's dispatch (``Launch``)."""
    return Launch(batch_lengths_kernel, (max(1, cdiv(num_reqs, BLOCK)),),
                  (num_reqs, dcp_size * interleave, interleave, dcp_rank * interleave), dict(BLOCK_R=BLOCK),
                  num_warps=4)
