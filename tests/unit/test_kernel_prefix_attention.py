"""prefix_attention (the DCP prefix / decode pass) under the Triton interpreter vs the float64 torch reference."""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

import pytest
import torch
import triton

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.prefix_attention import PrefixConfig, prefix_attention, plan_prefix
from tests.helpers.kernel_checks import assert_matches, poisoned


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: list[int]
    kv_lens: list[int]
    num_q_heads: int
    num_kv_heads: int  # stored in the cache
    q_per_kv: int
    q_head_start: int = 0
    kv_head_start: int = 0
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    layout: str = "nhd"  # nhd | kv_last_dim (vLLM's [.., H, 2 * D] split) | hnd (heads before tokens)
    max_query_len: str = "exact"  # exact | none (in-kernel request search)
    num_splits: int | None = None
    pad_rows: int = 0  # query rows past query_start_loc[-1] (CUDA-graph padding)
    out_dtype: torch.dtype | None = None
    config: PrefixConfig | None = None


CASES = {
    "mha-decode-ctx0-1-7-63": Case([1, 1, 1, 1], [0, 1, 7, 63], 4, 4, 1),
    "mha-decode-tile-spans-pages": Case([1, 1], [63, 33], 2, 2, 1,
                                        config=PrefixConfig(block_n=64, block_m=16, num_warps=4, num_stages=1)),
    "gqa3-mixed-search-fp16-d80-kvsplit-padded": Case([1, 11, 1, 3], [63, 7, 0, 20], 6, 2, 3, head_dim=80,
                                                      dtype=torch.float16, layout="kv_last_dim", max_query_len="none",
                                                      pad_rows=2),
    "gqa5-prefix-hnd-bs32-tile16": Case([4, 1, 9], [33, 1, 70], 10, 2, 5, block_size=32, layout="hnd",
                                        config=PrefixConfig(block_n=16, block_m=32, num_warps=4, num_stages=1)),
    "gqa8-decode-3splits-fp16-d128-outfp32": Case([1, 1, 1], [63, 100, 0], 16, 2, 8, head_dim=128,
                                                  dtype=torch.float16, num_splits=3, out_dtype=torch.float32),
    "mqa-mixed-2splits-search-padded": Case([2, 1, 3], [7, 50, 0], 8, 1, 8, layout="kv_last_dim",
                                            max_query_len="none", num_splits=2, pad_rows=1),
    "group48of2-two-tiles-per-group-fp16": Case([1, 2], [40, 17], 48, 2, 24, dtype=torch.float16,
                                                config=PrefixConfig(block_n=16, block_m=16, num_warps=4,
                                                                    num_stages=1)),
    "group48of2-default-2splits": Case([1, 2], [40, 17], 48, 2, 24, max_query_len="none", num_splits=2),
    "dcp-gathered-q8-15-of-32q2kv": Case([1, 3], [63, 7], 8, 2, 16, q_head_start=8),
    "dcp-12q3kv-rank1-mid-group-hnd": Case([1, 1, 2], [1, 63, 7], 6, 2, 4, q_head_start=6, kv_head_start=1,
                                           layout="hnd"),
    "dcp-q8-15-of-32q8kv-first-kv2": Case([1, 2], [30, 9], 8, 8, 4, q_head_start=8),
    "dcp-12q3kv-rank0-two-groups-2splits-fp16": Case([2, 1], [20, 45], 6, 3, 4, dtype=torch.float16,
                                                     num_splits=2),
    "all-empty-contexts-3splits": Case([1, 2], [0, 0], 4, 2, 2, num_splits=3),
    # More splits than the split merge takes per step (8): three steps, the running maximum rescaled, empty splits.
    "gqa4-decode-19splits-three-merge-steps": Case([1, 1, 1], [700, 33, 0], 8, 2, 4, num_splits=19),
    # The Hopper selection (whole tiles of one page through tensor descriptors), emulated by the interpreter: the
    # NaN rows past each context inside its last page must add nothing; every cache layout; splits; the search.
    "tma-gqa4-mixed-kv-last-dim-bs32-tile16-fp16": Case([1, 5, 1, 2], [33, 70, 16, 0], 8, 2, 4, block_size=32,
                                                        dtype=torch.float16, layout="kv_last_dim",
                                                        config=PrefixConfig(16, 32, 4, 1, tma=True)),
    "tma-gqa5-prefix-hnd-tile-is-page-2splits": Case([4, 1, 9], [33, 1, 70], 10, 2, 5, layout="hnd", num_splits=2,
                                                     max_query_len="none",
                                                     config=PrefixConfig(16, 32, 4, 1, tma=True)),
    # Descriptor rows read TMA_CHUNK (32) tiles ahead: 69 and 44 tiles, two splits, so chunks start mid-request and
    # the last chunk of each split is partial; decode (the Hopper default) and the prefix pass.
    "tma-gqa4-decode-rows-ahead-chunks-2splits-fp16": Case(
        [1, 1], [1100, 700], 8, 2, 4, dtype=torch.float16, num_splits=2,
        config=PrefixConfig(16, 16, 4, 1, tma=True, rows_ahead=True)),
    # ... and over pages that hold several tiles (the rows' offsets inside a page), with padding rows.
    "tma-gqa4-mixed-rows-ahead-bs64-tile16-3splits": Case([1, 3, 1], [2100, 900, 17], 8, 2, 4, block_size=64,
                                                          layout="kv_last_dim", num_splits=3, pad_rows=2,
                                                          config=PrefixConfig(16, 32, 4, 1, tma=True, rows_ahead=True)),
    "tma-gqa4-decode-rows-ahead-bs32-tile16-5splits": Case(
        [1, 1, 1], [2100, 900, 17], 8, 2, 4, block_size=32, num_splits=5,
        config=PrefixConfig(16, 16, 4, 1, tma=True, rows_ahead=True)),
    "tma-gqa5-prefix-rows-ahead-chunks-hnd": Case([4, 1, 9], [1100, 1, 700], 10, 2, 5, layout="hnd", num_splits=2,
                                                  max_query_len="none",
                                                  config=PrefixConfig(16, 32, 4, 1, tma=True, rows_ahead=True)),
    # Tiles padded with Q heads past the group (min_rows: 64 rows give warpgroup MMAs on sm_90): their rows masked.
    "gqa4-decode-rows-padded-to-64-2splits-fp16": Case([1, 1, 1], [63, 100, 0], 8, 2, 4, dtype=torch.float16,
                                                       num_splits=2, config=PrefixConfig(16, 64, 4, 1, min_rows=64)),
    "tma-dcp-12q3kv-rank1-decode-rows-padded-to-32": Case([1, 1, 1], [1, 63, 130], 6, 2, 4, q_head_start=6,
                                                          kv_head_start=1, block_size=64, head_dim=128,
                                                          config=PrefixConfig(32, 32, 4, 1, tma=True, min_rows=32)),
    "tma-dcp-12q3kv-rank1-decode-nhd-bs64-tile32": Case([1, 1, 1], [1, 63, 130], 6, 2, 4, q_head_start=6,
                                                        kv_head_start=1, block_size=64, head_dim=128,
                                                        config=PrefixConfig(32, 16, 4, 1, tma=True)),
}


