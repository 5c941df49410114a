"""Launch's compile-ahead mode: inside compile_ahead a prepared launch submits its kernel variant to Triton's
compiler and launches nothing, and on exit each compiled variant's launcher is built; launches_run restores
launching; the thread count comes from one variable."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import _launch
from dcp_plugin.kernels._launch import Launch, compile_ahead, compile_threads, launches_run


class _RecordingKernel:
    """Stands in for a ``@triton.jit`` function: records warm-ups (compile, no launch) and launches."""

    def __init__(self, compiled=None):
        self.calls = []
        self.compiled = compiled  # what Triton's warmup hands back: a compiled kernel (or a future of one)

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))


def test_inside_compile_ahead_a_launch_compiles_and_launches_nothing():
    kernel = _RecordingKernel()
    launch = Launch(kernel, (3,), (7, 0.5), {"BLOCK": 16}, num_warps=4, num_stages=2, stand_ins={1: 0})
    a = torch.zeros(4)
    with compile_ahead(2):
        launch(a, None)
        with launches_run():
            launch(a, None)
    launch(a, None)
    options = {"BLOCK": 16, "num_warps": 4, "num_stages": 2}
    assert [c[0] for c in kernel.calls] == ["compile", "launch", "launch"]
    kind, grid, args, kwargs = kernel.calls[0]
    assert grid == (3, 1, 1) and args == (a, a, 7, 0.5) and kwargs == options  # the stand-in is in place
    assert kernel.calls[1][2] == (a, a, 7, 0.5) and kernel.calls[1][3] == options


@pytest.mark.parametrize(("value", "want"), [(None, 0), ("0", 0), ("6", 6), (" 3 ", 3)])
def test_compile_threads_from_the_environment(monkeypatch, value, want):
    monkeypatch.setattr(_launch, "INTERPRET", False)
    if value is None:
        monkeypatch.delenv(_launch.COMPILE_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(_launch.COMPILE_THREADS_ENV, value)
    assert compile_threads() == want


def test_compile_threads_refuses_what_is_not_a_count_and_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setenv(_launch.COMPILE_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="DCP_TRITON_COMPILE_THREADS must be a whole number of threads"):
        compile_threads()
    monkeypatch.setenv(_launch.COMPILE_THREADS_ENV, "4")
    monkeypatch.setattr(_launch, "INTERPRET", True)
    assert compile_threads() == 0


class _Future:
    """Stands in for Triton's future of a compiled kernel (``AsyncCompileMode``)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def result(self):
        return self.kernel


def test_on_exit_compile_ahead_builds_each_compiled_variants_launcher_once(monkeypatch):
    compiled = [type("Compiled", (), {"src": f"src{i}", "metadata": f"meta{i}"})() for i in range(2)]
    first, second = _RecordingKernel(_Future(compiled[0])), _RecordingKernel(compiled[1])  # the second compiled before
    built = []
    a = torch.zeros(4)
    launches = [Launch(kernel, (1,), (), {}, num_warps=4) for kernel in (first, second, first)]
    with compile_ahead(2, make_launcher=lambda src, metadata: built.append((src, metadata))):
        for launch in launches:
            launch(a)
        assert built == []  # the launchers wait for every compile
    assert sorted(built) == [("src0", "meta0"), ("src1", "meta1")]


def test_a_launcher_that_cannot_build_fails_the_compile_ahead():
    kernel = _RecordingKernel(_Future(type("Compiled", (), {"src": "s", "metadata": "m"})()))

    def broken(src, metadata):
        raise RuntimeError("cc failed")

    with pytest.raises(RuntimeError, match="cc failed"):
        with compile_ahead(1, make_launcher=broken):
            Launch(kernel, (1,), (), {}, num_warps=4)(torch.zeros(1))
