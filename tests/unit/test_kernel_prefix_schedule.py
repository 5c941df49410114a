"""How prefix_attention cuts its work (kernels/_schedule.py): head tiles that cover each local Q head once with its own
KV head for every head map, and the automatic KV split count."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dcp_plugin.kernels._schedule import SMALL_GRID_PER_SM, kv_group_head_tile, head_tiling
from dcp_plugin.kernels.prefix_attention import MAX_AUTO_SPLITS, MIN_TILES_PER_SPLIT, PROGRAMS_PER_SM, pick_num_splits

# (local Q heads, q_head_start, q_per_kv, kv_head_start): KV group sizes > 16 and not multiples of 16 (the grouped-
# kernel bug of vLLM/SGLang), DCP ranks' gathered heads starting mid-KV-group, MQA, and first KV heads other than 0.
HEAD_MAPS = [
    (4, 0, 1, 0), (6, 0, 3, 0), (10, 0, 5, 0), (16, 0, 8, 0), (8, 0, 8, 0), (48, 0, 24, 0), (40, 0, 20, 0),
    (56, 0, 28, 0), (24, 24, 24, 1), (8, 8, 16, 0), (6, 6, 4, 1), (6, 0, 4, 0), (8, 8, 4, 0), (5, 3, 2, 1),
    (7, 13, 5, 2), (33, 7, 48, 0), (100, 10, 48, 0), (17, 0, 17, 0),
]
MAX_HEADS = 256  # room past every map's heads, so a tile writing past its KV group's end shows up


@triton.jit
def _head_map_kernel(params_ptr, kv_of_head_ptr, writes_ptr, ROWS: tl.constexpr):
    """Every head program of map ``cfg`` records, through the kernel's own ``kv_group_head_tile``, which KV head each
    of its tile's Q heads would read, and counts the writes."""
    cfg = tl.program_id(0)
    pid_h = tl.program_id(1)
    p = params_ptr + cfg * 7
    if pid_h < tl.load(p + 6):
        kv_head, tile_lo, head_hi = kv_group_head_tile(pid_h, tl.load(p + 4), tl.load(p + 5), tl.load(p + 1),
                                                       tl.load(p + 2), tl.load(p + 3), tl.load(p), ROWS)
        heads = tile_lo + tl.arange(0, ROWS)
        mask = heads < head_hi
        tl.store(kv_of_head_ptr + cfg * MAX_HEADS + heads, kv_head + 0 * heads, mask=mask)
        tl.atomic_add(writes_ptr + cfg * MAX_HEADS + heads, 1 + 0 * heads, mask=mask)


@pytest.mark.parametrize("block_h", [4, 16])
def test_head_tiles_cover_each_q_head_once_with_its_kv_head(block_h):
    params = []
    for num_q_heads, q_head_start, q_per_kv, kv_head_start in HEAD_MAPS:
        first, groups, tiles = head_tiling(num_q_heads=num_q_heads, q_head_start=q_head_start, q_per_kv=q_per_kv,
                                           kv_head_start=kv_head_start, block_h=block_h)
        params.append([num_q_heads, q_head_start, q_per_kv, kv_head_start, first, tiles, groups * tiles])
    params = torch.tensor(params, dtype=torch.int32)
    kv_of_head = torch.full((len(HEAD_MAPS), MAX_HEADS), -1, dtype=torch.int32)
    writes = torch.zeros((len(HEAD_MAPS), MAX_HEADS), dtype=torch.int32)
    _head_map_kernel[(len(HEAD_MAPS), int(params[:, 6].max()))](params, kv_of_head, writes, ROWS=block_h)
    for row, (num_q_heads, q_head_start, q_per_kv, kv_head_start) in enumerate(HEAD_MAPS):
        want = torch.full((MAX_HEADS,), -1, dtype=torch.int32)
        want[:num_q_heads] = torch.arange(q_head_start, q_head_start + num_q_heads) // q_per_kv - kv_head_start
        assert writes[row].tolist() == [1] * num_q_heads + [0] * (MAX_HEADS - num_q_heads), HEAD_MAPS[row]
        assert torch.equal(kv_of_head[row], want), HEAD_MAPS[row]


@pytest.mark.parametrize("programs", [1, 8, 32, 64, 100, 256, 528, 1000, 1056, 5000])
def test_auto_splits_fill_the_gpu_without_a_partial_wave(programs):
    sms, block_n = 132, 128
    budget = PROGRAMS_PER_SM * sms
    long = pick_num_splits(programs=programs, max_kv_len=128 * 1024, block_n=block_n, sms=sms)
    assert 1 <= long <= MAX_AUTO_SPLITS
    if long > 1:
        assert programs * long <= budget, "more programs than the per-wave budget"
    # A long context: the most splits within the budget (or the cap); one more would overflow it.
    assert long == MAX_AUTO_SPLITS or programs * (long + 1) > budget, (programs, long)
    for tiles in (1, 3, 2 * MIN_TILES_PER_SPLIT, 5 * MIN_TILES_PER_SPLIT):
        splits = pick_num_splits(programs=programs, max_kv_len=tiles * block_n, block_n=block_n, sms=sms)
        assert 1 <= splits <= tiles, "a split never gets less than one tile"
        if tiles // splits < MIN_TILES_PER_SPLIT:  # short splits only while the grid is small
            assert splits == 1 or programs * (splits - 1) < SMALL_GRID_PER_SM * sms, (programs, tiles, splits)
        assert splits == 1 or -(-tiles // splits) < -(-tiles // (splits - 1)), "no split count with a split empty"
    assert pick_num_splits(programs=programs, max_kv_len=0, block_n=block_n, sms=sms) == 1


def test_auto_splits_match_the_h200_sweep():
    """The best split counts of the H200 sweeps, `47214dc:benchmarks/results/kernels_h200_sweep.json` and
    `47214dc:benchmarks/results/kernels_h200_tuning_sweep3.json` (docs/kernels.md, decode; bf16, D = 128, 128-token
    tiles; within 4% of the best for 128 x 8K); programs = requests x KV heads (one head tile per KV group)."""
    shapes = ((1, 8192, 8), (1, 32768, 8), (8, 1024, 8), (32, 8192, 1), (128, 8192, 1), (8, 32768, 1))
    picks = {(b, ctx, kv_heads): pick_num_splits(programs=b * kv_heads, max_kv_len=ctx, block_n=128, sms=132)
             for b, ctx, kv_heads in shapes}
    assert picks == {(1, 8192, 8): 32, (1, 32768, 8): 32, (8, 1024, 8): 4, (32, 8192, 1): 8, (128, 8192, 1): 4,
                     (8, 32768, 1): 32}