def _caches(case: Case, num_blocks: int):
    """K/V caches ``[num_blocks, block_size, Hk, D]`` as the views a host hands over, NaN everywhere at first."""
    shape_nhd = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    if case.layout == "nhd":
        return (torch.full(shape_nhd, float("nan"), dtype=case.dtype),
                torch.full(shape_nhd, float("nan"), dtype=case.dtype))
    if case.layout == "kv_last_dim":
        buf = torch.full((*shape_nhd[:3], 2 * case.head_dim), float("nan"), dtype=case.dtype)
        return buf[..., :case.head_dim], buf[..., case.head_dim:]
    buf = torch.full((num_blocks, 2, case.num_kv_heads, case.block_size, case.head_dim), float("nan"),
                     dtype=case.dtype)
    return buf[:, 0].permute(0, 2, 1, 3), buf[:, 1].permute(0, 2, 1, 3)


def _inputs(case: Case, seed: int = 0):
    """Random Q and a paged cache holding random K/V exactly at each request's cached tokens, NaN elsewhere (a
    kernel that reads past a context, or a block-table entry past it, turns its output NaN)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(case.q_lens) + case.pad_rows
    # q is a strided view (a slice of a wider buffer), as after a fused projection.
    q = torch.randn(num_tokens, case.num_q_heads + 1, case.head_dim, generator=gen).to(case.dtype)[:, 1:]
    pages_per_req = [triton.cdiv(c, case.block_size) for c in case.kv_lens]
    nan_page = sum(pages_per_req)
    order = torch.randperm(nan_page, generator=gen).tolist()
    width = max(pages_per_req, default=0) + 1
    block_table = torch.full((len(case.kv_lens) + 1, width), nan_page, dtype=torch.int32)
    key_cache, value_cache = _caches(case, nan_page + 1)
    for b, ctx in enumerate(case.kv_lens):
        pages = torch.tensor([order.pop() for _ in range(pages_per_req[b])], dtype=torch.int32)
        block_table[b, :len(pages)] = pages
        pos = torch.arange(ctx)
        rows = (case.num_kv_heads, case.head_dim)
        key_cache[pages[pos // case.block_size].long(), pos % case.block_size] = \
            torch.randn(ctx, *rows, generator=gen).to(case.dtype)
        value_cache[pages[pos // case.block_size].long(), pos % case.block_size] = \
            torch.randn(ctx, *rows, generator=gen).to(case.dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_lens = torch.tensor(case.kv_lens, dtype=torch.int32)
    return q, key_cache, value_cache, block_table, kv_lens, query_start_loc


def _heads(case: Case) -> dict:
    return dict(q_head_start=case.q_head_start, q_per_kv=case.q_per_kv, kv_head_start=case.kv_head_start)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case)
    scale = case.head_dim ** -0.5
    out = poisoned(q.shape, case.out_dtype or case.dtype)
    lse = poisoned(q.shape[:2], torch.float32)
    got_out, got_lse = prefix_attention(
        q, key_cache, value_cache, block_table, kv_lens, query_start_loc, scale=scale, **_heads(case),
        max_kv_len=max(case.kv_lens), max_query_len=max(case.q_lens) if case.max_query_len == "exact" else None,
        num_splits=case.num_splits, out=out, lse=lse, config=case.config)
    assert got_out is out and got_lse is lse
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc,
        scale=scale, **_heads(case), max_kv_len=max(case.kv_lens))
    assert_matches(out, want_out, case.dtype, "out")
    assert_matches(lse, want_lse, case.dtype, "lse")


@pytest.mark.parametrize("splits", [1, 19])
@pytest.mark.parametrize("ops", ["triton", "reference"])
def test_a_nan_key_makes_the_rows_that_read_it_nan(ops, splits):
    """A NaN in a cached key (a fault upstream) turns exactly the rows that attend to it NaN, out and lse, through
    the split merge too, instead of vanishing into a finite wrong answer; every other row is still exact."""
    case = Case([1, 2, 1], [700, 33, 5], 8, 2, 4, num_splits=splits)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case, seed=4)
    args = dict(scale=0.125, **_heads(case), max_kv_len=700)
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc, **args)
    key_cache[block_table[1, 1].long(), 3, 1, 7] = float("nan")  # request 1, position 19, KV head 1 (Q heads 4-7)
    out, lse = poisoned(q.shape, torch.float32), poisoned(q.shape[:2], torch.float32)
    if ops == "triton":
        prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, **args,
                         num_splits=splits, out=out, lse=lse)
    else:
        reference.prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, **args,
                                   out=out, lse=lse)
    nan = torch.zeros(q.shape[:2], dtype=torch.bool)
    nan[1:3, 4:8] = True  # request 1's two query rows, the Q heads of KV head 1
    assert torch.isnan(out[nan]).all() and torch.isnan(lse[nan]).all()
    assert_matches(out[~nan], want_out[~nan], torch.float32, "the other rows' out")
    assert_matches(lse[~nan], want_lse[~nan], torch.float32, "the other rows' lse")


def test_default_outputs_and_loose_max_context_len():
    case = Case([3, 1], [9, 30], 4, 2, 2, dtype=torch.float16)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case, seed=1)
    capacity = block_table.shape[1] * case.block_size  # a loose bound only tunes splits
    out, lse = prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, scale=0.3,
                                **_heads(case), max_kv_len=capacity)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc,
        scale=0.3, **_heads(case), max_kv_len=capacity)
    assert_matches(out, want_out, torch.float16, "out")
    assert_matches(lse, want_lse, torch.float16, "lse")


def test_out_view_in_q_dtype():
    case = Case([2, 1], [15, 4], 4, 4, 1, num_splits=2)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case, seed=2)
    wide = poisoned((q.shape[0], q.shape[1], 2 * q.shape[2]), q.dtype)
    out = wide[..., q.shape[2]:]  # strided out, e.g. one half of a packed buffer
    lse_wide = poisoned((q.shape[1], q.shape[0]), torch.float32)
    prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, scale=0.125,
                     **_heads(case), max_kv_len=15, max_query_len=2, num_splits=2, out=out, lse=lse_wide.t())
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc,
        scale=0.125, **_heads(case), max_kv_len=15)
    assert_matches(out, want_out, q.dtype, "out")
    assert_matches(lse_wide.t(), want_lse, q.dtype, "lse")
    assert torch.isnan(wide[..., :q.shape[2]]).all(), "wrote outside the out view"


def _good() -> dict:
    case = Case([1, 2], [5, 9], 4, 2, 2)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case)
    return dict(q=q, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                kv_lens=kv_lens, query_start_loc=query_start_loc, scale=0.125, q_head_start=0,
                q_per_kv=2, kv_head_start=0, max_kv_len=9)


@pytest.mark.parametrize(("change", "match"), [
    (dict(q=torch.randn(3, 256)), "q must have 3 dims"),
    (dict(key_cache=torch.randn(3, 16, 2, 64, dtype=torch.float16)), "key_cache has dtype"),
    (dict(value_cache=torch.randn(3, 16, 2, 32)), "value_cache must have shape"),
    (dict(block_table=torch.zeros(3, 2)), "block_table has dtype"),
    (dict(kv_lens=torch.tensor([5, 9, 1], dtype=torch.int32)), "query_start_loc must have shape"),
    (dict(q_head_start=2), "head mapping out of range"),
    (dict(q_per_kv=0), "q_per_kv must be an int >= 1"),
    (dict(max_kv_len=10_000), "max_kv_len must be an int"),
    (dict(num_splits=0), "num_splits must be an int"),
    (dict(out=torch.empty(3, 4, 32)), "out must have shape"),
    (dict(lse=torch.empty(3, 4, dtype=torch.float16)), "lse has dtype"),
    (dict(config=PrefixConfig(block_n=8, block_m=16, num_warps=4, num_stages=1)), "config.block_n"),
    (dict(config=PrefixConfig(16, 32, 4, 1, min_rows=64)), "config.min_rows"),
], ids=["q-dims", "cache-dtype", "value-cache-shape", "block-table-dtype", "query-start-loc-length",
        "head-map-range", "q-per-kv-zero", "max-context-over-table", "splits-zero", "out-shape", "lse-dtype",
        "config-block-n", "config-min-rows"])
def test_rejects_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        prefix_attention(**{**_good(), **change})


@pytest.mark.parametrize("splits", [1, 3])
def test_rank_major_outputs(splits):
    """out [R, T, H / R, D] / lse [R, T, H / R]: head h lands at [h // (H / R), t, h % (H / R)] (what DCP sends)."""
    case = Case([1, 4, 1], [30, 12, 0], 8, 2, 4, num_splits=splits)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case, seed=3)
    ranks, num_tokens = 2, q.shape[0]
    out = poisoned((ranks, num_tokens, 4, case.head_dim), torch.float16)
    lse = poisoned((ranks, num_tokens, 4), torch.float32)
    prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, scale=0.2, **_heads(case),
                     max_kv_len=30, max_query_len=4, num_splits=splits, out=out, lse=lse)
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc, scale=0.2,
        **_heads(case), max_kv_len=30)
    assert_matches(out.transpose(0, 1).reshape(num_tokens, 8, -1), want_out, torch.float16, "rank-major out")
    assert_matches(lse.transpose(0, 1).reshape(num_tokens, 8), want_lse, torch.float16, "rank-major lse")


