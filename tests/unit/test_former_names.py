"""The public API's former names, which code outside this repository calls, still mean what the current ones do:
the kernels ``extend_attention`` / ``paged_attention`` (now ``chunk_attention`` / ``prefix_attention``, in
``dcp_plugin.kernels`` and its torch references), ``ParallelState.attn_dcp_size`` / ``attn_dcp_rank`` (now
``dcp_size`` / ``dcp_rank``) and ``HeadLayout.create``'s ``ps=`` (now ``parallel=``)."""

from __future__ import annotations

import pytest

import dcp_plugin as dp
from dcp_plugin import kernels
from dcp_plugin.kernels import reference


def test_the_former_kernel_names_are_the_current_functions():
    assert kernels.extend_attention is kernels.chunk_attention
    assert kernels.paged_attention is kernels.prefix_attention
    assert reference.extend_attention is reference.chunk_attention
    assert reference.paged_attention is reference.prefix_attention


def test_the_former_parallel_state_names():
    parallel = dp.ParallelState.from_tp(tp_rank=5, tp_size=8, dcp_size=4)
    assert (parallel.attn_dcp_size, parallel.attn_dcp_rank) == (4, 1)
    assert dp.ParallelState.trivial(tp_size=2, attn_dcp_size=2, tp_rank=1, attn_dcp_rank=1) == \
        dp.ParallelState(tp_size=2, dcp_size=2, tp_rank=1, dcp_rank=1)
    heads = dict(total_q_heads=32, total_kv_heads=2, kv_replication="replicated")
    assert dp.HeadLayout.create(**heads, ps=parallel) == dp.HeadLayout.create(**heads, parallel=parallel)
    for twice in ({}, {"ps": parallel, "parallel": parallel}):
        with pytest.raises(ValueError, match="once, as parallel="):
            dp.HeadLayout.create(**heads, **twice)
