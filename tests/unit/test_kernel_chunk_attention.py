"""chunk_attention (the DCP current chunk) under the Triton interpreter vs the float64 torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.chunk_attention import ChunkConfig, chunk_attention, plan_chunk
from tests.helpers.kernel_checks import assert_matches, poisoned


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _check(lengths, *, num_q_heads, num_kv_heads, q_head_start, q_per_kv, kv_head_start, head_dim=64,
           dtype=torch.float32, out_dtype=None, num_tokens=None, seed=0, config=None):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths) if num_tokens is None else num_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    cu = _cu(lengths)
    heads = dict(q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=kv_head_start)
    out = poisoned(q.shape, out_dtype or dtype)
    lse = poisoned(q.shape[:2], torch.float32)
    got_out, got_lse = chunk_attention(q, k, v, cu, max(lengths, default=0), scale=head_dim**-0.5, out=out, lse=lse,
                                       config=config, **heads)
    assert got_out is out and got_lse is lse
    want_out, want_lse = reference.chunk_attention(q.double(), k.double(), v.double(), cu, max(lengths, default=0),
                                                   scale=head_dim**-0.5, **heads)
    assert_matches(out, want_out, dtype if out_dtype is None else min_precision(dtype, out_dtype), "out")
    assert_matches(lse, want_lse, dtype, "lse")


def min_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lengths", [[1], [7], [63], [5, 0, 17, 1], [0, 40]],
                         ids=["len1", "len7", "len63", "mixed_with_empty", "empty_first"])
def test_lengths(lengths, dtype):
    _check(lengths, num_q_heads=3, num_kv_heads=1, q_head_start=0, q_per_kv=3, kv_head_start=0, dtype=dtype)


# (local Q heads, stored KV heads, q_head_start, q_per_kv, kv_head_start)
HEAD_MAPS = {
    "gqa1:1": (2, 2, 0, 1, 0),
    "gqa3:1": (6, 2, 0, 3, 0),
    "gqa5:1": (5, 1, 0, 5, 0),
    "gqa8:1": (8, 2, 8, 8, 1),  # Q heads 8..15 of a 32 Q / 4 KV model, k holding KV heads 1..2
    "mqa": (4, 1, 4, 16, 0),  # Q heads 4..7 of 16, one KV head
    "dcp_rank1_32q_2kv": (8, 2, 8, 16, 0),  # local Q heads 8..15, k holds every KV head
    "dcp_rank0_12q_3kv": (6, 3, 0, 4, 0),  # Q heads 0..5 need KV heads 0 AND 1
    "dcp_rank1_12q_3kv_offset": (6, 2, 6, 4, 1),  # Q heads 6..11 need KV heads 1, 2; k holds 1..2
}


@pytest.mark.parametrize("head_map", HEAD_MAPS.values(), ids=HEAD_MAPS.keys())
def test_head_maps(head_map):
    hq, hk, q_start, ratio, kv_start = head_map
    _check([3, 18], num_q_heads=hq, num_kv_heads=hk, q_head_start=q_start, q_per_kv=ratio, kv_head_start=kv_start)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_head_dims(head_dim):
    _check([3, 18], num_q_heads=2, num_kv_heads=1, q_head_start=0, q_per_kv=2, kv_head_start=0, head_dim=head_dim,
           dtype=torch.float16)


def test_padding_rows_past_last_sequence_get_zero_and_minus_inf():
    _check([5, 12], num_q_heads=2, num_kv_heads=2, q_head_start=0, q_per_kv=1, kv_head_start=0, num_tokens=40)


def test_larger_tiles_and_fp32_out_from_fp16():
    _check([70, 33], num_q_heads=1, num_kv_heads=1, q_head_start=0, q_per_kv=1, kv_head_start=0,
           dtype=torch.float16, out_dtype=torch.float32)


def test_strided_views_of_packed_buffers():
    num_tokens, hq, hk, d = 30, 4, 2, 80
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, hq + 2 * hk, d + 16, generator=gen)  # padded rows: no dim is contiguous
    q, k, v = qkv[:, :hq, :d], qkv[:, hq:hq + hk, :d], qkv[:, hq + hk:, 8:8 + d]
    out_buf = poisoned((hq, num_tokens, d), torch.float16)
    lse_buf = poisoned((hq, 2 * num_tokens), torch.float32)
    out, lse = out_buf.transpose(0, 1), lse_buf[:, ::2].t()
    cu = _cu([11, 19])
    chunk_attention(q, k, v, cu, 19, scale=0.1, q_head_start=0, q_per_kv=2, kv_head_start=0, out=out, lse=lse)
    want_out, want_lse = reference.chunk_attention(q.double(), k.double(), v.double(), cu, 19, scale=0.1,
                                                   q_head_start=0, q_per_kv=2, kv_head_start=0)
    assert_matches(out, want_out, torch.float16, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")
    assert torch.isnan(lse_buf[:, 1::2]).all(), "wrote outside the lse view"


def test_config_override():
    q = torch.randn(20, 1, 64)
    cu = _cu([20])
    out, lse = chunk_attention(q, q, q, cu, 20, scale=0.125, q_head_start=0, q_per_kv=1, kv_head_start=0,
                               config=ChunkConfig(block_m=32, block_n=16, num_warps=1, num_stages=1))
    want_out, want_lse = reference.chunk_attention(q.double(), q.double(), q.double(), cu, 20, scale=0.125,
                                                   q_head_start=0, q_per_kv=1, kv_head_start=0)
    assert_matches(out, want_out, torch.float32, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")


def _args(**overrides):
    args = dict(q=torch.randn(6, 4, 64), k=torch.randn(6, 2, 64), v=torch.randn(6, 2, 64), query_start_loc=_cu([6]),
                max_query_len=6, scale=0.125, q_head_start=0, q_per_kv=2, kv_head_start=0)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, match", [
    (dict(q_head_start=2), "head mapping out of range"),
    (dict(kv_head_start=1), "head mapping out of range"),
    (dict(q_per_kv=0), "q_per_kv"),
    (dict(k=torch.randn(6, 2, 80)), "k must have shape"),
    (dict(v=torch.randn(5, 2, 64)), "v must have shape"),
    (dict(k=torch.randn(6, 2, 64, dtype=torch.float16)), "k has dtype"),
    (dict(q=torch.randn(6, 4, 48), k=torch.randn(6, 2, 48), v=torch.randn(6, 2, 48)), "head dim 48"),
    (dict(query_start_loc=torch.tensor([0.0, 6.0])), "query_start_loc has dtype"),
    (dict(max_query_len=-1), "max_query_len"),
    (dict(max_query_len=6.0), "max_query_len"),
    (dict(scale=0.0), "scale"),
    (dict(lse=torch.empty(6, 4, dtype=torch.float16)), "lse has dtype"),
    (dict(out=torch.empty(6, 3, 64)), "out must have shape"),
    (dict(config=ChunkConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)), "block_m is a multiple"),
], ids=["q_head_start", "kv_head_start", "q_per_kv", "k_dim", "v_tokens", "k_dtype", "head_dim", "qsl_dtype",
        "max_query_len_negative", "max_query_len_float", "scale", "lse_dtype", "out_shape", "config"])
def test_bad_input_raises(overrides, match):
    args = _args(**overrides)
    with pytest.raises(ValueError, match=match):
        chunk_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("query_start_loc"),
                        args.pop("max_query_len"),
                        **args)


def test_mixed_step_grid_is_about_one_program_per_row():
    """Sixty one-token rows and one 70-token chunk: about one program per row plus the chunk's blocks (not
    sequences x blocks of the longest), and every row exact."""
    from dcp_plugin.kernels.chunk_attention import plan_chunk

    lengths = [1] * 60 + [70]
    _check(lengths, num_q_heads=4, num_kv_heads=2, q_head_start=0, q_per_kv=2, kv_head_start=0, seed=5)
    q = torch.zeros(sum(lengths), 4, 64)
    kv = torch.zeros(sum(lengths), 2, 64)
    plan = plan_chunk(q, kv, kv, q, torch.zeros(q.shape[:2]), _cu(lengths), 70, scale=0.1, q_head_start=0,
                      q_per_kv=2, kv_head_start=0)
    block_m, num_tokens = plan.constexprs["BLOCK_M"], sum(lengths)
    assert plan.grid[0] == num_tokens // block_m + len(lengths) + 1  # + 1: the one program of padding rows
    assert plan.grid[0] * 3 < len(lengths) * -(-70 // block_m)


# The Hopper selection (K/V through tensor descriptors) and the portable one, both under the interpreter.
TMA = ChunkConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, tma=True)


@pytest.mark.parametrize("lengths", [[1], [5, 0, 17, 1], [63, 40]], ids=["len1", "mixed_with_empty", "two_long"])
@pytest.mark.parametrize("head_map", [HEAD_MAPS["gqa3:1"], HEAD_MAPS["dcp_rank1_12q_3kv_offset"]], ids=["gqa3", "off"])
def test_tensor_descriptor_path(lengths, head_map):
    hq, hk, q_start, ratio, kv_start = head_map
    _check(lengths, num_q_heads=hq, num_kv_heads=hk, q_head_start=q_start, q_per_kv=ratio, kv_head_start=kv_start,
           dtype=torch.float16, num_tokens=sum(lengths) + 3, config=TMA)


def _use_tma(k: torch.Tensor, config: ChunkConfig) -> bool:
    q = torch.randn(k.shape[0], 2, k.shape[2])
    cu = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    launch = plan_chunk(q, k, k, torch.empty_like(q), torch.empty(q.shape[:2]), cu, k.shape[0], scale=0.125,
                        q_head_start=0, q_per_kv=2, kv_head_start=0, config=config)
    return launch.constexprs["USE_TMA"] and launch.scratch


def test_tensor_descriptors_only_where_the_tensors_allow_them():
    k = torch.randn(9, 1, 64)
    assert _use_tma(k, TMA)
    assert not _use_tma(k, dataclasses.replace(TMA, tma=False))
    assert not _use_tma(torch.randn(9, 64, 1).transpose(1, 2), TMA), "stride along D is not 1"
    assert not _use_tma(torch.randn(9 * 64 + 1)[1:].view(9, 1, 64), TMA), "base not 16-byte aligned"
    assert not _use_tma(torch.randn(9, 1, 80), TMA), "head dim not a power of two"


def tree_masks(num_reqs: int, size: int, *, generator: torch.Generator) -> torch.Tensor:
    """``[num_reqs, size, size]`` bool: per request a random tree over ``size`` nodes, node 0 its root and each other
    node's parent an earlier node (a speculative verify step's draft tree); node ``i`` sees its ancestors and itself."""
    masks = torch.zeros(num_reqs, size, size, dtype=torch.bool)
    for b in range(num_reqs):
        for i in range(size):
            masks[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=generator))
                masks[b, i] |= masks[b, parent]
    return masks


def _check_masked(lengths, mask, *, num_q_heads=4, num_kv_heads=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, d = sum(lengths), 64
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (num_q_heads, num_kv_heads, num_kv_heads))
    cu = _cu(lengths)
    heads = dict(q_head_start=0, q_per_kv=num_q_heads // num_kv_heads, kv_head_start=0)
    out, lse = poisoned(q.shape, dtype), poisoned(q.shape[:2], torch.float32)
    chunk_attention(q, k, v, cu, max(lengths), scale=d**-0.5, out=out, lse=lse, chunk_mask=mask, **heads)
    want_out, want_lse = reference.chunk_attention(q.double(), k.double(), v.double(), cu, max(lengths),
                                                   scale=d**-0.5, chunk_mask=mask, **heads)
    assert_matches(out, want_out, dtype, "out")
    assert_matches(lse, want_lse, dtype, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lengths", [[5, 5, 5], [3, 8, 1], [40]], ids=["uniform5", "ragged", "three_key_blocks"])
def test_tree_masks(lengths, dtype):
    """A verify step's draft trees (a token sees its ancestors): the mask, wider than any request, replaces the causal
    one; 40 rows span three of the interpreter's 16-key blocks."""
    size = max(lengths) + 2
    mask = tree_masks(len(lengths), size, generator=torch.Generator().manual_seed(len(lengths)))
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    assert all(not torch.equal(m[:n, :n], causal[:n, :n]) for m, n in zip(mask, lengths) if n > 2)  # real trees
    _check_masked(lengths, mask, dtype=dtype)


def test_a_mask_decides_alone_rows_that_see_nothing_get_zero_and_minus_inf():
    """A mask may show a row keys after it (it is not intersected with causality), keys only in a later block than
    its first, or no key at all: (0, -inf), the empty set's convention, with no NaN."""
    lengths = [40, 3]
    mask = torch.zeros(2, 40, 40, dtype=torch.bool)
    mask[0, 35, [20, 39]] = True  # nothing in keys 0-15: the first block is empty for this row
    mask[0, 2, 30] = True  # a key after the row
    mask[0, 10] = True  # every key
    mask[1, 1, :3] = True  # request 1: rows 0 and 2 see nothing
    out, lse = _check_masked(lengths, mask)
    for row in (0, 1, 3, 40, 42):
        assert torch.equal(out[row], torch.zeros_like(out[row])) and torch.isneginf(lse[row]).all()
    assert torch.isfinite(lse[35]).all() and torch.isfinite(lse[2]).all()