def test_mixed_step_grid_is_about_one_program_per_row():
    """Many one-row decodes and one long chunk: the grid covers the step's rows, not requests x longest query."""
    q_lens, kv_lens = [1] * 100 + [70], [9] * 100 + [33]
    case = Case(q_lens, kv_lens, 4, 2, 2)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case, seed=4)
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], torch.float32)
    plan = plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, scale=0.2,
                       **_heads(case), max_kv_len=33, max_query_len=70)
    block_q = plan.stage1.constexprs["BLOCK_Q"]
    num_tokens, num_reqs = q.shape[0], len(q_lens)
    assert plan.stage1.grid[0] == num_tokens // block_q + num_reqs + -(-num_tokens // block_q)
    assert plan.stage1.grid[0] * 3 < num_reqs * -(-70 // block_q), "the grid still scales with requests x longest"
    plan(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse)
    want_out, want_lse = reference.prefix_attention(
        q.double(), key_cache.double(), value_cache.double(), block_table, kv_lens, query_start_loc, scale=0.2,
        **_heads(case), max_kv_len=33)
    assert_matches(out, want_out, q.dtype, "mixed out")
    assert_matches(lse, want_lse, q.dtype, "mixed lse")


def _selects_tma(case: Case, config: PrefixConfig, caches=None) -> bool:
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case)
    if caches is not None:
        key_cache, value_cache = caches
    launch = plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, torch.empty_like(q),
                         torch.empty(q.shape[:2]), scale=0.125, **_heads(case), max_kv_len=max(case.kv_lens),
                         num_splits=1, config=config)
    return launch.stage1.constexprs["USE_TMA"] and launch.stage1.scratch


