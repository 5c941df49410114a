"""What every launcher shares: input checks (run once, at the public entry points), small integer helpers, and
``Launch``, which replays a prepared kernel launch cheaply.

A launcher is split in two. Its public function checks every input, then builds a ``Launch`` from the tensors'
metadata (grid, strides, tile sizes: everything host-side that does not depend on data pointers) and runs it. The
DCP core builds each ``Launch`` once per step and replays it for every layer, so a layer pays only the launch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton

from dcp_plugin.kernels import checks
from dcp_plugin.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_int, env_switch  # noqa: F401 - re-exported

LOG2E = 1.4426950408889634

# Replaying the compiled kernel of a prepared launch directly (the launcher Triton's own dispatch ends in) skips
# re-deriving its specialization on every call: about half of a launch's host time. Set DCP_TRITON_FAST_LAUNCH=0
# to send every launch through Triton's dispatch. The call convention below is the one of these Triton releases.
FAST_LAUNCH_ENV = "DCP_TRITON_FAST_LAUNCH"
_FAST_LAUNCH_TRITON = ("3.4", "3.5", "3.6")


def check_kernel_tensor(name: str, t, *, ndim: int, dtypes=FLOAT_DTYPES, device: torch.device | None = None) -> None:
    """``checks.check_tensor``, and (on CPU) the Triton interpreter must be active."""
    checks.check_tensor(name, t, ndim=ndim, dtypes=dtypes, device=device)
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
    check_kernel_tensor(name, out, ndim=len(shape), dtypes=dtypes, device=device)
    check_shape(name, out, shape)


def check_head_map(*, num_q_heads: int, q_head_start: int, q_per_kv: int, kv_head_start: int,
                   num_kv_heads: int, kv_name: str) -> None:
    """Every local Q head ``i`` must read a stored KV head: ``0 <= (q_head_start + i) // q_per_kv - kv_head_start
    < num_kv_heads``."""
    for name, value, low in (("q_head_start", q_head_start, 0), ("q_per_kv", q_per_kv, 1),
                             ("kv_head_start", kv_head_start, 0)):
        check_int(name, value, low=low)
    first = q_head_start // q_per_kv - kv_head_start
    last = (q_head_start + num_q_heads - 1) // q_per_kv - kv_head_start
    if first < 0 or last >= num_kv_heads:
        raise ValueError(
            f"head mapping out of range: Q heads {q_head_start}..{q_head_start + num_q_heads - 1} with "
            f"q_per_kv={q_per_kv} read global KV heads {first + kv_head_start}..{last + kv_head_start}, but "
            f"{kv_name} holds {num_kv_heads} heads starting at global KV head kv_head_start={kv_head_start}"
        )


def check_heads_out(name: str, t, shape: tuple, device: torch.device, dtypes=FLOAT_DTYPES) -> None:
    """Check an output that is either ``shape`` (``[T, H, ...]``) or its rank-major split ``[R, T, H / R, ...]``
    (global head ``h`` stored at ``[h // (H / R), t, h % (H / R)]``, the layout a collective along dim 0 needs)."""
    rank_major = isinstance(t, torch.Tensor) and t.dim() == len(shape) + 1
    check_kernel_tensor(name, t, ndim=len(shape) + rank_major, dtypes=dtypes, device=device)
    if not rank_major:
        check_shape(name, t, shape)
        return
    ranks = t.shape[0]
    if ranks < 1 or shape[1] % ranks or tuple(t.shape) != (ranks, shape[0], shape[1] // ranks, *shape[2:]):
        raise ValueError(f"{name} must have shape {shape} or its rank-major split [R, {shape[0]}, {shape[1]} / R"
                         f"{', ' * (len(shape) > 2)}{', '.join(map(str, shape[2:]))}], got {tuple(t.shape)}")


def head_strides(t: torch.Tensor, plain_ndim: int) -> tuple:
    """``(heads_per_rank, rank_stride, token_stride, head_stride, *rest)`` of a ``[T, H, ...]`` tensor
    (``plain_ndim`` dims; one rank holding every head) or of its rank-major ``[R, T, H / R, ...]`` form."""
    if t.dim() == plain_ndim:
        return (t.shape[1], 0, *t.stride())
    return (t.shape[2], *t.stride())


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


def tma_available(device: torch.device) -> bool:
    """Whether kernels may build tensor descriptors (TMA) on ``device``: Triton has them and the GPU is sm_90+, or
    the interpreter runs (which emulates them, so the CPU suite tests both selections)."""
    if not hasattr(triton.language, "make_tensor_descriptor"):
        return False
    if INTERPRET:
        return True
    return device.type == "cuda" and _capability_major(
        device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def descriptor_ready(t: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``t`` can back a tensor descriptor whose rows step along ``dims``: unit stride along its last dim, a
    16-byte aligned base, and strides along ``dims`` in multiples of 16 bytes (a TMA copy's requirements)."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(t.stride(d) * size % 16 == 0 for d in dims)


def _fast_launch_supported() -> bool:
    asked = env_switch(FAST_LAUNCH_ENV, on="replay Triton's compiled launcher directly", off="Triton's own launch path")
    if INTERPRET or not asked:
        return False
    return triton.__version__.startswith(_FAST_LAUNCH_TRITON)


FAST_LAUNCH = _fast_launch_supported()

# Compile-ahead (``dcp_plugin.kernels._compile_ahead``): while a warm-up records its kernel variants, a ``Launch``
# hands its variant to Triton's compiler (``kernel.warmup``) and launches nothing.
_COMPILE_ONLY = contextvars.ContextVar("dcp_triton_compile_only", default=False)


def compile_only() -> bool:
    return _COMPILE_ONLY.get()


def set_compile_only(value: bool) -> contextvars.Token:
    return _COMPILE_ONLY.set(value)


def reset_compile_only(token: contextvars.Token) -> None:
    _COMPILE_ONLY.reset(token)


@contextlib.contextmanager
def launches_run():
    """Inside ``compile_ahead``: launches run again, for kernels whose outputs the host reads (a batch's lengths)."""
    token = _COMPILE_ONLY.set(False)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


_EVERY_VARIANT = contextvars.ContextVar("dcp_triton_every_variant", default=False)


@contextlib.contextmanager
def every_variant():
    """Within (the warm-up): a launch whose kernel variant a step picks from its sizes also runs the variants other
    sizes would pick, so none compiles while serving (``split_kv.PrefixLaunch``: the merge's two variants)."""
    token = _EVERY_VARIANT.set(True)
    try:
        yield
    finally:
        _EVERY_VARIANT.reset(token)


def every_variant_wanted() -> bool:
    return _EVERY_VARIANT.get()


class Launch:
    """One prepared launch of a ``@triton.jit`` kernel: ``launch(*tensors)`` runs
    ``kernel[grid](*tensors, *scalars, **constexprs)``.

    ``scalars`` (ints and floats) and ``constexprs`` are fixed when the launch is prepared; only the leading tensor
    arguments change between calls, and the caller guarantees they keep the dtypes, shapes and strides the launch
    was prepared for. The first call goes through Triton's dispatch (compiling if needed) and keeps the compiled
    kernel; later calls whose tensors have the same 16-byte alignment pattern replay it directly (``FAST_LAUNCH``),
    which is the kernel Triton's dispatch would pick for them: every other specialization input is fixed here.
    A replay hands the compiled launcher the tensors' addresses as ints: given a tensor it would call ``data_ptr()``
    again and ask the CUDA driver whether the address is device memory, a driver call per tensor and launch, which
    the first launch of these tensors has already answered. ``scratch``: the kernel needs Triton's global scratch
    (device-side tensor descriptors); the compiled launcher takes it from ``_scratch``.

    ``stand_ins``: ``{i: j}`` for tensor arguments this variant never reads (its constexpr flags say so: a cache
    that is not fp8 has no scales, a merge without an extra partial has none). Whatever the caller passes there
    (``None``, as a rule) is replaced by tensor argument ``j``: a real pointer of fixed dtype and alignment, so the
    compiled variant is always the same one (``None`` would compile another).

    ``pdl``: launched as a programmatic dependent launch (``_pdl``); the kernel must then take a ``PDL`` above 0 and
    call ``wait_for_previous_grid`` before its first load.

    ``bound``: tensors fixed when the launch is prepared, passed after the call's tensors (a step's own inputs that
    its callers do not carry, as the current chunk's tree mask).
    """

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "options", "scratch", "_stand_ins", "_compiled",
                 "_aligned", "_all_aligned", "_tail", "_device", "_bound")

    def __init__(self, kernel, grid: tuple, scalars: tuple, constexprs: dict, *, num_warps: int,
                 num_stages: int = 1, scratch: bool = False, stand_ins: dict[int, int] | None = None,
                 maxnreg: int | None = None, pdl: int = 0, bound: tuple = ()) -> None:
        self.kernel, self.grid, self.scalars, self.constexprs = kernel, tuple(grid) + (1,) * (3 - len(grid)), \
            scalars, constexprs
        self.options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {}) \
            | ({"launch_pdl": True} if pdl else {})
        if pdl and not constexprs.get("PDL", 0) > 0:
            raise ValueError(f"{kernel.__name__}: a PDL launch needs the kernel's PDL above 0 (wait_for_previous_grid)")
        self._stand_ins = tuple(stand_ins.items()) if stand_ins else ()
        self._compiled = None
        self._aligned = None
        self._all_aligned = False  # the kept kernel was compiled with every tensor 16-byte aligned (the rule)
        self._tail = scalars + tuple(constexprs.values())  # the compiled launcher takes every parameter, in order
        self._device = None
        self._bound = tuple(bound)
        self.scratch = scratch  # the kernel builds tensor descriptors on the device: it needs Triton's allocator

    def kernel_tensors(self, tensors: tuple) -> tuple | list:
        """The tensor arguments the kernel receives for a call's ``tensors``: its bound tensors after them, its
        stand-ins in place."""
        tensors = (*tensors, *self._bound)
        if not self._stand_ins:
            return tensors
        tensors = list(tensors)
        for unread, stand_in in self._stand_ins:
            tensors[unread] = tensors[stand_in]
        return tensors

    def __call__(self, *tensors) -> None:
        if self._bound:
            tensors = (*tensors, *self._bound)
        if self._stand_ins:  # kernel_tensors, inline: this is the per-layer path
            tensors = list(tensors)
            for unread, stand_in in self._stand_ins:
                tensors[unread] = tensors[stand_in]
        if _COMPILE_ONLY.get():  # compile_ahead: hand this variant to Triton's compiler, launch nothing
            self.kernel.warmup(*tensors, *self.scalars, grid=self.grid, **self.constexprs, **self.options)
            return
        if self.scratch:  # Triton keeps the allocator per thread (a ContextVar): set it in the launching thread
            triton.set_allocator(_scratch)
        if self._compiled is not None and not _launch_hooks():
            pointers = [t.data_ptr() for t in tensors]
            # Every address a multiple of 16 exactly when their gcd is: one C call instead of a loop over them.
            if (math.gcd(*pointers) % 16 == 0) if self._all_aligned else (_alignment(pointers) == self._aligned):
                c = self._compiled
                c.run(*self.grid, _current_stream(self._device), c.function, c.packed_metadata, None, None, None,
                      *pointers, *self._tail)
                return
        variant = None
        if FAST_LAUNCH and self._compiled is None:  # a first call: another launch may have compiled this variant
            variant = self._variant(tensors)
            shared = _COMPILED.get(variant)
            if shared is not None and not _launch_hooks() and _held(self.kernel, variant[4], shared):
                self._keep(shared, variant[-1], tensors)
                shared.run(*self.grid, _current_stream(self._device), shared.function, shared.packed_metadata, None,
                           None, None, *[t.data_ptr() for t in tensors], *self._tail)
                return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs, **self.options)
        if variant is not None and self._compiled is None and hasattr(compiled, "packed_metadata"):
            self._keep(compiled, variant[-1], tensors)
            if len(_COMPILED) >= COMPILED_KEPT:
                del _COMPILED[next(iter(_COMPILED))]  # the oldest
            _COMPILED[variant] = compiled

    def _keep(self, compiled, aligned: int, tensors) -> None:
        """Replay ``compiled`` from now on for tensors of alignment pattern ``aligned``."""
        self._compiled, self._aligned = compiled, aligned
        self._all_aligned = aligned == (1 << len(tensors)) - 1
        self._device = tensors[0].device.index

    def _variant(self, tensors) -> tuple:
        """What Triton's dispatch specializes this launch's kernel on for ``tensors``: the kernel, every scalar and
        constexpr by type and value, the options, the device, each tensor's dtype and the alignment pattern (last)."""
        return (self.kernel, tuple((type(v), v) for v in self.scalars),
                tuple((name, type(v), v) for name, v in self.constexprs.items()), tuple(self.options.items()),
                tensors[0].device.index, tuple(t.dtype for t in tensors), _alignment([t.data_ptr() for t in tensors]))


# The compiled kernels that launches kept, by ``Launch._variant``: a launch prepared with the scalars, constexprs and
# options of an earlier one (another step's plan of the same shapes, a repeated one-shot call) replays that one's
# kernel from its first call, as Triton's dispatch would pick it for the same arguments, without dispatching, while
# Triton's own cache still holds it (``_held``). The oldest is dropped past COMPILED_KEPT (keys differ in the
# scalars: token counts, lengths).
COMPILED_KEPT = 4096
_COMPILED: dict[tuple, object] = {}


def _held(kernel, device: int, compiled) -> bool:
    """Whether Triton's in-process cache of ``kernel`` on ``device`` (``JITFunction.device_caches``: the compiled
    kernels by specialization first) still holds ``compiled``. A process that emptied it (the warm-up's GPU tests do,
    to watch what compiles) gets its variants through the dispatch again, as Triton would compile them, instead of
    kernels no cache lists; a few identity checks, paid on a launch's first call only."""
    caches = getattr(kernel, "device_caches", None)
    entry = caches.get(device) if isinstance(caches, dict) else None  # .get: a defaultdict would create an entry
    return entry is not None and any(value is compiled for value in entry[0].values())


class GrownBuffers:
    """One buffer per key (a device and stream, as a rule), grown when a launch needs more and never shrunk: a launch
    reuses the buffer of its key's previous launch, which stream order has finished with, so once the largest launch
    has run (the warm-up runs it) a step allocates nothing. A superseded buffer is kept (``superseded``): a CUDA graph
    captured over it holds its address. ``make(count, key)`` allocates a buffer of ``count`` elements."""

    def __init__(self, make) -> None:
        self._make = make
        self.buffers: dict = {}
        self.superseded: list[torch.Tensor] = []

    def get(self, key, count: int, most: int | None = None) -> torch.Tensor:
        """The buffer of ``key``, at least ``count`` elements: grown to ``max(count, 2 x its size)`` when smaller,
        the doubling held to ``most`` elements where given."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < count:
            doubled = 2 * buffer.numel() if buffer is not None else 0
            if buffer is not None:
                self.superseded.append(buffer)
            buffer = self.buffers[key] = self._make(max(count, doubled if most is None else min(doubled, most)), key)
        return buffer

    def on_stream(self, device: torch.device, count: int, *more, most: int | None = None) -> torch.Tensor:
        """``get`` keyed by ``(device.type, device.index, the current stream on device, *more)`` (stream 0 off
        CUDA)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        return self.get((device.type, device.index, stream, *more), count, most)


# Triton's global scratch (device-side tensor descriptors: a few hundred bytes per program), one buffer per device and
# stream, from torch's caching allocator (512-byte aligned, more than the 128 bytes a descriptor needs).
_SCRATCH = GrownBuffers(lambda count, key: torch.empty(count, dtype=torch.int8,
                                                      device="cuda" if key[0] >= 0 else "cpu"))


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator hook (``triton.set_allocator``): at least ``size`` bytes for a launch on ``stream``."""
    return _SCRATCH.get((torch.cuda.current_device() if torch.cuda.is_available() else -1, stream or 0), size)


def _launch_hooks() -> bool:
    """Whether a launch-enter hook (a profiler) wants launch metadata: replays go through Triton's dispatch then.
    Triton 3.6 keeps the hooks in a chain that is empty by default; older releases keep None or a function."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _alignment(pointers: list[int]) -> int:
    """Bit i set when address i is 16-byte aligned (what Triton specializes pointer arguments on)."""
    bits = 0
    for i, pointer in enumerate(pointers):
        if not pointer & 15:
            bits |= 1 << i
    return bits


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)
