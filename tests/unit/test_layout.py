"""Head and token layouts: exhaustive properties, the seeds' cases, and the errors."""

import itertools

import pytest
import torch

from dcp_plugin import HeadLayout, ParallelState, TokenLayout
from dcp_plugin.layout import check_same_position


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def _valid_topologies():
    """Every (q heads <= 64, kv heads, tp <= 16, dcp | tp, layout) the layout model accepts or must reject."""
    for q_heads in range(1, 65):
        for kv_heads in _divisors(q_heads):
            for tp in _divisors(q_heads, 16):
                for dcp in _divisors(tp):
                    yield q_heads, kv_heads, tp, dcp


def _tp_layout_valid(kv_heads: int, tp: int, dcp: int) -> bool:
    """vLLM's KV placement (one replica set of tp/kv ranks per KV head, or kv/tp heads per rank) and, with DCP,
    every rank of a DCP group holding the same single KV head."""
    if tp >= kv_heads:
        return tp % kv_heads == 0 and (dcp == 1 or (tp // kv_heads) % dcp == 0)
    return kv_heads % tp == 0 and dcp == 1


def test_head_layout_exhaustive():
    checked = 0
    for q_heads, kv_heads, tp, dcp in _valid_topologies():
        q_per_kv = q_heads // kv_heads
        for kv_replication in ("tp", "replicated"):
            if kv_replication == "tp" and not _tp_layout_valid(kv_heads, tp, dcp):
                with pytest.raises(ValueError):
                    HeadLayout.create(total_q_heads=q_heads, total_kv_heads=kv_heads, kv_replication="tp",
                                      parallel=ParallelState.from_tp(tp_rank=0, tp_size=tp, dcp_size=dcp))
                continue
            owner_of_q = [None] * q_heads
            layouts = [
                HeadLayout.create(total_q_heads=q_heads, total_kv_heads=kv_heads, kv_replication=kv_replication,
                                  parallel=ParallelState.from_tp(tp_rank=r, tp_size=tp, dcp_size=dcp))
                for r in range(tp)
            ]
            for rank, h in enumerate(layouts):
                local = range(h.q_head_start, h.q_head_start + h.num_q_heads)
                for g in local:
                    assert owner_of_q[g] is None, "a Q head is local to two TP ranks"
                    owner_of_q[g] = rank
                # After the all-gather the group's Q heads are its ranks' local heads in rank order, and each
                # maps to global KV head g // q_per_kv through the stored heads.
                group = layouts[rank - h.dcp_rank: rank - h.dcp_rank + dcp]
                gathered = [g for peer in group for g in range(peer.q_head_start, peer.q_head_start + peer.num_q_heads)]
                assert gathered == list(range(h.group_q_head_start, h.group_q_head_start + h.num_group_q_heads))
                for g in gathered:
                    index = h.kv_index(g)
                    assert 0 <= index < h.num_kv_heads
                    assert h.kv_head_start + index == g // q_per_kv
                # Every rank of a DCP group stores the same KV heads.
                assert {(p.kv_head_start, p.num_kv_heads) for p in group} == {(h.kv_head_start, h.num_kv_heads)}
                needed = {g // q_per_kv - h.kv_head_start for g in local}
                assert set(range(*h.current_chunk_kv)) == needed
                if kv_replication == "tp":  # vLLM's QKVParallelLinear placement
                    expected = rank // (tp // kv_heads) if tp >= kv_heads else rank * (kv_heads // tp)
                    assert h.kv_head_start == expected
                checked += 1
            assert None not in owner_of_q, "a Q head is local to no TP rank"
    assert checked > 10_000  # the sweep really ran


def test_seeds_topology_tp4_dcp4_32q_2kv_group():
    layouts = [HeadLayout.create(total_q_heads=32, total_kv_heads=2, kv_replication="replicated",
                                 parallel=ParallelState.from_tp(tp_rank=r, tp_size=4, dcp_size=4)) for r in range(4)]
    for h in layouts:
        assert (h.kv_head_start, h.num_kv_heads) == (0, 2)
        assert (h.group_q_head_start, h.num_group_q_heads) == (0, 32)
    assert layouts[1].q_head_start == 8
    assert layouts[1].current_chunk_kv == (0, 1)  # rank 1's local Q heads 8..15 use KV head 0
    assert layouts[2].current_chunk_kv == (1, 2)
    assert layouts[3].current_chunk_kv == (1, 2)
    assert [layouts[1].kv_index(g) for g in range(8, 16)] == [0] * 8


def test_non_divisible_group_layout_12q_3kv():
    """12 Q / 3 KV heads, tp 2, dcp 2: rank 0's Q heads 0-5 need KV heads 0 AND 1 (the seed's formula gives 0)."""
    rank0, rank1 = (HeadLayout.create(total_q_heads=12, total_kv_heads=3, kv_replication="replicated",
                                      parallel=ParallelState.from_tp(tp_rank=r, tp_size=2, dcp_size=2)) for r in (0, 1))
    assert (rank0.kv_head_start, rank0.num_kv_heads) == (0, 3)
    assert rank0.current_chunk_kv == (0, 2)
    assert [rank0.kv_index(g) for g in range(6)] == [0, 0, 0, 0, 1, 1]
    assert rank1.current_chunk_kv == (1, 3)
    assert [rank1.kv_index(g) for g in range(6, 12)] == [1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total_q_heads=12, total_kv_heads=5), "not a multiple of total_kv_heads"),
        (dict(total_q_heads=12, total_kv_heads=3, tp=8), "not divisible by tp_size=8"),
        (dict(total_q_heads=32, total_kv_heads=2, tp=4, dcp=4, kv_replication="tp"), "kv_replication='replicated'"),
        (dict(total_q_heads=32, total_kv_heads=8, tp=2, dcp=2, kv_replication="tp"), "tp_size > total_kv_heads"),
        (dict(total_q_heads=32, total_kv_heads=8, tp=2, dcp=2), r"dcp_size in \[1\] here"),  # tp < kv: none
        (dict(total_q_heads=32, total_kv_heads=2, tp=4, dcp=4), r"dcp_size in \[1, 2\] here"),
        (dict(total_q_heads=24, total_kv_heads=4, tp=6), "multiple of total_kv_heads=4"),
        (dict(total_q_heads=8, total_kv_heads=2, kv_replication="mla"), r"one of \['tp', 'replicated'\]"),
        (dict(total_q_heads=0, total_kv_heads=1), "total_q_heads must be an int >= 1"),
    ],
)
def test_head_layout_errors(kwargs, match):
    tp, dcp = kwargs.pop("tp", 1), kwargs.pop("dcp", 1)
    kwargs.setdefault("kv_replication", "tp")
    with pytest.raises(ValueError, match=match):
        HeadLayout.create(parallel=ParallelState.from_tp(tp_rank=0, tp_size=tp, dcp_size=dcp), **kwargs)


