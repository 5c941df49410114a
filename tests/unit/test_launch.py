"""Launch's compile-only mode: while compile-ahead records a warm-up's variants a prepared launch hands its kernel
variant to Triton's compiler (``kernel.warmup``, stand-ins in place) and launches nothing; launches_run restores
launching."""

from __future__ import annotations

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
