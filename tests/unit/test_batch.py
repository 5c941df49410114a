"""DcpBatch: what it derives once per step, and what it refuses; TorchDcpGroup with one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcp_plugin import DcpBatch, DcpBatchBuffers, TokenLayout, TorchDcpGroup


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _owned_count(length: int, tokens: TokenLayout, rank: int) -> int:
    """Brute force: positions p < length with owner (p // I) % N == rank."""
    return sum((p // tokens.interleave) % tokens.dcp_size == rank for p in range(length))


def _args(**overrides):
    args = dict(
        query_start_loc=_i32([0, 3, 4, 9]),
        seq_lens=_i32([3, 20, 14]),
        block_table=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.full((9,), -1, dtype=torch.int64),
        tokens=TokenLayout(dcp_size=3, dcp_rank=1, interleave=2, block_size=4),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_derived_lengths(rank):
    tokens = TokenLayout(dcp_size=3, dcp_rank=rank, interleave=2, block_size=4)
    batch = DcpBatch.build(**_args(tokens=tokens))
    assert batch.query_lens.tolist() == [3, 1, 5]
    assert batch.context_lens.tolist() == [0, 19, 9]
    assert batch.local_context_lens.tolist() == [_owned_count(c, tokens, rank) for c in (0, 19, 9)]
    assert batch.local_context_lens.dtype == torch.int32
    assert (batch.num_reqs, batch.num_tokens) == (3, 9)
    assert (batch.max_query_len, batch.max_seq_len, batch.max_context_len) == (5, 20, 19)
    # Rank-invariant: ceil(19 / (3 * 2)) * 2 on every rank, a bound no rank's local context exceeds.
    assert batch.max_local_context_len == 8
    assert max(_owned_count(19, tokens, r) for r in range(3)) <= 8


def test_host_ints_are_used_as_given():
    batch = DcpBatch.build(**_args(max_query_len=7, max_seq_len=30, max_context_len=25))
    assert (batch.max_query_len, batch.max_seq_len, batch.max_context_len) == (7, 30, 25)
    assert batch.max_local_context_len == 10  # ceil(25 / (3 * 2)) * 2


def test_no_context_anywhere_is_rank_invariant_zero():
    batch = DcpBatch.build(**_args(seq_lens=_i32([3, 1, 5])))
    assert batch.max_context_len == 0 and batch.max_local_context_len == 0


def test_empty_batch():
    batch = DcpBatch.build(**_args(query_start_loc=_i32([0]), seq_lens=_i32([]),
                                   block_table=torch.zeros(0, 1, dtype=torch.int32),
                                   slot_mapping=torch.zeros(0, dtype=torch.int64)))
    assert (batch.num_reqs, batch.num_tokens, batch.max_context_len) == (0, 0, 0)


def test_device_tensors_with_host_ints_are_never_read():
    # Meta tensors have no values: any host sync in build would raise.
    meta = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in _args().items()}
    batch = DcpBatch.build(**meta, max_query_len=5, max_seq_len=20, max_context_len=19)
    assert batch.local_context_lens.device.type == "meta" and batch.max_local_context_len == 8


def test_buffers_keep_addresses_and_refresh_values():
    # A CUDA graph replays the addresses it captured: every build into the same buffers must write the same storage,
    # with this step's values, equal to a build without buffers.
    buffers = DcpBatchBuffers(8, "cpu")
    first = DcpBatch.build(**_args(), buffers=buffers)
    pointers = {name: getattr(first, name).data_ptr() for name in DcpBatchBuffers.NAMES}
    # The next step: other lengths, same request count.
    step = _args(query_start_loc=_i32([0, 1, 2, 3]), seq_lens=_i32([7, 21, 2]),
                 slot_mapping=torch.full((3,), -1, dtype=torch.int64))
    second = DcpBatch.build(**step, buffers=buffers)
    plain = DcpBatch.build(**step)
    for name in DcpBatchBuffers.NAMES:
        assert getattr(second, name).data_ptr() == pointers[name], name
        assert getattr(second, name).tolist() == getattr(plain, name).tolist(), name
    assert second.local_seq_lens.tolist() == [_owned_count(n, plain.tokens, 1) for n in (7, 21, 2)]


def test_buffers_serve_batch_sizes_in_any_order():
    # Views of the buffers are kept per batch size: a size seen before, after another, still gets its own length
    # and this step's values.
    buffers = DcpBatchBuffers(8, "cpu")
    two = _args(query_start_loc=_i32([0, 1, 2]), seq_lens=_i32([9, 30]),
                block_table=torch.zeros(2, 4, dtype=torch.int32), slot_mapping=torch.full((2,), -1, dtype=torch.int64))
    steps = [_args(), two, _args(query_start_loc=_i32([0, 1, 2, 3]), seq_lens=_i32([7, 21, 2]),
                                 slot_mapping=torch.full((3,), -1, dtype=torch.int64))]
    for step in steps:
        built, plain = DcpBatch.build(**step, buffers=buffers), DcpBatch.build(**step)
        for name in DcpBatchBuffers.NAMES:
            assert getattr(built, name).tolist() == getattr(plain, name).tolist(), name
    derived = buffers.derive(steps[0]["query_start_loc"], steps[0]["seq_lens"], steps[0]["tokens"], 3)
    derived.clear()  # the caller's own dict
    assert len(buffers.derive(steps[0]["query_start_loc"], steps[0]["seq_lens"], steps[0]["tokens"], 3)) == 4


def test_buffers_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="the batch has 3 requests but the buffers hold max_num_reqs=2"):
        DcpBatch.build(**_args(), buffers=DcpBatchBuffers(2, "cpu"))
    with pytest.raises(ValueError, match="the buffers are on meta"):
        DcpBatch.build(**_args(), buffers=DcpBatchBuffers(4, "meta"))
    with pytest.raises(ValueError, match="max_num_reqs must be an int >= 1"):
        DcpBatchBuffers(0, "cpu")


_BAD = {
    "tokens not a layout": (dict(tokens=object()), "tokens must be a TokenLayout"),
    "query_start_loc int64": (dict(query_start_loc=torch.tensor([0, 3, 4, 9])), "query_start_loc has dtype"),
    "query_start_loc empty": (dict(query_start_loc=_i32([])), "query_start_loc must have num_reqs"),
    "seq_lens wrong length": (dict(seq_lens=_i32([3, 20])), "seq_lens has 2 entries"),
    "seq_lens 2-D": (dict(seq_lens=_i32([[3, 20, 14]])), "seq_lens must have 1 dim"),
    "block_table int64": (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "block_table has dtype"),
    "block_table 1-D": (dict(block_table=_i32([0, 1, 2])), "block_table must have 2 dims"),
    "block_table rows": (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "block_table has 2 rows"),
    "block_table narrow": (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), "needs 2 pages"),
    "slot_mapping float": (dict(slot_mapping=torch.zeros(9)), "slot_mapping has dtype"),
    "slot_mapping length": (dict(slot_mapping=torch.zeros(8, dtype=torch.int64)), "slot_mapping has 8 entries"),
    "seq_lens below query": (dict(seq_lens=_i32([2, 20, 14])), "seq_lens must be >= the query lengths"),
    "query_start_loc offset": (dict(query_start_loc=_i32([1, 3, 4, 9])), "must start at 0"),
    "query_start_loc decreasing": (dict(query_start_loc=_i32([0, 4, 3, 9])), "non-decreasing"),
    "device mismatch": (dict(seq_lens=_i32([3, 20, 14]).to("meta")), "seq_lens is on meta"),
    "max_query_len negative": (dict(max_query_len=-1), "max_query_len must be a host int"),
    "max_seq_len tensor": (dict(max_seq_len=torch.tensor(20)), "max_seq_len must be a host int"),
    "max_context_len too small": (dict(max_context_len=18), "max_context_len=18 is smaller"),
}


@pytest.mark.parametrize("overrides, message", list(_BAD.values()), ids=list(_BAD))
def test_bad_input_is_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        DcpBatch.build(**_args(**overrides))


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_torch_group_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        TorchDcpGroup()


def test_torch_group_of_one_communicates_nothing(world_of_one, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a group of one must not call a collective")

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                 "all_to_all_single"):
        monkeypatch.setattr(dist, name, forbidden, raising=False)
    group = TorchDcpGroup()
    assert (group.world_size, group.rank_in_group) == (1, 0)
    t = torch.randn(3, 4, 5)
    assert torch.equal(group.all_gather(t, dim=1), t)
    assert torch.equal(group.reduce_scatter(t, dim=2), t)
    assert torch.equal(group.all_to_all(t), t)
