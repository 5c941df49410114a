"""Checks and helpers every launcher shares: inputs are validated here, once, before any launch."""

from __future__ import annotations

import functools

import torch

from dcp_plugin.kernels import INTERPRET

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, *, ndim: int, dtypes=FLOAT_DTYPES, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a tensor of ``ndim`` dims, an allowed dtype, on
    ``device``, and (on CPU) the Triton interpreter is active."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if t.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{name} is a CPU tensor but the Triton interpreter is off; set TRITON_INTERPRET=1 before importing "
            "dcp_plugin (it is set automatically when no GPU is present)"
        )


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """``expected`` holds ints or ``None`` (any size) per dim."""
    if len(t.shape) != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {shown}, got {tuple(t.shape)}")


def check_out(name: str, out, shape: tuple, device: torch.device, dtypes=FLOAT_DTYPES) -> None:
    """Validate a caller-provided output buffer."""
    check_tensor(name, out, ndim=len(shape), dtypes=dtypes, device=device)
    check_shape(name, out, shape)


def check_head_map(*, num_q_heads: int, q_head_start: int, q_per_kv: int, kv_head_start: int,
                   num_kv_heads: int, kv_name: str) -> None:
    """Every local Q head ``i`` must read a stored KV head: ``0 <= (q_head_start + i) // q_per_kv - kv_head_start
    < num_kv_heads``."""
    for name, value, low in (("q_head_start", q_head_start, 0), ("q_per_kv", q_per_kv, 1),
                             ("kv_head_start", kv_head_start, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    first = q_head_start // q_per_kv - kv_head_start
    last = (q_head_start + num_q_heads - 1) // q_per_kv - kv_head_start
    if first < 0 or last >= num_kv_heads:
        raise ValueError(
            f"head mapping out of range: Q heads {q_head_start}..{q_head_start + num_q_heads - 1} with "
            f"q_per_kv={q_per_kv} read global KV heads {first + kv_head_start}..{last + kv_head_start}, but "
            f"{kv_name} holds {num_kv_heads} heads starting at global KV head kv_head_start={kv_head_start}"
        )


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` goes through Triton's constexpr wrapper: microseconds per call on
    the launch path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed small number under the interpreter)."""
    if INTERPRET:
        return 2
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.type == "cuda" and t.device.index is not None else 0