def test_tensor_descriptors_only_where_the_cache_allows_them():
    tma = PrefixConfig(16, 32, 4, 1, tma=True)
    case = Case([2], [40], 4, 2, 2, block_size=32)
    assert _selects_tma(case, tma)
    assert _selects_tma(dataclasses.replace(case, layout="hnd"), tma)
    assert _selects_tma(dataclasses.replace(case, layout="kv_last_dim"), tma)
    assert not _selects_tma(case, dataclasses.replace(tma, tma=False))
    assert not _selects_tma(dataclasses.replace(case, block_size=8), tma), "a tile would span pages"
    assert not _selects_tma(dataclasses.replace(case, head_dim=80), tma), "head dim not a power of two"
    kc = torch.zeros(3, 32, 2, 65)[..., 1:]
    assert not _selects_tma(case, tma, (kc, kc)), "base not 16-byte aligned"
    kc = torch.zeros(3, 32, 2, 64).transpose(2, 3).contiguous().transpose(2, 3)
    assert not _selects_tma(case, tma, (kc, kc)), "stride along D is not 1"
    kc, vc = torch.zeros(3, 32, 2, 64), torch.zeros(3, 2, 32, 64).transpose(1, 2)
    assert not _selects_tma(case, tma, (kc, vc)), "K and V rows are not the same 2-D shape"


