"""Programmatic dependent launch (PDL, sm_90+): a kernel of a step may be launched while the kernel before it in the
stream is still finishing, so its programs are resident and waiting when that kernel's last ones end, instead of
the launch starting only then.

Every kernel launched this way calls ``wait_for_previous_grid`` before its first load: ``griddepcontrol.wait``
returns once the previous grid has finished and its writes are visible, whatever that kernel was (one of ours, an
engine's GEMM, a collective). So the results are those of launches one after the other; only the gap between
kernels shrinks. A kernel signals when the next one may launch (``griddepcontrol.launch_dependents``, a hint; one
that never signals lets the next launch as its programs exit): where, is the kernel's ``PDL`` value (``TRIGGER``).
A kernel launched without PDL is ordered as always.

Used where the GPU is sm_90+, the kernels are compiled (not the interpreter) and Triton has the instructions
(``triton.language.extra.cuda.gdc_wait``); ``DCP_TRITON_PDL=0`` turns it off, ``programmatic_launches`` sets it
within a block (benchmarks time the choices in one process).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels.checks import env_switch

PDL_ENV = "DCP_TRITON_PDL"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without them: no kernel asks for PDL (``pdl_for``)
    gdc_launch_dependents = gdc_wait = None

_OVERRIDE = contextvars.ContextVar("dcp_triton_pdl", default=None)


def pdl_asked() -> bool:
    """``DCP_TRITON_PDL``: 1 (the default) or 0; any other value is refused (the engine adapters ask at start)."""
    return env_switch(PDL_ENV, on="programmatic dependent launches on sm_90+",
                      off="every kernel launched after the previous one has finished")


# A kernel's ``PDL`` constexpr: 0 not launched with PDL; else it waits for the previous grid first and lets the next
# one launch: at its start (TRIGGER["start"]), after its main loop (["end"]), or as its programs exit (["exit"]).
TRIGGER = {"start": 1, "end": 2, "exit": 3}
# Where each role's kernel signals: "stage1" a decode's split pass, after its main loop; "short" the small kernels
# around it (the cache write, the merge), at their start. On one H200 (docs/kernels.md, programmatic dependent launch;
# decode graph replay over 64-token pages) that took 1 x 1K / 1 x 8K / 8 x 8K, 32 Q / 8 KV, 11.0 / 18.8 / 75.6 us
# against 12.2 / 19.8 / 75.9 without PDL, and 1 x 8K / 8 x 8K, 32 Q / 1 KV, 13.6 / 21.3 against 16.0 / 22.5; the
# split pass signalling at its start lost where it fills the GPU (8 x 8K, 32 Q / 8 KV: 78.5 us), and within 1% of
# no PDL at large batches.
DEFAULT_TRIGGERS = {"stage1": "end", "short": "start"}


@contextlib.contextmanager
def programmatic_launches(on: bool, **triggers: str):
    """Within: launches prepared here use PDL where ``on`` and the device allows it (whatever ``DCP_TRITON_PDL``
    says), never where not ``on``; ``triggers``: a role's ``TRIGGER`` key, or "off" (that role launched without)."""
    unknown = {role: t for role, t in triggers.items() if role not in DEFAULT_TRIGGERS or t not in (*TRIGGER, "off")}
    if unknown:
        raise ValueError(f"programmatic_launches: roles {list(DEFAULT_TRIGGERS)}, each one of "
                         f"{[*TRIGGER, 'off']}; got {unknown}")
    token = _OVERRIDE.set((bool(on), {**DEFAULT_TRIGGERS, **triggers}))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


@functools.cache
def _device_allows(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_for(device: torch.device, role: str = "short") -> int:
    """The ``PDL`` constexpr of a ``role`` kernel launched on ``device`` now (0: launched without PDL)."""
    if INTERPRET or gdc_wait is None or device.type != "cuda":
        return 0
    on, triggers = _OVERRIDE.get() or (None, DEFAULT_TRIGGERS)
    if on is False or (on is None and not pdl_asked()) or triggers[role] == "off":
        return 0
    return TRIGGER[triggers[role]] if _device_allows(
        device.index if device.index is not None else torch.cuda.current_device()) else 0


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """With ``PDL`` (the kernel was launched with it): wait until the previous kernel's writes are visible, and
    with ``TRIGGER["start"]`` let the next kernel launch. Call it before the kernel's first load."""
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def main_loop_done(PDL: tl.constexpr):
    """With ``TRIGGER["end"]``: let the next kernel launch (call it after the kernel's main loop)."""
    if PDL == 2:
        gdc_launch_dependents()
