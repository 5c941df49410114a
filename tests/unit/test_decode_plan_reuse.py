"""Steady decoding prepares nothing: a decode step over the same batch buffers as the last one, its shards within the
same bound, replays that step's plan, and every step stays exact; any other step gets a plan of its own."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import DcpAttention, DcpBatch, step_plan
from dcp_plugin.step_plan import decode_bound
from dcp_plugin.warmup import warm_up
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import run_threads
from tests.helpers.steady_decode import EngineBuffers, counted, run_steady_decode

BOUND_STEP = 8  # small enough that the CPU cases' shards cross a few bounds


@pytest.mark.parametrize("n, comm, kernels", [(1, "ag_rs", "triton"), (2, "a2a", "triton"), (2, "ag_rs", "reference")])
def test_steady_decoding_replays_one_plan_per_bound_and_every_step_is_exact(monkeypatch, n, comm, kernels):
    monkeypatch.setattr(step_plan, "DECODE_BOUND_STEP", BOUND_STEP)
    decode_steps = 7
    case = Case(name="reuse", q_heads=4, kv_heads=2, head_dim=16, requests=((5, 1), (11, 1), (2, 1)), comm=comm,
                kernel_impl=kernels, decode_steps=decode_steps, seed=21)

    results = run_threads(n, lambda rank, exchange: run_steady_decode(case, n, rank, exchange))
    made, distinct = results[0]
    assert 1 < distinct < decode_steps + 1, "the case must cross some bounds and stay within others"
    assert results == [(distinct, distinct)] * n  # one plan per bound, on every rank


def test_a_decode_step_over_other_buffers_or_another_batch_size_gets_its_own_plan():
    case = Case(name="other", q_heads=4, kv_heads=2, head_dim=16, requests=((5, 1), (7, 1)), decode_steps=4, seed=5)
    state = RankState.create(case, World(case), 1, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=0.25, kernel_impl="reference")
    made = counted(attn)
    engine = EngineBuffers(state, 2)

    def run(batch, q, k, v):
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch)

    q, k, v, batch, _ = engine.decode_step()
    run(batch, q, k, v)
    q, k, v, batch, _ = engine.decode_step()
    run(batch, q, k, v)
    assert len(made) == 1, "the second step, same buffers and bound, replays the first step's plan"
    state.block_table = state.block_table.clone()  # the same pages in other memory
    q, k, v, batch, _ = engine.decode_step()
    run(batch, q, k, v)
    assert len(made) == 2
    q, k, v, fresh, _ = state.step([1, 1])  # fresh tensors: another address for every batch tensor
    run(fresh, q, k, v)
    assert len(made) == 3
    one = DcpBatch.build(query_start_loc=engine.query_start_loc[:2], seq_lens=engine.seq_lens[:1],
                         block_table=state.block_table, slot_mapping=engine.slot_mapping[:1], tokens=state.tokens,
                         buffers=engine.derived)
    run(one, q[:1], k[:1], v[:1])
    assert len(made) == 4


def test_decode_bound_covers_the_shards_and_the_table_caps_it(monkeypatch):
    monkeypatch.setattr(step_plan, "DECODE_BOUND_STEP", BOUND_STEP)
    case = Case(name="bound", q_heads=4, kv_heads=2, head_dim=16, requests=((5, 1), (17, 1)), seed=2)
    state = RankState.create(case, World(case), 1, 0)
    capacity = state.block_table.shape[1] * case.block_size  # 18 tokens over pages of 4: 5 pages, 20 tokens
    assert capacity == 20
    for lens, want in (((6, 8), 8), ((6, 9), 16), ((6, 17), 20), ((6, 20), 20)):
        batch = DcpBatch.build(query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                               seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=state.block_table,
                               slot_mapping=torch.tensor([-1, -1]), tokens=state.tokens)
        assert decode_bound(batch) == want, lens


def test_a_warm_up_keeps_no_decode_plan():
    """The warm-up's steps run extra kernel variants (``every_variant``): their plans are never replayed."""
    case = Case(name="warm", q_heads=4, kv_heads=2, head_dim=16, requests=((3, 1),), seed=9)
    state = RankState.create(case, World(case), 1, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=0.25, kernel_impl="reference")
    made = counted(attn)
    kv = torch.zeros(5, 2, 16)
    warm_up(attn, query=torch.zeros(5, 4, 16), key=kv, value=kv, key_cache=state.key_cache,
            value_cache=state.value_cache, output=torch.zeros(5, 4, 16))
    assert made and attn._last_decode is None


def test_a_warm_up_step_plans_afresh_even_where_a_serving_plan_matches():
    """A plan made outside the warm-up holds only the variants its own sizes pick; a warm-up step like it (an
    engine's dummy run came first) must plan afresh, inside ``every_variant``, so every variant compiles."""
    from dcp_plugin.kernels import every_variant

    case = Case(name="rewarm", q_heads=4, kv_heads=2, head_dim=16, requests=((5, 1), (7, 1)), decode_steps=2, seed=4)
    state = RankState.create(case, World(case), 1, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=0.25, kernel_impl="reference")
    made = counted(attn)
    engine = EngineBuffers(state, 2)
    q, k, v, batch, _ = engine.decode_step()
    attn.forward(q, k, v, state.key_cache, state.value_cache, batch)
    kept = attn._last_decode
    q, k, v, batch, _ = engine.decode_step()  # the same buffers and bound: a serving step replays the plan
    with every_variant():
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch)
    assert len(made) == 2 and attn._last_decode is kept
