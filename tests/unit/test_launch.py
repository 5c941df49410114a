"""Launch's compile-only mode: while compile-ahead records a warm-up's variants a prepared launch hands its kernel
variant to Triton's compiler (``kernel.warmup``, stand-ins in place) and launches nothing; launches_run restores
launching. And its replay of a kept kernel, which must follow the tensors' 16-byte alignment as Triton's dispatch
does."""

from __future__ import annotations

import os

import pytest
import torch

from dcp_plugin.kernels import _launch
from dcp_plugin.kernels._launch import Launch, launches_run


class _RecordingKernel:
    """Stands in for a ``@triton.jit`` function: records warm-ups (compile, no launch) and launches."""

    def __init__(self):
        self.calls = []

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))


def test_in_compile_only_mode_a_launch_compiles_and_launches_nothing():
    kernel = _RecordingKernel()
    launch = Launch(kernel, (3,), (7, 0.5), {"BLOCK": 16}, num_warps=4, num_stages=2, stand_ins={1: 0})
    a = torch.zeros(4)
    token = _launch.set_compile_only(True)
    try:
        assert _launch.compile_only()
        launch(a, None)
        with launches_run():
            assert not _launch.compile_only()
            launch(a, None)
        assert _launch.compile_only()
    finally:
        _launch.reset_compile_only(token)
    assert not _launch.compile_only()
    launch(a, None)
    options = {"BLOCK": 16, "num_warps": 4, "num_stages": 2}
    assert [c[0] for c in kernel.calls] == ["compile", "launch", "launch"]
    kind, grid, args, kwargs = kernel.calls[0]
    assert grid == (3, 1, 1) and args == (a, a, 7, 0.5) and kwargs == options  # the stand-in is in place
    assert kernel.calls[1][2] == (a, a, 7, 0.5) and kernel.calls[1][3] == options


