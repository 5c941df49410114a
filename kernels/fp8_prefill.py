"""A prefill step's prefix pass over an fp8 KV cache through a 16-bit copy of the pages it reads
(``DCP_TRITON_FP8_PREFILL=copy``, the default; ``tiles`` reads the fp8 cache in the pass itself).

A prefill chunk's prefix pass is compute-bound: every cached token it reads meets every query row of the chunk. Over
an fp8 cache the ``tl`` kernel widens each K and V tile to 16 bits inside its main loop, and the Gluon prefix pass
(``gluon_prefix``, sm_90) reads 16-bit caches only: an e4m3 cache's pass ran at 359-361 TFLOP/s on an H200 where the
bf16 cache's Gluon pass ran at 621-640 (``sweep_kernels.py --only fp8prefix``; docs/limits.md); through the copy an
H100's ran at 658-678, its bf16 cache's at 633-639. With ``copy``, a step whose requests bring ``COPY_MIN_ROWS`` query
rows each on average first widens the pages it reads: ``widen_pages_kernel`` writes ``value * scale`` in q's dtype
(rounded once) into a copy laid out request by request in ``COPY_PAGE``-token pages, zero past each request's cached
tokens, and the 16-bit pass (``plan_prefix`` over the copy: the Gluon one where it serves) reads the copy. The copy
moves three bytes per cached value and the pass reads two more where it would read one: little beside a prefill
chunk's products, much beside a short query's, hence the rows bound. The copy lives in one buffer per device, stream
and dtype (``GrownBuffers``, grown within ``COPY_MAX_BYTES``, and what it outgrew kept); a step whose copy would pass
the bound, a decode and a short-query step read the fp8 cache directly, and so does a step whose copy finds no free
memory (one warning)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import GrownBuffers, Launch, cdiv, next_pow2
from dcp_plugin.kernels._prefix_config import fp8_dot_asked
from dcp_plugin.kernels.checks import FP8_DTYPES, env_choice

FP8_PREFILL_ENV = "DCP_TRITON_FP8_PREFILL"
COPY_PAGE = 64  # tokens per page of the copy: the Gluon prefix pass's page (``_gluon.PREFIX_PAGE``)
COPY_MIN_ROWS = 64  # query rows per request, on average over the step, for a copy to pay
COPY_MAX_BYTES = 256 << 20  # K and V of 2 x 32K tokens, 8 KV heads of 128, bf16; a larger copy: the fp8 cache read


def fp8_copy_asked() -> bool:
    """``$DCP_TRITON_FP8_PREFILL``: ``copy`` or ``tiles`` (the pass widens each fp8 tile); unset, ``copy`` unless
    ``$DCP_TRITON_FP8_DOT`` asks for fp8 products, which read the fp8 tiles (``tiles`` then); any other value is
    refused (the engine adapters ask at start)."""
    return env_choice(FP8_PREFILL_ENV, {"tiles": "the prefix pass widens each fp8 tile",
                                        "copy": "a prefill step's fp8 pages widened into a 16-bit copy first"},
                      "tiles" if fp8_dot_asked() else "copy") == "copy"


@triton.jit(do_not_specialize=("pages_per_req", "stride_bt_req"),
            do_not_specialize_on_alignment=("block_table_ptr", "kv_lens_ptr"))
def widen_pages_kernel(
    key_cache_ptr, value_cache_ptr, block_table_ptr, kv_lens_ptr, k_scale_ptr, v_scale_ptr, k_copy_ptr, v_copy_ptr,
    num_kv_heads, head_dim, pages_per_req,
    stride_kc_blk, stride_kc_tok, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_h, stride_vc_d,
    stride_bt_req, stride_bt_page,
    PAGE_SIZE: tl.constexpr,  # the cache's page
    COPY_PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (copy page ``c``, KV head): request ``c // pages_per_req``'s cached tokens ``(c % pages_per_req) *
    COPY_PAGE ..`` + COPY_PAGE, head ``h``, scaled and rounded to the copy's dtype into page ``c`` of the copy
    (``[pages, COPY_PAGE, num_kv_heads, head_dim]``, contiguous); rows past the request's cached tokens get 0, a page
    wholly past them is left as it is (the pass reads none of it)."""
    copy_page = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    req = copy_page // pages_per_req
    first = (copy_page % pages_per_req) * COPY_PAGE
    kv_len = tl.load(kv_lens_ptr + req)
    if first >= kv_len:
        return
    tokens = first + tl.arange(0, COPY_PAGE)
    live = tokens < kv_len
    pages = tl.load(block_table_ptr + req * stride_bt_req + (tokens // PAGE_SIZE) * stride_bt_page, mask=live,
                    other=0).to(tl.int64)
    rows = tokens % PAGE_SIZE
    dims = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (dims[None, :] < head_dim)
    k = tl.load(key_cache_ptr + (pages * stride_kc_blk + rows * stride_kc_tok + head * stride_kc_h)[:, None]
                + dims[None, :] * stride_kc_d, mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + (pages * stride_vc_blk + rows * stride_vc_tok + head * stride_vc_h)[:, None]
                + dims[None, :] * stride_vc_d, mask=mask, other=0.0)
    k = k.to(tl.float32) * tl.load(k_scale_ptr)
    v = v.to(tl.float32) * tl.load(v_scale_ptr)
    to = (((copy_page * COPY_PAGE + tl.arange(0, COPY_PAGE)) * num_kv_heads + head) * head_dim)[:, None] + dims[None, :]
    tl.store(k_copy_ptr + to, k.to(k_copy_ptr.dtype.element_ty), mask=dims[None, :] < head_dim)
    tl.store(v_copy_ptr + to, v.to(v_copy_ptr.dtype.element_ty), mask=dims[None, :] < head_dim)


_log = logging.getLogger("dcp_plugin")
# The byte counts of copies that found no free memory (plan_copy): a copy as large is not tried again, since each
# failed allocation has torch's allocator release its cached blocks (a device synchronisation) on a step's path.
_no_memory: list[int] = []
# The copies: one buffer per (device type, index, stream, dtype), K's elements then V's.
_COPIES = GrownBuffers(lambda count, key: torch.empty(count, dtype=key[3], device=torch.device(*key[:2])))


def copy_buffers(device: torch.device, dtype: torch.dtype, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_copy, v_copy)``: two contiguous ``shape`` views of the copy buffer of ``device``'s current stream."""
    size = shape[0] * shape[1] * shape[2] * shape[3]
    buffer = _COPIES.on_stream(device, 2 * size, dtype, most=COPY_MAX_BYTES // dtype.itemsize)  # within the bound
    return buffer[:size].view(shape), buffer[size:2 * size].view(shape)


class CopiedPrefix:
    """``prefix_attention`` prepared as a copy of the fp8 pages (``widen``) and the 16-bit pass over it (``over_copy``,
    planned for the copy and its block table); called like the plan it replaces."""

    __slots__ = ("widen", "over_copy", "k_copy", "v_copy", "table")

    def __init__(self, widen: Launch, over_copy, k_copy: torch.Tensor, v_copy: torch.Tensor,
                 table: torch.Tensor) -> None:
        self.widen, self.over_copy, self.k_copy, self.v_copy, self.table = widen, over_copy, k_copy, v_copy, table

    def __call__(self, q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, k_scale=None,
                 v_scale=None) -> None:
        self.widen(key_cache, value_cache, block_table, kv_lens, k_scale, v_scale, self.k_copy, self.v_copy)
        self.over_copy(q, self.k_copy, self.v_copy, self.table, kv_lens, query_start_loc, out, lse)


def plan_copy(q, key_cache, value_cache, block_table, kv_lens, max_kv_len: int,
              plan: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]) -> CopiedPrefix | None:
    """The prefix pass of ``plan_prefix``'s arguments through a 16-bit copy, the pass over it from ``plan(k_copy,
    v_copy, table)``; None where the step reads the fp8 cache directly: ``fp8_copy_asked`` off, a 16-bit cache, fewer
    than ``COPY_MIN_ROWS`` query rows per request on average (decode and short queries), nothing cached, or a copy
    past ``COPY_MAX_BYTES``."""
    num_tokens, _, head_dim = q.shape
    num_reqs, num_kv_heads = kv_lens.shape[0], key_cache.shape[2]
    if key_cache.dtype not in FP8_DTYPES or not fp8_copy_asked() or not num_reqs or max_kv_len < 1 \
            or num_tokens < COPY_MIN_ROWS * num_reqs:
        return None
    pages = cdiv(max_kv_len, 2 * COPY_PAGE) * 2  # an even count: the Gluon pass reads two pages a key tile
    shape = (num_reqs * pages, COPY_PAGE, num_kv_heads, head_dim)
    nbytes = 2 * shape[0] * COPY_PAGE * num_kv_heads * head_dim * q.element_size()
    if nbytes > COPY_MAX_BYTES or (_no_memory and nbytes >= min(_no_memory)):
        return None
    try:
        k_copy, v_copy = copy_buffers(q.device, q.dtype, shape)
    except torch.OutOfMemoryError:  # allocated past the engine's KV-cache sizing: the fp8 cache is read instead
        if not _no_memory:
            _log.warning("dcp-triton: no GPU memory for the 16-bit copy of an fp8 prefill step's pages (%.0f MiB); "
                         "steps that large read the fp8 tiles from now on (as DCP_TRITON_FP8_PREFILL=tiles)",
                         nbytes / 2 ** 20)
        _no_memory.append(nbytes)
        return None
    table = torch.arange(shape[0], dtype=torch.int32, device=q.device).view(num_reqs, pages)
    widen = Launch(widen_pages_kernel, (shape[0], num_kv_heads) if num_kv_heads and head_dim else (0,),
                   (num_kv_heads, head_dim, pages, *key_cache.stride(), *value_cache.stride(), *block_table.stride()),
                   dict(PAGE_SIZE=key_cache.shape[1], COPY_PAGE=COPY_PAGE, BLOCK_D=max(16, next_pow2(head_dim))),
                   num_warps=4)
    return CopiedPrefix(widen, plan(k_copy, v_copy, table), k_copy, v_copy, table)
