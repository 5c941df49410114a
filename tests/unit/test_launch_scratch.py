"""Triton's global scratch for device-side tensor descriptors: one buffer per stream, reused, grown, never freed."""

import torch

from dcp_plugin.kernels import _launch


def test_a_stream_reuses_its_buffer_and_keeps_what_it_outgrew():
    _launch._SCRATCH.buffers.clear()
    first = _launch._scratch(1000, 128, 11)
    assert first.numel() == 1000 and _launch._scratch(600, 128, 11) is first  # reused, not reallocated
    other = _launch._scratch(600, 128, 12)
    assert other is not first  # another stream: its own buffer (launches on two streams may overlap)
    grown = _launch._scratch(1500, 128, 11)
    assert grown.numel() == 2000 and grown is not first  # at least doubled: a few growths in all
    assert any(b is first for b in _launch._SCRATCH.superseded)  # a graph captured over it keeps a valid address
    assert _launch._scratch(2000, 128, 11) is grown


def test_a_bound_holds_the_doubling_but_never_a_larger_request():
    buffers = _launch.GrownBuffers(lambda count, key: torch.empty(count))
    assert buffers.get("k", 600, most=1000).numel() == 600
    assert buffers.get("k", 700, most=1000).numel() == 1000  # doubled to 1200, held to the bound
    assert buffers.get("k", 1500, most=1000).numel() == 1500  # what a launch needs, whatever the bound
    assert len(buffers.superseded) == 2
