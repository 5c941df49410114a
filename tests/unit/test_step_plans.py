"""A step's launches are prepared once and replayed by every layer: plans are shared exactly when they may be, the
workspace holds every intermediate, a workspace too small falls back correctly, the dummy warm-up steps write
nothing, and partials that cross ranks in the model dtype stay within two roundings of it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from dcp_plugin import DcpAttention, DcpBatch, DcpBatchBuffers, DcpWorkspace
from dcp_plugin.kernels import reference
from dcp_plugin.step_plan import A2aPlan, AgRsPlan, ChunkOnlyPlan, SingleRankPlan
from dcp_plugin.warmup import STEPS, warm_up
from dcp_plugin.workspace import packed_width, unpack
from dcp_plugin.testing import Case, RankState, ShapeOnlyGroup, World
from tests.helpers.dcp_harness import ThreadGroup, run_threads, serial
from tests.helpers.kernel_checks import assert_matches

MIXED = ((0, 5), (9, 1), (14, 4), (2, 2), (30, 1))


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_layers_share_one_plan_per_step_and_each_gets_its_own_answer(comm):
    """Two layers (other Q/K/V, other caches) of one step: one plan, built by the first; both outputs exact."""
    case = Case(name="plans", q_heads=8, kv_heads=2, requests=MIXED, comm=comm, head_dim=16, seed=3)

    def rank_fn(rank, exchange):
        world_a, world_b = World(case), World(Case(**{**case.__dict__, "seed": 4}))
        state_a, state_b = RankState.create(case, world_a, 2, rank), RankState.create(case, world_b, 2, rank)
        group = ThreadGroup(exchange, rank)
        ws = DcpWorkspace(heads=state_a.heads, head_dim=16, dtype=torch.float32, device="cpu", max_num_tokens=64,
                          comm=comm)
        layers = [DcpAttention(heads=state_a.heads, tokens=state_a.tokens, group=group, scale=world_a.scale,
                               comm=comm, kernel_impl="reference", workspace=ws) for _ in range(2)]
        q_a, k_a, v_a, batch, positions = state_a.step([new for _, new in case.requests])
        q_b, k_b, v_b, _, _ = state_b.step([new for _, new in case.requests])
        out_a = layers[0].forward(q_a, k_a, v_a, state_a.key_cache, state_a.value_cache, batch)
        out_b = layers[1].forward(q_b, k_b, v_b, state_b.key_cache, state_b.value_cache, batch)
        heads = range(state_a.heads.q_head_start, state_a.heads.q_head_start + state_a.heads.num_q_heads)
        for world, out in ((world_a, out_a), (world_b, out_b)):
            want = torch.cat([world.causal_attention_f64(b, p, heads) for b, p in enumerate(positions)])
            assert_matches(out, want, torch.float32, f"rank {rank}")
        return len(batch.plans)

    assert run_threads(2, rank_fn) == [1, 1]


def test_layers_with_equal_settings_share_the_plan_key_object_and_others_do_not():
    heads, tokens = Case(name="key", q_heads=4, kv_heads=2, tp=1).layouts(1, 0)
    ws = DcpWorkspace(heads=heads, head_dim=16, dtype=torch.float32, device="cpu", max_num_tokens=8, comm="ag_rs")

    def layer(**overrides):
        return DcpAttention(**{**dict(heads=heads, tokens=tokens, group=None, scale=0.25, kernel_impl="reference",
                                      workspace=ws), **overrides})

    assert layer()._plan_key is layer()._plan_key  # one object: the per-layer key compares it by identity
    others = [layer(scale=0.5), layer(kernel_impl="triton"), layer(workspace=None), layer(comm="a2a", workspace=None)]
    assert len({layer()._plan_key, *(other._plan_key for other in others)}) == 5


FLOWS = {  # (DCP size, comm, (cached context, new tokens) per request) -> the plan class of that flow
    "no context, DCP 1": (1, "ag_rs", ((0, 3), (0, 2)), ChunkOnlyPlan),
    "no context, DCP 2": (2, "a2a", ((0, 3),), ChunkOnlyPlan),
    "DCP 1 decode": (1, "ag_rs", ((5, 1), (2, 1)), SingleRankPlan),
    "DCP 1 mixed": (1, "a2a", ((5, 1), (3, 2)), SingleRankPlan),
    "ag_rs decode": (2, "ag_rs", ((5, 1),), AgRsPlan),
    "ag_rs mixed": (2, "ag_rs", ((5, 1), (3, 2)), AgRsPlan),
    "a2a decode": (2, "a2a", ((5, 1),), A2aPlan),
    "a2a mixed": (2, "a2a", ((0, 4), (3, 2)), A2aPlan),
}


@pytest.mark.parametrize("n, comm, requests, flow", list(FLOWS.values()), ids=list(FLOWS))
def test_each_flow_is_planned_by_its_own_class(n, comm, requests, flow):
    case = Case(name="flow", q_heads=4, kv_heads=2, requests=requests, comm=comm, head_dim=16, seed=14)
    state = RankState.create(case, World(case), n, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=ShapeOnlyGroup(n, 0) if n > 1 else None,
                        scale=0.25, comm=comm, kernel_impl="reference")
    q, k, v, batch, _ = state.step([new for _, new in requests])
    attn.forward(q, k, v, state.key_cache, state.value_cache, batch)
    (plan,) = batch.plans.values()
    assert type(plan) is flow


def test_other_strides_get_their_own_plan():
    case = Case(name="strides", q_heads=4, kv_heads=2, requests=MIXED, head_dim=16, seed=5, tp=1)
    world = World(case)
    state = RankState.create(case, world, 1, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=world.scale, kernel_impl="reference")
    q, k, v, batch, positions = state.step([new for _, new in case.requests])
    first = attn.forward(q, k, v, state.key_cache, state.value_cache, batch, write_kv=False)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])  # the same q as a strided view
    wide[..., :16] = q
    second = attn.forward(wide[..., :16], k, v, state.key_cache, state.value_cache, batch, write_kv=False)
    assert len(batch.plans) == 2 and torch.equal(first, second)


def test_a_step_larger_than_the_shared_workspace_is_still_exact(caplog):
    case = Case(name="big", q_heads=4, kv_heads=2, requests=MIXED, head_dim=16, seed=6, tp=1)
    world = World(case)
    state = RankState.create(case, world, 1, 0)
    ws = DcpWorkspace(heads=state.heads, head_dim=16, dtype=torch.float32, device="cpu", max_num_tokens=4,
                      comm="ag_rs")
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=world.scale, kernel_impl="reference",
                        workspace=ws)
    q, k, v, batch, positions = state.step([new for _, new in case.requests])
    with caplog.at_level(logging.WARNING, logger="dcp_plugin"):
        out = attn.forward(q, k, v, state.key_cache, state.value_cache, batch)
    assert "does not fit the shared workspace" in caplog.text
    want = torch.cat([world.causal_attention_f64(b, p, range(4)) for b, p in enumerate(positions)])
    assert_matches(out, want, torch.float32, "oversized step")
    (kept,) = attn._overflow
    again = dataclasses.replace(batch, plans={})  # a next step of that size (a new plan) reuses it, silently
    with caplog.at_level(logging.WARNING, logger="dcp_plugin"):
        out_again = attn.forward(q, k, v, state.key_cache, state.value_cache, again, write_kv=False)
    assert len(attn._overflow) == 1 and attn._overflow[0] is kept and caplog.text.count("does not fit") == 1
    assert torch.equal(out_again, out)


def test_workspace_rejects_another_layout():
    case = Case(name="ws", q_heads=4, kv_heads=2, head_dim=16, tp=1)
    heads, tokens = case.layouts(1, 0)
    other, _ = Case(name="ws", q_heads=8, kv_heads=2, head_dim=16, tp=1).layouts(1, 0)
    ws = DcpWorkspace(heads=other, head_dim=16, dtype=torch.float32, device="cpu", max_num_tokens=8, comm="ag_rs")
    with pytest.raises(ValueError, match="workspace was made for"):
        DcpAttention(heads=heads, tokens=tokens, group=None, scale=0.25, kernel_impl="reference", workspace=ws)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_packed_rows_are_16_element_multiples_and_unpack_round_trips(dtype):
    for heads, head_dim in ((1, 64), (3, 80), (8, 128), (5, 96)):
        width = packed_width(heads, head_dim, dtype)
        assert width % 16 == 0 and width >= heads * head_dim + heads * 4 // torch.empty(0, dtype=dtype).element_size()
        packed = torch.zeros(2, 3, width, dtype=dtype)
        out, lse = unpack(packed, heads, head_dim)
        values = torch.randn(2, 3, heads, head_dim).to(dtype)
        lses = torch.randn(2, 3, heads)
        out.copy_(values)
        lse.copy_(lses)
        again_out, again_lse = unpack(packed, heads, head_dim)
        assert torch.equal(again_out, values) and torch.equal(again_lse, lses)  # LSE bits never touch O


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_warm_up_runs_every_step_kind_and_leaves_the_cache_alone(trees, monkeypatch):
    """Every step kind (with ``trees``, a verify step under a chunk_mask too: its own current-chunk variant), on
    two ranks, and no slot of the cache written."""
    case = Case(name="warm", q_heads=4, kv_heads=2, head_dim=16, requests=((3, 1),), seed=9)
    masks = []
    real = reference.plan_chunk
    monkeypatch.setattr(reference, "plan_chunk", lambda *a, chunk_mask=None, **k: masks.append(chunk_mask) or
                        real(*a, chunk_mask=chunk_mask, **k))

    def rank_fn(rank, exchange):
        state = RankState.create(case, World(case), 2, rank)
        before = state.key_cache.clone(), state.value_cache.clone()
        attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=ThreadGroup(exchange, rank), scale=0.25,
                            kernel_impl="reference")
        q = torch.zeros(5, 2, 16)
        kv = torch.zeros(5, 2, 16)
        steps = warm_up(attn, query=q, key=kv, value=kv, key_cache=state.key_cache, value_cache=state.value_cache,
                        output=torch.zeros(5, 2, 16), trees=trees)
        for cache, saved in zip((state.key_cache, state.value_cache), before):
            assert torch.equal(cache.nan_to_num(7.0), saved.nan_to_num(7.0)), "warm-up wrote the KV cache"
        return steps

    assert run_threads(2, rank_fn) == [len(STEPS) + trees] * 2
    assert sum(mask is not None for mask in masks) == 2 * trees  # the tree step's chunk, once per rank


def test_warm_up_covers_every_kind():
    kinds = set()
    for requests in STEPS:
        rows = [r for r, _ in requests]
        contexts = [c for _, c in requests]
        kind = "decode" if max(rows) == 1 else "short" if max(rows) <= 8 else "long"
        if rows[0] == 1 and max(rows) > 1:
            kind = "decodes first"
        kinds.add("chunk" if max(contexts) == 0 else (kind, "splits" if max(contexts) >= 4096 else "one split"))
    assert kinds == {"chunk"} | {(k, s) for k in ("decode", "short", "long", "decodes first")
                                 for s in ("splits", "one split")}


def test_warm_up_adds_a_long_chunk_only_where_a_step_can_reach_it(monkeypatch):
    """A chunk past SHORT_CHUNK rows compiles the current chunk's larger GPU tiles, and over an fp8 cache whose
    prefills take the 16-bit copy the copy's steps compile it and the pass over it: warmed up with the GPU's Triton
    kernels when the workspace holds such a step (or the layer sizes its own), not under the interpreter or with
    the torch references, whose tiles do not depend on it."""
    from types import SimpleNamespace

    from dcp_plugin import warmup
    from dcp_plugin.kernels.chunk_attention import SHORT_CHUNK

    def attn(kernels, max_tokens):
        fits = None if max_tokens is None else SimpleNamespace(fits=lambda t: t <= max_tokens)
        return SimpleNamespace(kernel_impl=kernels, workspace=fits)

    monkeypatch.setattr(warmup, "INTERPRET", False)
    assert warmup.steps_for(attn("triton", 8192))[-1] == warmup.LONG_CHUNK == ((SHORT_CHUNK + 1, 0),)
    assert warmup.steps_for(attn("triton", None)) == (*STEPS, warmup.LONG_CHUNK)
    assert warmup.steps_for(attn("triton", SHORT_CHUNK)) == STEPS
    assert warmup.steps_for(attn("reference", 8192)) == STEPS
    assert warmup.steps_for(attn("triton", 8192), fp8_copy=True) == (*STEPS, warmup.LONG_CHUNK,
                                                                      *warmup.FP8_COPY_STEPS)
    assert warmup.steps_for(attn("triton", 63), fp8_copy=True) == STEPS  # a 64-row prefill cannot come
    assert warmup.steps_for(attn("reference", 8192), fp8_copy=True) == STEPS
    monkeypatch.setattr(warmup, "INTERPRET", True)
    assert warmup.steps_for(attn("triton", 8192)) == STEPS


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("n", [2, 4])
def test_model_dtype_partials_cost_at_most_two_roundings(comm, n):
    """fp16 at DCP = N (partials and reduce-scatter in fp16, LSEs in float32) vs the same inputs at DCP = 1, both vs
    float64: sharding adds at most two fp16 roundings to the worst error and at most doubles the mean error (measured
    here: worst 7.4e-4 at DCP = 1, 7.4e-4 to 8.7e-4 sharded; mean 5.2e-5 vs 7.1e-5 to 9.5e-5)."""
    requests = ((40, 1), (17, 3), (64, 1), (9, 6))
    base = dict(q_heads=8, kv_heads=2, requests=requests, head_dim=32, seed=11, dtype="float16", comm=comm)
    world = World(Case(name="fp16", **base))
    single = RankState.create(Case(name="fp16", tp=1, **base), world, 1, 0)
    attn = DcpAttention(heads=single.heads, tokens=single.tokens, group=None, scale=world.scale,
                        kernel_impl="reference")
    q, k, v, batch, positions = single.step([new for _, new in requests])
    ref_out = attn.forward(q, k, v, single.key_cache, single.value_cache, batch).double()
    want = torch.cat([world.causal_attention_f64(b, p, range(8)) for b, p in enumerate(positions)])

    def rank_fn(rank, exchange):
        state = RankState.create(Case(name="fp16", **base), world, n, rank)
        dcp = DcpAttention(heads=state.heads, tokens=state.tokens, group=ThreadGroup(exchange, rank),
                           scale=world.scale, comm=comm, kernel_impl="reference")
        q, k, v, batch, _ = state.step([new for _, new in requests])
        return dcp.forward(q, k, v, state.key_cache, state.value_cache, batch).double()

    sharded = torch.cat(run_threads(n, rank_fn), dim=1)
    single_err, sharded_err = (ref_out - want).abs(), (sharded - want).abs()
    two_roundings = 2 * 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 10)  # fp16 spacing at the largest value
    assert sharded_err.max() <= single_err.max() + two_roundings, (float(sharded_err.max()), float(single_err.max()))
    assert sharded_err.mean() <= 2 * single_err.mean(), (float(sharded_err.mean()), float(single_err.mean()))
    assert (sharded != ref_out).any(), "no rounding difference at all: the fp16 partials were not exercised"


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_mixed_steps_leading_decodes_get_their_own_decode_launch(n, comm, kernels):
    """Decodes first (as the engine orders them), then a chunk over a prefix and a fresh prompt: the prefix pass
    runs as two launches (the decodes' own, then the rest's), and every row is exact."""
    requests = ((30, 1), (45, 1), (20, 5), (0, 7))
    case = Case(name="decodes-first", q_heads=4, kv_heads=2, requests=requests, comm=comm, head_dim=16, seed=12,
                kernel_impl=kernels, tp=n if n > 1 else 1)
    world = World(case)

    def rank_fn(rank, exchange):
        state = RankState.create(case, world, n, rank)
        log = []
        attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=ThreadGroup(exchange, rank) if
                                   n > 1 else None, scale=world.scale, comm=comm, kernel_impl=kernels), log)
        q, k, v, batch, positions = state.step([new for _, new in requests])
        assert batch.num_decodes == 2
        out = torch.full(q.shape, float("nan"))
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        got = attn.group.all_gather(out, dim=1) if n > 1 else out
        heads = range(state.heads.group_q_head_start,
                      state.heads.group_q_head_start + state.heads.num_group_q_heads)
        want = torch.cat([world.causal_attention_f64(b, p, heads) for b, p in enumerate(positions)])
        assert_matches(got, want, torch.float32, f"N={n} {comm} {kernels}")
        return [name for name, *_ in log].count("prefix_attention")

    assert run_threads(n, rank_fn) == [2] * n


def test_decodes_first_keeps_the_decode_rows_when_both_launches_split():
    """With several KV splits the rest's merge runs over every row; the decodes' launch must come after it."""
    from dcp_plugin import kernels
    from dcp_plugin.step_plan import DecodesFirst

    case = Case(name="split-order", q_heads=4, kv_heads=2, requests=((40, 1), (33, 1), (25, 6)), head_dim=16,
                seed=13, tp=1)
    world = World(case)
    state = RankState.create(case, world, 1, 0)
    q, k, v, batch, positions = state.step([new for _, new in case.requests])
    kernels.write_kv_cache(k, v, state.key_cache, state.value_cache, batch.slot_mapping)
    lens, nd = batch.local_seq_lens - batch.query_lens, batch.num_decodes  # cached before this step
    out, lse = torch.full(q.shape, float("nan")), torch.full(q.shape[:2], float("nan"))
    head_map = dict(scale=world.scale, q_head_start=0, q_per_kv=2, kv_head_start=0, max_kv_len=40,
                    split_buffer=torch.empty(1 << 16), num_splits=3)
    tables = (batch.block_table, lens, batch.query_start_loc)
    decodes = tuple(t[:nd + (i == 2)] for i, t in enumerate(tables))
    rest = tuple(t[nd:] for t in tables)
    plan = DecodesFirst(
        decodes=kernels.plan_prefix(q[:nd], state.key_cache, state.value_cache, *decodes, out[:nd], lse[:nd],
                                    max_query_len=1, **head_map),
        rest=kernels.plan_prefix(q, state.key_cache, state.value_cache, *rest, out, lse, max_query_len=6, **head_map),
        num_decodes=nd, decode_tables=decodes, rest_tables=rest, rank_major=False)
    plan(q, state.key_cache, state.value_cache, *tables, out, lse)
    want_out, want_lse = kernels.reference.prefix_attention(
        q.double(), state.key_cache.double(), state.value_cache.double(), *tables, scale=world.scale,
        q_head_start=0, q_per_kv=2, kv_head_start=0, max_kv_len=40)
    assert_matches(out, want_out, torch.float32, "decodes-first out")
    assert_matches(lse, want_lse, torch.float32, "decodes-first lse")


def test_warm_up_builds_its_batches_as_engines_do(monkeypatch):
    """Into persistent per-request buffers: on a GPU the kernel deriving the lengths then compiles in the warm-up,
    not at a user's first step."""
    seen = []
    real = DcpBatch.build

    def build(**kwargs):
        seen.append(kwargs.get("buffers"))
        return real(**kwargs)

    monkeypatch.setattr(DcpBatch, "build", staticmethod(build))
    case = Case(name="warm", q_heads=2, kv_heads=1, head_dim=16, requests=((3, 1),), seed=9)
    state = RankState.create(case, World(case), 1, 0)
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=0.25, kernel_impl="reference")
    q, kv = torch.zeros(5, 2, 16), torch.zeros(5, 1, 16)
    warm_up(attn, query=q, key=kv, value=kv, key_cache=state.key_cache, value_cache=state.value_cache,
            output=torch.zeros(5, 2, 16))
    assert len(seen) == len(STEPS) and all(isinstance(b, DcpBatchBuffers) for b in seen)
