"""When the kernels take programmatic dependent launches (kernels/_pdl.py): compiled kernels on sm_90+ unless
DCP_TRITON_PDL=0, never under the interpreter or on CPU tensors; a bad switch is refused with what works; a launch
asked for PDL whose kernel does not wait for the previous one is refused. That the launched kernels give the
results of launches one after the other is checked on the GPU (tests/gpu/test_pdl_gpu.py); that every decode kernel
compiles for it on sm_90, on CPU (test_kernels_compile_for_hopper.py)."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import _pdl
from dcp_plugin.kernels._launch import Launch
from dcp_plugin.kernels.write_kv_cache import write_kv_cache_kernel

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """What compiled kernels on an sm_90 GPU see."""
    monkeypatch.setattr(_pdl, "INTERPRET", False)
    monkeypatch.setattr(_pdl, "_device_allows", lambda index: True)
    monkeypatch.delenv(_pdl.PDL_ENV, raising=False)


def test_never_under_the_interpreter_or_on_cpu(monkeypatch):
    monkeypatch.setenv(_pdl.PDL_ENV, "1")
    assert not _pdl.pdl_for(torch.device("cpu"))
    assert not _pdl.pdl_for(CUDA)  # this suite runs interpreted
    with _pdl.programmatic_launches(True):
        assert not _pdl.pdl_for(CUDA) and not _pdl.pdl_for(torch.device("cpu"))


@pytest.mark.usefixtures("hopper")
def test_on_by_default_on_sm90_and_off_by_the_switch(monkeypatch):
    assert _pdl.pdl_for(CUDA)
    monkeypatch.setattr(_pdl, "_device_allows", lambda index: False)  # an older GPU
    assert not _pdl.pdl_for(CUDA)
    monkeypatch.setattr(_pdl, "_device_allows", lambda index: True)
    monkeypatch.setenv(_pdl.PDL_ENV, "0")
    assert not _pdl.pdl_for(CUDA)
    with _pdl.programmatic_launches(True):  # a benchmark timing both in one process
        assert _pdl.pdl_for(CUDA)
        with _pdl.programmatic_launches(False):
            assert not _pdl.pdl_for(CUDA)
        assert _pdl.pdl_for(CUDA)
    assert not _pdl.pdl_for(CUDA)


@pytest.mark.usefixtures("hopper")
def test_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv(_pdl.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="DCP_TRITON_PDL must be 1 .* or 0 .* got 'yes'"):
        _pdl.pdl_for(CUDA)


def test_a_bad_switch_is_refused_when_the_engine_starts(monkeypatch):
    from dcp_plugin.kernel_choice import choose_kernel_impl

    monkeypatch.setenv(_pdl.PDL_ENV, "on")
    with pytest.raises(ValueError, match="DCP_TRITON_PDL must be 1 .* or 0 .* got 'on'"):
        choose_kernel_impl(engine="vLLM")


def test_a_pdl_launch_needs_a_kernel_that_waits():
    with pytest.raises(ValueError, match="write_kv_cache_kernel: a PDL launch needs the kernel's PDL above 0"):
        Launch(write_kv_cache_kernel, (1,), (), dict(PAGE_SIZE=16, BLOCK_H=1, BLOCK_D=128, FP8_MAX=0.0),
               num_warps=4, pdl=True)
    launch = Launch(write_kv_cache_kernel, (1,), (), dict(PAGE_SIZE=16, BLOCK_H=1, BLOCK_D=128, FP8_MAX=0.0, PDL=1),
                    num_warps=4, pdl=1)
    assert launch.options["launch_pdl"] is True


@pytest.mark.usefixtures("hopper")
def test_a_decode_layers_launches_ask_for_pdl_on_sm90(monkeypatch):
    """The cache write, the split pass and the merge of a decode planned as on an sm_90 GPU (CPU tensors stand in):
    each launch asks for PDL and passes its kernel PDL=True; with the switch off, none does."""
    import importlib

    from dcp_plugin.kernels import split_kv
    from dcp_plugin.kernels.prefix_attention import plan_prefix
    from dcp_plugin.kernels.write_kv_cache import plan_write_kv

    q, out = torch.zeros(2, 8, 128), torch.zeros(2, 8, 128)
    lse, cache = torch.zeros(2, 8), torch.zeros(2, 16, 2, 256)
    lens, qsl = torch.tensor([20, 30], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    table, slots = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), torch.tensor([19, 29])

    def launches():
        write = plan_write_kv(q[:, :2], q[:, :2], cache[..., :128], cache[..., 128:], slots)
        decode = plan_prefix(q, cache[..., :128], cache[..., 128:], table, lens, qsl, out, lse, scale=0.1,
                             q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=30, max_query_len=1,
                             num_splits=2)
        return [write, decode.stage1, decode.merge]

    paged_module, write_module = (importlib.import_module(f"dcp_plugin.kernels.{name}")
                                  for name in ("prefix_attention", "write_kv_cache"))
    for module in (paged_module, split_kv, write_module):  # the CPU tensors' device answers as an sm_90 GPU
        monkeypatch.setattr(module, "pdl_for", lambda device, role="short": _pdl.pdl_for(CUDA, role))
    on = launches()
    assert all(launch.options.get("launch_pdl") is True and launch.constexprs["PDL"] > 0 for launch in on)
    monkeypatch.setenv(_pdl.PDL_ENV, "0")
    off = launches()
    assert not any(launch.options.get("launch_pdl") or launch.constexprs["PDL"] for launch in off)


@pytest.mark.usefixtures("hopper")
def test_each_role_signals_where_it_is_told():
    assert _pdl.pdl_for(CUDA, "stage1") == _pdl.TRIGGER[_pdl.DEFAULT_TRIGGERS["stage1"]]
    with _pdl.programmatic_launches(True, stage1="end", short="exit"):
        assert (_pdl.pdl_for(CUDA, "stage1"), _pdl.pdl_for(CUDA, "short")) == (2, 3)
    with _pdl.programmatic_launches(True, stage1="off"):
        assert (_pdl.pdl_for(CUDA, "stage1"), _pdl.pdl_for(CUDA, "short")) == (0, 1)
    with pytest.raises(ValueError, match=r"roles \['stage1', 'short'\], each one of \['start', 'end', 'exit', 'off'\]"):
        with _pdl.programmatic_launches(True, stage2="end"):
            pass
