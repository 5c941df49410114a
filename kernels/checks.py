"""Argument checks shared by the kernels, the core and the adapters: each raises ``ValueError`` naming the argument,
what it got and what would work. A leaf module (torch only) in the bottom layer, so every layer above may import it;
importing it imports neither triton nor the kernels (``dcp_plugin.kernels`` loads its names on first use).

Public entry points check their arguments once; the per-step path (``DcpAttention`` replaying a prepared step)
calls unchecked internals whose inputs were checked when the step was prepared.
"""

from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# A quantized KV cache stores each K/V value divided by its tensor's scale (one float32 per K and per V).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_int(name: str, value, *, low: int, high: int | None = None, kind: str = "an int", note: str = "") -> None:
    """``value`` must be a (non-bool) int in ``[low, high]``; ``note`` is appended to the message."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {kind} {bound}{note}, got {value!r}")


def check_scale(name: str, value) -> None:
    """A softmax scale: a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0 (usually head_dim ** -0.5), got {value!r}")


def check_tensor(name: str, t, *, ndim: int, dtypes=FLOAT_DTYPES, device: torch.device | None = None) -> None:
    """``t`` must be a tensor of ``ndim`` dims, one of ``dtypes`` (None: any), on ``device`` (None: any)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_chunk_mask(chunk_mask, num_reqs: int, max_query_len: int, device: torch.device | None) -> None:
    """A current chunk's mask: bool or uint8 ``[>= num_reqs, M, M]`` with ``M >= max_query_len``, on ``device``."""
    check_tensor("chunk_mask", chunk_mask, ndim=3, dtypes=(torch.bool, torch.uint8), device=device)
    rows, m, n = chunk_mask.shape
    if rows < num_reqs or m != n or m < max_query_len:
        raise ValueError(f"chunk_mask has shape {tuple(chunk_mask.shape)}; it needs [>= {num_reqs} requests, M, M] "
                         f"with M >= max_query_len={max_query_len}")


def check_kv_scales(cache_dtype: torch.dtype, k_scale, v_scale, device: torch.device) -> bool:
    """An fp8 cache needs ``k_scale`` and ``v_scale`` (float32 tensors of one element on ``device``; the cache holds
    value / scale); any other cache takes neither. Returns whether the cache is quantized."""
    quantized = cache_dtype in FP8_DTYPES
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for an fp8 KV cache; this cache is {cache_dtype}: pass neither")
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            got = f"a {scale.dtype} tensor of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else \
                repr(scale)
            raise ValueError(f"the KV cache is {cache_dtype}: {name} must be a one-element float32 tensor (the "
                             f"cache holds value / {name}), got {got}")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device} but the KV cache is on {device}")
    return True


def env_choice(name: str, choices: dict[str, str], default: str) -> str:
    """``$name``, one of ``choices`` (value -> meaning), ``default`` when unset or empty; any other value is refused
    with every meaning."""
    value = os.environ.get(name, "").strip() or default
    if value not in choices:
        listed = [f"{v} ({meaning}{', the default' if v == default else ''})" for v, meaning in choices.items()]
        raise ValueError(f"{name} must be {', '.join(listed[:-1])} or {listed[-1]}, got {value!r}")
    return value


def env_switch(name: str, *, on: str, off: str, default: bool = True) -> bool:
    """The switch ``$name``: 1 (``on``) or 0 (``off``), ``default`` when unset or empty (``env_choice``)."""
    return env_choice(name, {"1": on, "0": off}, "1" if default else "0") == "1"
