"""DcpAttention on one rank (no collectives), its input checks, and a forward that never reads device values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dcp_plugin import DcpAttention, DcpBatch, HeadLayout, ParallelState, TokenLayout, TorchDcpGroup
from dcp_plugin.testing import Case, RankState, ShapeOnlyGroup, World, attention_f64
from tests.helpers.dcp_harness import run_case
from tests.helpers.kernel_checks import assert_matches

SINGLE = dict(q_heads=6, kv_heads=2, requests=((0, 5), (9, 1), (14, 4), (1, 2)), block_size=4)


@pytest.mark.parametrize("decode_steps", [0, 5])
@pytest.mark.parametrize("interleave", [1, 2])
def test_single_rank_without_group(decode_steps, interleave):
    case = Case(name="single", interleave=interleave, decode_steps=decode_steps, seed=7, **SINGLE)
    assert run_case(case, 1, 0, None, lambda out: out) == decode_steps + 1


def test_single_rank_triton():
    case = Case(name="single-triton", kernel_impl="triton", head_dim=64, seed=8, **SINGLE)
    run_case(case, 1, 0, None, lambda out: out)


def test_single_rank_torch_group_of_one(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = TorchDcpGroup()
        for name in ("all_gather", "reduce_scatter", "all_to_all"):  # DCP size 1 issues no collective at all
            monkeypatch.setattr(group, name, None)
        for comm in ("ag_rs", "a2a"):
            run_case(Case(name=f"single-group-{comm}", comm=comm, seed=9, **SINGLE), 1, 0, group, lambda out: out)
    finally:
        dist.destroy_process_group()


def _setup(n: int = 2, rank: int = 0, **case_fields):
    case = Case(name="checks", q_heads=8, kv_heads=2, requests=((3, 2), (0, 1)), seed=3, **case_fields)
    state = RankState.create(case, World(case), n, rank)
    q, k, v, batch, _ = state.step([2, 1])
    return state, dict(q=q, k=k, v=v, key_cache=state.key_cache, value_cache=state.value_cache, batch=batch)


def _shape_ops(log: list):
    """Kernel plans that launch nothing: each records its name and the shapes it was prepared for."""
    def prepare(name):
        def plan(*tensors, **kwargs):
            shapes = tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))
            return lambda *args: log.append((name, shapes))
        return plan

    return SimpleNamespace(**{f"plan_{name}": prepare(name) for name in ("write_kv", "chunk", "prefix", "merge")},
                           split_capacity=lambda head_dim, device: 0)


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_forward_never_syncs(comm):
    # Every tensor on the meta device: an .item()/.tolist()/.cpu() in forward would raise.
    state, inputs = _setup(n=4, rank=2)
    meta = {name: t.to("meta") for name, t in inputs.items() if name != "batch"}
    host = inputs["batch"]
    batch = DcpBatch.build(
        **{name: getattr(host, name).to("meta") for name in
           ("query_start_loc", "seq_lens", "block_table", "slot_mapping")},
        tokens=state.tokens, max_query_len=host.max_query_len, max_seq_len=host.max_seq_len,
        max_context_len=host.max_context_len,
    )
    log = []
    attn = DcpAttention(heads=state.heads, tokens=state.tokens, group=ShapeOnlyGroup(4, 2), scale=0.25, comm=comm)
    attn._kernel_ops = _shape_ops(log)  # in place of the namespace DcpAttention chose by name
    out = attn.forward(**meta, batch=batch)
    assert out.device.type == "meta" and out.shape == meta["q"].shape
    launched = [name for name, _ in log]
    # The step has a cached prefix: current chunk, prefix pass, then the merge (two kernels for ag_rs).
    assert launched == ["write_kv", "chunk", "prefix"] + ["merge"] * (2 if comm == "ag_rs" else 1), launched
    log.clear()
    attn.forward(**meta, batch=batch)  # the next layer replays the step's plan: the same launches
    assert [name for name, _ in log] == launched


def _make(state, **overrides):
    args = dict(heads=state.heads, tokens=state.tokens, group=ShapeOnlyGroup(2, 0), scale=0.25, kernel_impl="reference")
    args.update(overrides)
    return DcpAttention(**args)


_CONSTRUCTION = {
    "heads type": (dict(heads="heads"), "heads must be a HeadLayout"),
    "tokens type": (dict(tokens=None), "tokens must be a TokenLayout"),
    "tokens other rank": (dict(tokens=TokenLayout(dcp_size=2, dcp_rank=1, block_size=4)),
                          r"DCP size 2 \(rank 1\) but the head layout runs at DCP size 2 \(rank 0\)"),
    "group missing": (dict(group=None), "group is None but dcp_size=2"),
    "group size": (dict(group=ShapeOnlyGroup(4, 0)), "group has world_size=4"),
    "group rank": (dict(group=ShapeOnlyGroup(2, 1)), "rank_in_group=1"),
    "scale zero": (dict(scale=0.0), "scale must be a finite float > 0"),
    "scale nan": (dict(scale=float("nan")), "scale must be a finite float > 0"),
    "scale bool": (dict(scale=True), "scale must be a finite float > 0"),
    "comm": (dict(comm="allreduce"), "comm must be 'ag_rs' or 'a2a'"),
    "kernels unknown": (dict(kernel_impl="cuda"), r"kernel_impl='cuda': use one of \['triton', 'reference'\]"),
}


@pytest.mark.parametrize("overrides, message", list(_CONSTRUCTION.values()), ids=list(_CONSTRUCTION))
def test_bad_construction_is_named(overrides, message):
    state, _ = _setup()
    with pytest.raises(ValueError, match=message):
        _make(state, **overrides)


def _other_batch(inputs):
    b = inputs["batch"]
    return DcpBatch.build(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_table=b.block_table,
                          slot_mapping=b.slot_mapping, tokens=TokenLayout(dcp_size=2, dcp_rank=0, block_size=8))


_FORWARD = {
    "q heads": (lambda i: dict(q=i["q"][:, :3]), "q has shape"),
    "q 2-D": (lambda i: dict(q=i["q"][:, 0]), "q must be a 3-D tensor"),
    "q float64": (lambda i: dict(q=i["q"].double()), "q has dtype torch.float64"),
    "k heads": (lambda i: dict(k=i["k"][:, :1]), "k has shape"),
    "v head dim": (lambda i: dict(v=i["v"][..., :8]), "v has shape"),
    "token count": (lambda i: dict(q=i["q"][:2], k=i["k"][:2], v=i["v"][:2]), r"num_tokens=3"),
    "cache kv heads": (lambda i: dict(key_cache=i["key_cache"][:, :, :1]), "key_cache has shape"),
    "cache block size": (lambda i: dict(key_cache=i["key_cache"][:, :2]), "key_cache has shape"),
    "value cache shape": (lambda i: dict(value_cache=i["value_cache"][:1]), "value_cache has shape"),
    "k dtype": (lambda i: dict(k=i["k"].half()), "k has dtype torch.float16 but q has"),
    "cache dtype": (lambda i: dict(value_cache=i["value_cache"].half()), "value_cache has dtype"),
    "cache device": (lambda i: dict(key_cache=i["key_cache"].to("meta")), "key_cache is on meta"),
    "out shape": (lambda i: dict(out=torch.empty(3, 4, 8)), "out has shape"),
    "out dtype": (lambda i: dict(out=torch.empty(3, 4, 16, dtype=torch.float16)), "out has dtype"),
    "batch type": (lambda i: dict(batch="batch"), "batch must be a DcpBatch"),
    "batch layout": (lambda i: dict(batch=_other_batch(i)), "batch was built for"),
}


@pytest.mark.parametrize("bad, message", list(_FORWARD.values()), ids=list(_FORWARD))
def test_bad_forward_input_is_named_before_any_work(bad, message):
    state, inputs = _setup()
    attn = _make(state)
    before = state.key_cache.clone(), state.value_cache.clone()
    with pytest.raises(ValueError, match=message):
        attn.forward(**{**inputs, **bad(inputs)})
    # Nothing was written: the check runs before the cache write.
    for cache, saved in zip((state.key_cache, state.value_cache), before):
        assert torch.equal(cache.nan_to_num(7.0), saved.nan_to_num(7.0))



@pytest.mark.parametrize("write_kv", [True, False])
def test_write_kv_false_leaves_the_cache_to_the_host(write_kv):
    """vLLM writes the cache in do_kv_cache_update; forward(write_kv=False) must not write it a second time."""
    heads = HeadLayout.create(total_q_heads=4, total_kv_heads=2, parallel=ParallelState.trivial())
    tokens = TokenLayout(block_size=16)
    q, k, v = (torch.randn(3, h, 64) for h in (4, 2, 2))
    key_cache, value_cache = (torch.full((2, 16, 2, 64), float("nan")) for _ in range(2))
    batch = DcpBatch.build(query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                           seq_lens=torch.tensor([3], dtype=torch.int32),
                           block_table=torch.tensor([[1]], dtype=torch.int32),
                           slot_mapping=torch.tensor([16, 17, 18]), tokens=tokens)
    attn = DcpAttention(heads=heads, tokens=tokens, group=None, scale=0.125, kernel_impl="reference")
    out = attn.forward(q, k, v, key_cache, value_cache, batch, write_kv=write_kv)
    # a fresh prompt reads only its own K/V (the NaN-filled cache never): causal float64 attention over them
    want = attention_f64(q, k, v, torch.ones(3, 3, dtype=torch.bool).tril(), scale=0.125, q_per_kv=2)
    assert_matches(out, want, torch.float32, "out")
    if write_kv:
        assert torch.equal(key_cache[1, :3], k) and torch.equal(value_cache[1, :3], v)
    else:
        assert torch.isnan(key_cache).all() and torch.isnan(value_cache).all()
