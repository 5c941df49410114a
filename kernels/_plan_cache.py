"""The one-shot calls' plans, kept: ``prefix_attention`` and ``chunk_attention`` called again with tensors laid out
like an earlier call's replay that call's plan instead of planning again (FlashInfer's plan / run, done for the
caller, who may still call ``plan_prefix`` / ``plan_chunk`` once and keep the plan).

A plan is keyed by everything planning reads: each tensor's shape, strides, dtype and 16-byte alignment, the device,
the current stream (a plan holds its split scratch: calls on two streams must not share it), every host argument,
the switches planning reads per call (``DCP_TRITON_GLUON``, ``DCP_TRITON_PDL`` and ``programmatic_launches``) and
whether the warm-up's extra variants are wanted (``every_variant``). The ``KEPT`` latest plans are kept, with
their scratch; a call with a config of its own or a chunk mask (bound to its plan) plans afresh.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from dcp_plugin.kernels import _pdl
from dcp_plugin.kernels._gluon import GLUON_ENV
from dcp_plugin.kernels._launch import every_variant_wanted
from dcp_plugin.kernels._prefix_config import FP8_DOT_ENV

KEPT = 8  # plans kept, the least recently used dropped first (each holds its split scratch, a few MiB at most)
_plans: OrderedDict = OrderedDict()


def layout(*tensors) -> tuple:
    """What planning reads of ``tensors`` (None stays None): shape, strides, dtype, 16-byte alignment."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, not t.data_ptr() & 15) for t in tensors)


def stream_key(device) -> int | None:
    """The current stream's handle on a GPU ``device``; None elsewhere."""
    if device.type != "cuda":
        return None
    import torch

    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def switches() -> tuple:
    """The switches planning reads at each call: the Gluon, PDL and fp8-product variables as set, and a
    ``programmatic_launches`` block's choice."""
    on, triggers = _pdl._OVERRIDE.get() or (None, {})
    return (os.environ.get(GLUON_ENV), os.environ.get(_pdl.PDL_ENV), os.environ.get(FP8_DOT_ENV), on,
            tuple(sorted(triggers.items())))


def kept(kind: str, tensors: tuple, host_args: tuple, plan: Callable[[], object]):
    """The ``kind`` plan kept for ``tensors`` laid out alike (``layout``) and equal ``host_args``, on the first
    tensor's device and its current stream, under the same switches, with the warm-up's variants or not; else
    ``plan()``, kept there."""
    device = tensors[0].device
    key = (kind, layout(*tensors), host_args, device, stream_key(device), switches(), every_variant_wanted())
    found = _plans.get(key)
    if found is not None:
        _plans.move_to_end(key)
        return found
    found = _plans[key] = plan()
    if len(_plans) > KEPT:
        _plans.popitem(last=False)
    return found


def clear() -> None:
    """Drop every kept plan (and its scratch)."""
    _plans.clear()
