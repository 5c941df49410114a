"""Programmatic dependent launch (PDL, sm_90+): a kernel of a step may be launched while the kernel before it in the
stream is still finishing, so its programs are resident and waiting when that kernel's last ones end, instead of
the launch starting only then.

Every kernel launched this way calls ``wait_for_previous_grid`` before its first load: ``griddepcontrol.wait``
returns once the previous grid has finished and its writes are visible, whatever that kernel was (one of ours, an
engine's GEMM, a collective). It then signals that the next kernel may launch (``griddepcontrol.launch_dependents``:
a hint; a kernel that does not signal lets the next one launch when its programs exit). So the results are those
of launches one after the other; only the gap between kernels shrinks. A kernel launched without PDL is ordered
as always, and these instructions are no-ops there.

Used where the GPU is sm_90+, the kernels are compiled (not the interpreter) and Triton has the instructions
(``triton.language.extra.cuda.gdc_wait``); ``DCP_TRITON_PDL=0`` turns it off, ``programmatic_launches(False)`` too
within a block (benchmarks time both in one process).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from dcp_plugin.kernels._mode import INTERPRET

PDL_ENV = "DCP_TRITON_PDL"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without them: no kernel asks for PDL (``pdl_for``)
    gdc_launch_dependents = gdc_wait = None

_OVERRIDE = contextvars.ContextVar("dcp_triton_pdl", default=None)


def pdl_asked() -> bool:
    """``DCP_TRITON_PDL``: 1 (the default) or 0; any other value is refused (the engine adapters ask at start)."""
    value = os.environ.get(PDL_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 1 (programmatic dependent launches on sm_90+, the default) or 0 "
                         f"(every kernel launched after the previous one has finished), got {value!r}")
    return value == "1"


@contextlib.contextmanager
def programmatic_launches(on: bool):
    """Within: launches prepared here use PDL where ``on`` and the device allows it, never where not ``on``."""
    token = _OVERRIDE.set(bool(on))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


@functools.cache
def _device_allows(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_for(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL."""
    if INTERPRET or gdc_wait is None or device.type != "cuda":
        return False
    override = _OVERRIDE.get()
    if override is False or (override is None and not pdl_asked()):
        return False
    return _device_allows(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """With ``PDL`` (the kernel was launched with it): wait until the previous kernel's writes are visible, then let
    the next kernel launch. Call it before the kernel's first load."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