def _gpu_tables(monkeypatch) -> None:
    """The GPU's tuning table and selection in ``plan_prefix``, on this CPU."""
    for module in ("dcp_plugin.kernels._prefix_config", "dcp_plugin.kernels.prefix_attention"):
        monkeypatch.setattr(importlib.import_module(module), "INTERPRET", False)


# What the GPU's tables ship, written out here (not read from them): a tuning change must change this file too.
# (BLOCK_M, BLOCK_N, tensor descriptors, warps, stages, register cap or None)
PREFIX_D128_DESCRIPTORS = (128, 64, True, 4, 2, None)
PREFIX_D128_POINTERS = (256, 64, False, 8, 3, None)
DECODE_D128_TABLE = (64, 128, False, 4, 3, None)
DECODE_D128_DESCRIPTORS = (64, 64, True, 4, 4, 128)
DECODE_D128_FP8_DESCRIPTORS = (64, 64, True, 4, 6, 96)


def _shipped(block_m, block_n, tma, num_warps, num_stages, max_registers):
    return SimpleNamespace(block_m=block_m, block_n=block_n, tma=tma, num_warps=num_warps, num_stages=num_stages,
                           max_registers=max_registers)


def test_gpu_table_prefix_falls_back_to_pointer_tiles_where_descriptors_do_not_fit(monkeypatch):
    """The GPU table's prefix entry reads through tensor descriptors; over pages smaller than its tile the launch
    takes the pointer loads' own constants, not the descriptor tile shape."""
    _gpu_tables(monkeypatch)
    for block_size, want in ((64, _shipped(*PREFIX_D128_DESCRIPTORS)), (16, _shipped(*PREFIX_D128_POINTERS))):
        case = Case([40], [100], 8, 2, 4, head_dim=128, block_size=block_size, dtype=torch.float16)
        q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case)
        launch = plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc,
                             torch.empty_like(q), torch.empty(q.shape[:2]), scale=0.1, **_heads(case), max_kv_len=100,
                             max_query_len=40, num_splits=1)
        consts = launch.stage1.constexprs
        assert (consts["BLOCK_Q"] * consts["BLOCK_H"], consts["BLOCK_N"], consts["USE_TMA"]) == \
            (want.block_m, want.block_n, want.tma), block_size
        assert launch.stage1.options == {"num_warps": want.num_warps, "num_stages": want.num_stages} | (
            {"maxnreg": want.max_registers} if want.max_registers else {})


