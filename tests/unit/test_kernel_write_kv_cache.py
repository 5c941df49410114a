"""write_kv_cache under the Triton interpreter vs the torch reference: an exact copy, skips, strided caches."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.write_kv_cache import write_kv_cache


def _caches(layout: str, num_blocks: int, block_size: int, num_heads: int, head_dim: int, dtype, gen):
    """K and V caches ``[num_blocks, block_size, H, D]`` as the views a host hands over, poisoned with NaN."""
    if layout == "nhd":
        shape = (num_blocks, block_size, num_heads, head_dim)
        return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    if layout == "kv_last_dim":  # one [num_blocks, block_size, H, 2 * D] buffer split on the last dim
        buf = torch.full((num_blocks, block_size, num_heads, 2 * head_dim), float("nan"), dtype=dtype)
        return buf[..., :head_dim], buf[..., head_dim:]
    if layout == "hnd":  # one [num_blocks, 2, H, block_size, D] buffer, heads before tokens
        buf = torch.full((num_blocks, 2, num_heads, block_size, head_dim), float("nan"), dtype=dtype)
        return buf[:, 0].permute(0, 2, 1, 3), buf[:, 1].permute(0, 2, 1, 3)
    raise AssertionError(layout)


FP32, FP16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64


@pytest.mark.parametrize(("layout", "block_size", "dtype", "cache_dtype", "index_dtype"), [
    ("nhd", 16, FP32, FP32, I64), ("nhd", 32, FP16, FP16, I32), ("nhd", 16, FP32, FP16, I32),
    ("kv_last_dim", 16, FP16, FP16, I64), ("kv_last_dim", 32, FP32, FP32, I32),
    ("hnd", 16, FP32, FP32, I32), ("hnd", 32, FP16, FP16, I64), ("hnd", 16, FP32, FP16, I64),
], ids=lambda v: str(v).replace("torch.", ""))
def test_matches_reference(layout, block_size, dtype, cache_dtype, index_dtype):
    gen = torch.Generator().manual_seed(block_size + len(layout))
    num_heads, head_dim, num_blocks = 3, 80, 5
    num_tokens, num_slots = 13, 11  # the last 2 rows of k/v are padding past slot_mapping
    qkv = torch.randn(num_tokens, 2 * num_heads + 1, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, :num_heads], qkv[:, num_heads + 1:]  # strided views, like slices of a fused projection
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    slots[torch.tensor([1, 4, 5, 10])] = -1  # tokens other ranks own
    slot_mapping = slots.to(index_dtype)

    key_cache, value_cache = _caches(layout, num_blocks, block_size, num_heads, head_dim, cache_dtype, gen)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slot_mapping)
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping)

    # Exact copy where written, NaN (untouched) everywhere else: skipped and padding rows wrote nothing.
    torch.testing.assert_close(key_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, want_v, rtol=0, atol=0, equal_nan=True)
    assert int((~torch.isnan(key_cache)).sum()) == 7 * num_heads * head_dim


def test_many_heads_split_over_programs():
    gen = torch.Generator().manual_seed(1)
    num_heads, head_dim = 40, 128  # 40 x 128 > one program's tile: heads split across programs
    k = torch.randn(4, num_heads, head_dim, generator=gen)
    v = torch.randn(4, num_heads, head_dim, generator=gen)
    key_cache, value_cache = _caches("nhd", 2, 16, num_heads, head_dim, torch.float32, gen)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor([31, 0, -1, 17])
    reference.write_kv_cache(k, v, want_k, want_v, slot_mapping)
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    torch.testing.assert_close(key_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_empty_slot_mapping_writes_nothing():
    k = torch.randn(3, 2, 64)
    key_cache, value_cache = _caches("nhd", 2, 16, 2, 64, torch.float32, None)
    write_kv_cache(k, k.clone(), key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    assert torch.isnan(key_cache).all() and torch.isnan(value_cache).all()


def _good():
    return dict(k=torch.randn(4, 2, 64), v=torch.randn(4, 2, 64), key_cache=torch.zeros(2, 16, 2, 64),
                value_cache=torch.zeros(2, 16, 2, 64), slot_mapping=torch.tensor([0, 1, -1, 5]))


@pytest.mark.parametrize(("change", "match"), [
    (dict(k=torch.randn(4, 128)), "k must have 3 dims"),
    (dict(v=torch.randn(4, 3, 64)), "v must have shape"),
    (dict(key_cache=torch.zeros(2, 16, 3, 64)), "key_cache must have shape"),
    (dict(value_cache=torch.zeros(2, 8, 2, 64)), "value_cache must have shape"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0])), "slot_mapping has dtype"),
    (dict(slot_mapping=torch.arange(5)), "at most one slot per row"),
    (dict(k=torch.randn(4, 2, 64, dtype=torch.float64)), "k has dtype"),
], ids=["k-dims", "v-shape", "cache-heads", "value-cache-shape", "slot-dtype", "too-many-slots", "k-float64"])
def test_rejects_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**{**_good(), **change})
