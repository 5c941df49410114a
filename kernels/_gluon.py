"""Where the Gluon kernels (``gluon_prefix``, ``gluon_chunk``, ``gluon_decode``) run instead of the portable ``tl``
ones: decided from host facts only, without importing Gluon unless it may run.

Gluon is Triton's lower-level dialect (explicit layouts, warpgroup MMAs, mbarriers, warp specialization); its API
changes between Triton releases, so a kernel written in it runs only on the release it was built and measured on
(``GLUON_TRITON``) and only on sm_90 (Hopper's warpgroup MMAs). Everywhere else (other GPUs and Triton releases,
the interpreter on CPU) the ``tl`` kernels run, with the same results. They are on by default where they can run;
``DCP_TRITON_GLUON=0`` keeps the ``tl`` kernels there too (their checks against float64 on the H200:
tests/gpu/test_gluon_*_gpu.py).
"""

from __future__ import annotations

import functools

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton

from dcp_plugin.kernels._launch import descriptor_ready
from dcp_plugin.kernels._prefix_tile import cache_takes_descriptors
from dcp_plugin.kernels.checks import env_switch

GLUON_ENV = "DCP_TRITON_GLUON"
GLUON_TRITON = ("3.6.",)
GLUON_HEAD_DIMS = (64, 128)  # the head sizes gluon_prefix and gluon_chunk serve (their float64 checks on the H200)
PREFIX_PAGE = 64
GLUON_DECODE_MIN_KV_GROUP = 16  # gluon_decode serves decodes with more Q heads per KV group than this


@functools.cache
def _gluon_importable() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
        )
    except ImportError:
        return False
    return True


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gluon_supported(device: torch.device) -> bool:
    """Whether Gluon kernels can run on ``device``: compiled kernels (not the interpreter), a CUDA sm_90 device, and
    Triton ``GLUON_TRITON`` with Gluon's Hopper API."""
    if INTERPRET or device.type != "cuda" or not triton.__version__.startswith(GLUON_TRITON):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _is_sm90(index) and _gluon_importable()


def gluon_asked() -> bool:
    """``DCP_TRITON_GLUON``: 1 (the default) or 0; any other value is refused (the engine adapters ask at start)."""
    return env_switch(GLUON_ENV, on="the Gluon kernels where they apply", off="the tl kernels only")


def gluon_enabled(device: torch.device) -> bool:
    """Whether Gluon kernels run on ``device``: ``gluon_asked`` and ``gluon_supported``."""
    return gluon_asked() and gluon_supported(device)


def prefix_takes_gluon(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       out: torch.Tensor) -> bool:
    """Whether a prefill step's prefix pass read in one split (``plan_prefix`` asks) runs ``gluon_prefix``: head size
    in ``GLUON_HEAD_DIMS``, fp16/bf16 queries over a cache of the same dtype in pages of ``PREFIX_PAGE`` tokens that
    tensor descriptors can read (``cache_takes_descriptors``), unit stride along the head dim of q and out, and
    ``gluon_enabled``."""
    return (q.shape[-1] in GLUON_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16)
            and key_cache.dtype == q.dtype and value_cache.dtype == q.dtype and key_cache.shape[1] == PREFIX_PAGE
            and q.stride(-1) == 1 and out.stride(-1) == 1 and gluon_enabled(q.device)
            and cache_takes_descriptors(key_cache, value_cache, q.shape[-1], PREFIX_PAGE))


def chunk_takes_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``plan_chunk`` runs ``gluon_chunk``: a head size in ``GLUON_HEAD_DIMS``, fp16/bf16, K and V each
    readable as one 2-D tensor of token rows ``[tokens, kv_heads * head_dim]`` through tensor descriptors (heads
    contiguous, unit stride along D, 16-byte aligned base and token stride), unit stride along the head dim of q and
    out, and ``gluon_enabled``."""
    return (q.shape[-1] in GLUON_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16)
            and all(t.stride(1) == q.shape[-1] and descriptor_ready(t, (0,)) for t in (k, v))
            and q.stride(-1) == 1 and out.stride(-1) == 1 and q.shape[0] < 2 ** 31 - 256  # 32-bit row coordinates
            and gluon_enabled(q.device))


def head_columns(cache: torch.Tensor) -> int:
    """Columns of a ``[blocks, page, kv_heads, D]`` cache's token rows that its KV heads span, each head read
    ``(h * stride_h) // stride_tok`` rows and ``(h * stride_h) % stride_tok`` columns in (``gluon_decode``'s one
    descriptor over all heads); 0 when a head's D elements do not lie within one token row."""
    tok, head = cache.stride(1), cache.stride(2)
    ends = [(h * head) % tok + cache.shape[3] for h in range(cache.shape[2])]
    return max(ends) if ends and max(ends) <= tok else 0


def decode_takes_gluon(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a decode (``plan_prefix`` asks; it also weighs the KV group size) can run ``gluon_decode``: what
    ``prefix_takes_gluon`` asks of the tensors (the same copies read the cache), and each KV head's D elements
    within one token row (``head_columns``)."""
    return prefix_takes_gluon(q, key_cache, value_cache, out) and all(map(head_columns, (key_cache, value_cache)))