def test_kv_index_refuses_heads_not_stored():
    h = HeadLayout.create(total_q_heads=32, total_kv_heads=8, kv_replication="tp",
                          parallel=ParallelState.from_tp(tp_rank=1, tp_size=8, dcp_size=1))
    assert h.kv_index(h.q_head_start) == 0
    with pytest.raises(ValueError, match="does not store"):
        h.kv_index(0)


def _vllm_local_len(seq_len: int, n: int, rank: int, interleave: int) -> int:
    """vLLM's get_dcp_local_seq_lens, written out independently."""
    base = seq_len // interleave // n * interleave
    rem = seq_len - base * n
    return base + min(max(rem - rank * interleave, 0), interleave)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("interleave", [1, 2, 4, 16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_token_layout_partitions_positions(n, interleave, block_size):
    layouts = [TokenLayout(dcp_size=n, dcp_rank=r, interleave=interleave, block_size=block_size) for r in range(n)]
    positions = torch.arange(300)
    owners = layouts[0].owner(positions)
    for r, t in enumerate(layouts):
        assert torch.equal(t.owner(positions), owners)  # the owner does not depend on who asks
        mine = positions[owners == r]
        # vLLM's slot rule: virtual block p // (B*N), offset inside the local page.
        v = mine % (block_size * n)
        assert torch.equal(t.local_offset(mine), (v // (n * interleave)) * interleave + v % interleave)
        assert torch.equal(t.virtual_block(mine), mine // (block_size * n))
        # Owned tokens are stored densely and in order.
        assert torch.equal(t.local_index(mine), torch.arange(len(mine)))
        assert torch.equal(t.global_position(torch.arange(len(mine))), mine)
        assert [t.local_index(int(p)) for p in mine[:20]] == list(range(min(20, len(mine))))
    for seq_len in range(300):
        lens = [t.local_len(seq_len) for t in layouts]
        assert sum(lens) == seq_len
        assert lens == [int((owners[:seq_len] == r).sum()) for r in range(n)]
        assert lens == [_vllm_local_len(seq_len, n, r, interleave) for r in range(n)]
        assert max(lens) <= layouts[0].max_local_len(seq_len)
    seq = torch.arange(300)
    for r, t in enumerate(layouts):
        assert t.local_len(seq).tolist() == [_vllm_local_len(s, n, r, interleave) for s in range(300)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dcp_size=2, dcp_rank=2), r"dcp_rank must be in \[0, 1\]"),
        (dict(dcp_size=0), "dcp_size must be an int >= 1"),
        (dict(interleave=3, block_size=16), "interleave=3 must divide block_size=16"),
        (dict(block_size=0), "block_size must be an int >= 1"),
    ],
)
def test_token_layout_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenLayout(**kwargs)


def test_token_layout_example_from_docstring():
    t = TokenLayout(dcp_size=4, dcp_rank=1, interleave=1, block_size=16)
    assert [p for p in range(12) if t.owner(p) == 1] == [1, 5, 9]
    assert t.local_len(10) == 3


def test_interleave_equal_to_block_size_deals_whole_pages():
    t = TokenLayout(dcp_size=2, dcp_rank=1, interleave=16, block_size=16)
    assert [t.owner(p) for p in itertools.chain(range(0, 16), range(16, 32))] == [0] * 16 + [1] * 16
    assert t.local_index(16) == 0 and t.local_index(48) == 16


def test_token_layout_takes_its_dcp_position_from_the_parallel_state():
    parallel = ParallelState.from_tp(tp_rank=5, tp_size=8, dcp_size=4)
    tokens = TokenLayout.create(parallel=parallel, interleave=2, block_size=16)
    assert tokens == TokenLayout(dcp_size=4, dcp_rank=1, interleave=2, block_size=16)
    heads = HeadLayout.create(total_q_heads=32, total_kv_heads=2, parallel=parallel, kv_replication="replicated")
    check_same_position(heads, tokens)  # one source, so they agree
    with pytest.raises(ValueError, match="sharded over DCP size 1 .* runs at DCP size 4 .*; a draft"):
        check_same_position(heads, TokenLayout(), hint="; a draft")