class _Compiled:
    """Stands in for the compiled kernel Triton's dispatch returns: ``run`` records each direct replay."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.replays = []

    def run(self, *args):
        self.replays.append(args)


class _CompilingKernel(_RecordingKernel):
    """A ``@triton.jit`` stand-in whose dispatch returns one compiled kernel and lists it in its in-process cache
    (``device_caches``: per device, the compiled kernels by specialization first), as Triton's does. CPU tensors'
    device index is None."""

    def __init__(self):
        super().__init__()
        self.compiled = _Compiled()
        self.device_caches = {None: ({}, None)}

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.calls.append(("launch", grid, args, kwargs))
            self.device_caches[None][0][len(self.calls)] = self.compiled
            return self.compiled

        return dispatch


@pytest.fixture
def replaying(monkeypatch):
    """Replays on, as on a GPU with Triton 3.4-3.6: no launch hook, a stand-in stream, no kernel kept yet."""
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 0)
    monkeypatch.setattr(_launch, "_launch_hooks", lambda: False)
    monkeypatch.setattr(_launch, "_COMPILED", {})


def test_a_kept_kernel_replays_only_for_the_alignment_it_was_compiled_for(replaying):
    # Triton specializes pointer arguments on 16-byte alignment: a launch replays the kernel its first call compiled
    # (addresses passed as ints) while every tensor keeps that call's alignment, and otherwise asks the dispatch.
    memory = [torch.zeros(256, dtype=torch.int8) for _ in range(4)]
    aligned = [m[:64] for m in memory]
    shifted = [m[8:72] for m in memory]  # 8 bytes past a 16-byte boundary: aligned to 8, not 16
    assert all(t.data_ptr() % 16 == 0 for t in aligned) and all(t.data_ptr() % 16 == 8 for t in shifted)

    def dispatches_and_replays(first, *later):
        kernel = _CompilingKernel()
        launch = Launch(kernel, (2,), (5,), {}, num_warps=4)
        for tensors in (first, *later):
            launch(*tensors)
        # A replay's arguments: the grid (3), stream, function, metadata, three hooks, the addresses, the scalar 5.
        replayed = [args[9:-1] for args in kernel.compiled.replays]
        return len(kernel.calls), replayed

    # Compiled for aligned tensors: other aligned ones replay; one shifted tensor goes to the dispatch.
    calls, replayed = dispatches_and_replays(aligned[:2], aligned[2:], [shifted[0], aligned[1]], aligned[:2])
    assert calls == 2
    assert replayed == [tuple(t.data_ptr() for t in aligned[2:]), tuple(t.data_ptr() for t in aligned[:2])]
    # Compiled with its first tensor shifted: the same pattern replays; all aligned is another variant.
    calls, replayed = dispatches_and_replays([shifted[0], aligned[1]], [shifted[2], aligned[3]], aligned[:2])
    assert calls == 2 and replayed == [(shifted[2].data_ptr(), aligned[3].data_ptr())]


def test_a_new_launch_replays_the_kernel_an_equal_launch_compiled_and_nothing_else(replaying, monkeypatch):
    # A plan built again for the same shapes (a repeated one-shot call, the next step's plan) replays from its first
    # call the kernel an earlier launch compiled, when everything Triton's dispatch specializes on is equal: scalars
    # and constexprs by name, type and value, options, tensor dtypes and alignment. Anything else dispatches.
    kernel = _CompilingKernel()
    memory = [torch.zeros(256, dtype=torch.int8) for _ in range(2)]
    aligned, shifted = [m[:64] for m in memory], [m[8:72] for m in memory]
    halves = [m[:32].view(torch.float16) for m in memory]  # aligned too, another dtype

    def launch(tensors, scalars=(5,), constexprs=(("A", 1), ("B", 0)), warps=4):
        Launch(kernel, (2,), scalars, dict(constexprs), num_warps=warps)(*tensors)

    launch(aligned)
    assert len(kernel.calls) == 1 and not kernel.compiled.replays
    launch(aligned)  # equal: no dispatch
    assert len(kernel.calls) == 1 and len(kernel.compiled.replays) == 1
    assert kernel.compiled.replays[0][9:] == (*[t.data_ptr() for t in aligned], 5, 1, 0)
    for different in (dict(tensors=shifted), dict(tensors=halves), dict(tensors=aligned, scalars=(6,)),
                      dict(tensors=aligned, scalars=(5.0,)), dict(tensors=aligned, constexprs=(("A", True), ("B", 0))),
                      dict(tensors=aligned, constexprs=(("B", 1), ("A", 0))), dict(tensors=aligned, warps=8)):
        dispatched = len(kernel.calls)
        launch(**different)
        assert len(kernel.calls) == dispatched + 1, f"{different}: replayed another launch's kernel"
        launch(**different)  # now compiled for it: equal again
        assert len(kernel.calls) == dispatched + 1, f"{different}: dispatched again"
    monkeypatch.setattr(_launch, "_launch_hooks", lambda: True)  # a profiler wants every launch's metadata
    dispatched = len(kernel.calls)
    launch(aligned)
    assert len(kernel.calls) == dispatched + 1


def test_a_kept_kernel_is_replayed_only_while_tritons_cache_holds_it(replaying):
    # A process that empties Triton's in-process cache (the warm-up's GPU tests, to watch what compiles) must see
    # the next launch go through the dispatch, as Triton compiles it again, not replay a kernel no cache lists.
    kernel = _CompilingKernel()
    tensors = [torch.zeros(256, dtype=torch.int8)[:64] for _ in range(2)]

    def launch():
        Launch(kernel, (2,), (5,), {"A": 1}, num_warps=4)(*tensors)

    launch()
    launch()  # held: replayed
    assert len(kernel.calls) == 1 and len(kernel.compiled.replays) == 1
    kernel.device_caches[None][0].clear()
    launch()  # no longer held: dispatched (and listed again)
    assert len(kernel.calls) == 2 and len(kernel.compiled.replays) == 1
    launch()
    assert len(kernel.calls) == 2 and len(kernel.compiled.replays) == 2
    kernel.device_caches[None][0].clear()
    kernel.device_caches[None][0]["other"] = _Compiled()  # another variant cached: still not this one
    launch()
    assert len(kernel.calls) == 3


@pytest.mark.parametrize("env, want", [({"DCP_TRITON_FAST_LAUNCH": "yes"}, "DCP_TRITON_FAST_LAUNCH must be 1"),
                                       ({"TRITON_INTERPRET": "true"}, "interpret True fast False"),
                                       ({"TRITON_INTERPRET": "on", "DCP_TRITON_FAST_LAUNCH": "0"},
                                        "interpret True fast False")])
def test_switches_are_read_as_their_owners_read_them(env, want):
    """DCP_TRITON_FAST_LAUNCH takes 1 or 0 and refuses anything else (it used to act only on "0"), even where the
    interpreter rules the fast launch out; TRITON_INTERPRET is read as Triton reads it ("true", "on" included)."""
    import subprocess
    import sys

    code = ("from dcp_plugin.kernels import _launch, _mode\n"
            "print('interpret', _mode.INTERPRET, 'fast', _launch.FAST_LAUNCH)")
    base = {k: v for k, v in os.environ.items() if k not in ("DCP_TRITON_FAST_LAUNCH", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, **env, "CUDA_VISIBLE_DEVICES": ""})
    assert want in done.stdout + done.stderr, done.stderr[-2000:]
    assert (done.returncode != 0) == ("must be" in want)


def test_the_installed_triton_dispatch_ends_in_the_call_a_replay_makes():
    """CI installs the newest Triton from PyPI. A replay calls the compiled kernel's launcher exactly as Triton's own
    dispatch (``JITFunction.run``) ends: grid x, y, z, stream, function, packed metadata, launch metadata, the enter
    and exit hooks, then every parameter in order. The day a Triton release calls it otherwise, this fails: that
    release must stay outside the fast launch's releases (``_FAST_LAUNCH_TRITON``), where every launch goes through
    Triton's dispatch (the fallback ``test_launch_gpu.py`` runs on a GPU)."""
    import inspect
    import re

    import triton
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    dispatch = " ".join(inspect.getsource(JITFunction.run).split())
    call = re.search(r"kernel\.run\(grid_0, grid_1, grid_2, stream, kernel\.function, kernel\.packed_metadata, "
                     r"launch_metadata, knobs\.runtime\.launch_enter_hook, knobs\.runtime\.launch_exit_hook, "
                     r"\*bound_args\.values\(\)\)", dispatch)
    assert call, f"Triton {triton.__version__}'s dispatch no longer ends in the launcher call a replay makes"
    cached = " ".join(inspect.getsource(JITFunction).split())  # where _launch._held looks for a kept kernel
    assert re.search(r"kernel_cache, \w+, target, backend, binder = self\.device_caches\[device\]", dispatch) \
        and "kernel_cache[key] = kernel" in cached, \
        f"Triton {triton.__version__} no longer lists its compiled kernels first in device_caches[device]"
    kept = inspect.getsource(CompiledKernel)  # what a replay reads off the kernel it kept
    assert all(f"self.{name} =" in kept for name in ("function", "packed_metadata")), \
        f"Triton {triton.__version__}'s compiled kernel no longer keeps its function and packed metadata"
