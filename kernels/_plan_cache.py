"""The one-shot calls' plans, kept: ``prefix_attention`` and ``chunk_attention`` called again with tensors laid out
like an earlier call's replay that call's plan instead of planning again (FlashInfer's plan / run, done for the
caller, who may still call ``plan_prefix`` / ``plan_chunk`` once and keep the plan).

A plan is keyed by everything planning and the argument checks read: each tensor's shape, strides, dtype, device and
16-byte alignment (None for an output to be made), the current stream (a plan holds its split scratch: calls on two
streams must not share it), every host argument with its type, the switches planning reads per call
(``DCP_TRITON_GLUON``, ``DCP_TRITON_PDL``, ``DCP_TRITON_FP8_DOT``, ``DCP_TRITON_FP8_PREFILL`` and
``programmatic_launches``) and whether the warm-up's extra variants are wanted (``every_variant``). A plan is kept
only after its call's arguments passed the checks, which read nothing else (no tensor's values), so a call that
finds it skips them: they would pass again. The ``KEPT`` latest plans are kept, with their scratch; a call with a
config of its own or a chunk mask (bound to its plan) is checked and plans afresh.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from dcp_plugin.kernels import _pdl
from dcp_plugin.kernels._gluon import GLUON_ENV
from dcp_plugin.kernels._launch import every_variant_wanted
from dcp_plugin.kernels._prefix_config import FP8_DOT_ENV
from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV

KEPT = 8  # plans kept, the least recently used dropped first (each holds its split scratch, a few MiB at most)
_plans: OrderedDict = OrderedDict()


def layout(*tensors) -> tuple:
    """What planning and the checks read of ``tensors`` (None stays None): shape, strides, dtype, device (its index,
    -1 on CPU, beside the device type the key holds), 16-byte alignment."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15)
                 for t in tensors)


def stream_key(device) -> int | None:
    """The current stream's handle on a GPU ``device``; None elsewhere."""
    if device.type != "cuda":
        return None
    import torch

    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


# The switches' variables as ``os.environ`` holds them. On POSIX its own dict of encoded names is read directly:
# ``os.environ.get`` encodes the name at each call, which took most of a kept plan's lookup, and every assignment to
# ``os.environ`` lands in that dict. Elsewhere by name.
_SWITCH_ENVS = (GLUON_ENV, _pdl.PDL_ENV, FP8_DOT_ENV, FP8_PREFILL_ENV)
if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict):
    _ENV_READ, _ENV_NAMES = os.environ._data.get, tuple(map(os.fsencode, _SWITCH_ENVS))
else:
    _ENV_READ, _ENV_NAMES = os.environ.get, _SWITCH_ENVS


def switches() -> tuple:
    """The switches planning reads at each call: the Gluon, PDL, fp8-product and fp8-prefill variables as set, and a
    ``programmatic_launches`` block's choice."""
    on, triggers = _pdl._OVERRIDE.get() or (None, {})
    return (*map(_ENV_READ, _ENV_NAMES), on, tuple(sorted(triggers.items())) if triggers else ())


def checked(kind: str, tensors: tuple, host_args: tuple, *, check: Callable[[], tuple],
            outputs: Callable[[], tuple], plan: Callable[..., object], keep: bool = True) -> tuple:
    """``(launch, outputs)`` of a ``kind`` call: the plan kept for a call whose ``tensors`` were laid out alike and
    whose ``host_args`` were equal and of the same types, with ``outputs()`` (its outputs, made where the call gave
    None); else ``check()`` (the arguments checked, one clear line for a bad one -> the outputs), then
    ``plan(*outputs)``, kept unless ``keep`` is False. A call whose arguments cannot form a key (not tensors,
    unhashable values) is checked, which names what is wrong."""
    key = _key(kind, tensors, host_args) if keep else None
    found = None if key is None else _plans.get(key)
    if found is not None:
        _plans.move_to_end(key)
        return found, outputs()
    made = check()
    found = plan(*made)
    if key is not None:
        _plans[key] = found
        if len(_plans) > KEPT:
            _plans.popitem(last=False)
    return found, made


def _key(kind: str, tensors: tuple, host_args: tuple) -> tuple | None:
    try:
        device = tensors[0].device
        key = (kind, layout(*tensors), host_args, tuple(map(type, host_args)), device.type, stream_key(device),
               switches(), every_variant_wanted())
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def clear() -> None:
    """Drop every kept plan (and its scratch)."""
    _plans.clear()