@pytest.mark.parametrize("cache", ["fp16", "e4m3"])
@pytest.mark.parametrize(("block_size", "num_q_heads", "q_per_kv", "which"), [
    (64, 8, 4, "descriptors"), (16, 8, 4, "table"), (64, 32, 32, "table"), (128, 16, 16, "descriptors"),
], ids=["pages64-group4", "pages16", "group32", "pages128-group16"])
def test_gpu_decode_takes_descriptor_tiles_over_large_pages_and_small_groups(monkeypatch, block_size, num_q_heads,
                                                                            q_per_kv, which, cache):
    """An fp8 cache takes its own descriptor tiles (six stages, 96 registers), V widened either way."""
    _gpu_tables(monkeypatch)
    descriptors = DECODE_D128_FP8_DESCRIPTORS if cache == "e4m3" else DECODE_D128_DESCRIPTORS
    want = _shipped(*(descriptors if which == "descriptors" else DECODE_D128_TABLE))
    case = Case([1, 1], [100, 7], num_q_heads, num_q_heads // q_per_kv, q_per_kv, head_dim=128,
                block_size=block_size, dtype=torch.float16)
    q, key_cache, value_cache, block_table, kv_lens, query_start_loc = _inputs(case)
    if cache == "e4m3":
        key_cache, value_cache = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    launch = plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, torch.empty_like(q),
                         torch.empty(q.shape[:2]), scale=0.1, **_heads(case), max_kv_len=100, max_query_len=1,
                         num_splits=1)
    consts = launch.stage1.constexprs
    assert (consts["BLOCK_N"], consts["USE_TMA"], consts["DECODE"]) == (want.block_n, want.tma, True)
    assert launch.stage1.options == {"num_warps": want.num_warps, "num_stages": want.num_stages} | (
            {"maxnreg": want.max_registers} if want.max_registers else {})
    assert consts["FP8_WIDEN"] == (1 if cache == "e4m3" else 0)
