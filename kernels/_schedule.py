"""Which rows a program owns, decided without a host sync: a block of one request's queries, a tile of one KV
KV group's Q heads; and how many KV splits a request is cut into.

Query blocks of a varlen batch: which request (and which block of it) a program owns.

Request ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]``. Its blocks of ``BLOCK`` rows are given the
program ids ``first(b) .. first(b + 1) - 1`` with ``first(b) = query_start_loc[b] // BLOCK + b``: at least
``cdiv(rows, BLOCK)`` ids per request, and ``num_tokens // BLOCK + num_reqs`` ids in all, a bound the host knows
without reading the device. A mixed step (many one-row decodes and one long chunk) so costs about one program per
decode plus the chunk's blocks, not ``requests x longest query`` mostly-empty programs. Programs past the bound
cover rows after ``query_start_loc[num_reqs]`` (padding a CUDA graph left): ``tail`` rows, written as empty.
"""

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
import triton
import triton.language as tl

from dcp_plugin.kernels._launch import cdiv


@triton.jit
def find_block(query_start_loc_ptr, num_reqs, pid, BLOCK: tl.constexpr):
    """``(request, block within it)`` of program ``pid < num_tokens // BLOCK + num_reqs``; the block may lie past
    the request's rows (the program then has nothing to do)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:  # last b with first(b) <= pid
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    req = tl.maximum(lo - 1, 0)
    return req, pid - (tl.load(query_start_loc_ptr + req) // BLOCK + req)


def flat_programs(num_tokens: int, num_reqs: int, block: int) -> int:
    """Program ids ``find_block`` may be given (host side)."""
    return num_tokens // block + num_reqs if num_reqs else 0


@triton.jit
def kv_group_head_tile(pid_h, first_kv_head, head_tiles_per_kv_group, q_head_start, q_per_kv, kv_head_start,
                       num_q_heads, block_h):
    """Head program ``pid_h`` -> (stored KV head, first local Q head of its tile, end of that KV group's local Q
    heads). The local Q heads reading stored KV head ``kv`` are ``[max(0, g * q_per_kv - q_head_start),
    min(Hq, (g + 1) * q_per_kv - q_head_start))`` with ``g = kv + kv_head_start``; a tile never passes the end."""
    kv_head = first_kv_head + pid_h // head_tiles_per_kv_group
    kv_group_lo = (kv_head + kv_head_start) * q_per_kv - q_head_start
    head_hi = tl.minimum(kv_group_lo + q_per_kv, num_q_heads)
    tile_lo = tl.maximum(kv_group_lo, 0) + (pid_h % head_tiles_per_kv_group) * block_h
    return kv_head, tile_lo, head_hi


def head_tiling(*, num_q_heads: int, q_head_start: int, q_per_kv: int, kv_head_start: int,
                block_h: int) -> tuple[int, int, int]:
    """Host side of ``kv_group_head_tile``: (first stored KV head touched, KV groups touched, tiles per KV group)."""
    first_kv_head = q_head_start // q_per_kv - kv_head_start
    last_kv_head = (q_head_start + num_q_heads - 1) // q_per_kv - kv_head_start
    return first_kv_head, last_kv_head - first_kv_head + 1, cdiv(min(q_per_kv, num_q_heads), block_h)


# Automatic split count: at most PROGRAMS_PER_SM programs per SM (a partial extra wave costs a whole one), and at least
# MIN_TILES_PER_SPLIT tiles per split unless the grid would then not reach SMALL_GRID_PER_SM programs per SM: then
# splits of down to SMALL_GRID_TILES tiles. H200, 128-token tiles (docs/kernels.md, decode; graph replay, GB/s): 8 x 1K,
# 8 KV heads: 4 splits 1788 against 2 splits 1486; 1 x 8K: 32 splits 1764 against 16 1496; 32 x 8K, one KV head: 8
# splits 2649 against 16 2292; 1 x 32K and 8 x 32K, one KV head: 32 splits best.
PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 8
SMALL_GRID_PER_SM = 2
SMALL_GRID_TILES = 2
MAX_AUTO_SPLITS = 64


def pick_num_splits(*, programs: int, max_kv_len: int, block_n: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per request so that stage 1 fills ``sms`` SMs with at most ``per_sm`` programs each, from host ints
    only (CUDA-graph safe)."""
    programs = max(programs, 1)
    by_occupancy = per_sm * sms // programs
    tiles = cdiv(max_kv_len, block_n)
    small_grid = min(tiles // SMALL_GRID_TILES, cdiv(SMALL_GRID_PER_SM * sms, programs))
    by_length = max(tiles // MIN_TILES_PER_SPLIT, small_grid)
    splits = max(1, min(MAX_AUTO_SPLITS, by_occupancy, by_length))
    return cdiv(tiles, cdiv(tiles, splits)) if tiles else 1  # as few splits as give the same tiles per split


# A decode's balanced splits (``balanced_split``, a GPU's decodes on the ``tl`` kernel): the split
# count of each request is its own, from its share of the step's work, so one long context among short ones is cut
# into many splits and a short one into few, where one count for every request (``pick_num_splits``, sized for the
# longest) left one program reading a long context alone.
# Programs: one per (work row, head program); a work row is one (request, split), for the requests with a query row
# (a decode's requests have at most one), then one per row after ``query_start_loc[num_reqs]`` (padding): the splits
# number at most ``slots / head_programs`` plus the requests with a row, so ``cdiv(slots, head_programs) +
# num_tokens`` rows cover them whatever the contexts. Every program finds its row in two passes over the batch's
# lengths, ``BALANCE_BLOCK`` requests a read: the search is each program's fixed cost.
BALANCE_BLOCK = tl.constexpr(256)  # requests a step of ``balanced_split``'s loops reads
_SMALL_TILES = tl.constexpr(SMALL_GRID_TILES)  # the jit function's copies (it reads only constexpr globals)
_MIN_TILES = tl.constexpr(MIN_TILES_PER_SPLIT)


@triton.jit
def _request_tiles(kv_lens_ptr, query_start_loc_ptr, r, num_reqs, BLOCK_N: tl.constexpr):
    """Tiles of requests ``r`` (a block of indices); 0 for a request without a query row or past the batch."""
    live = r < num_reqs
    lens = tl.load(kv_lens_ptr + r, mask=live, other=0).to(tl.int32)
    first = tl.load(query_start_loc_ptr + r, mask=live, other=0)
    rows = tl.load(query_start_loc_ptr + r + 1, mask=live, other=0) - first
    return tl.where(rows > 0, (lens + BLOCK_N - 1) // BLOCK_N, 0), live & (rows > 0)


@triton.jit
def balanced_split(kv_lens_ptr, query_start_loc_ptr, num_reqs, work, slots, small_slots, head_programs,
                   max_splits, BLOCK_N: tl.constexpr):
    """Work row ``work`` -> ``(request, split, splits of that request)``; past the last request's last split, row
    ``num_reqs + i`` with one split: the ``i``-th row after ``query_start_loc[num_reqs]`` (padding). A request of
    ``t`` tiles with a query row takes ``t / target`` splits rounded to the nearest whole number (halves down), at
    least one and at most ``max_splits`` (none without a row), where ``target`` tiles a split is
    ``pick_num_splits``' rule over the step's whole work ``w`` (tiles x head programs): at least
    ``SMALL_GRID_TILES``, ``cdiv(w, slots)`` (about ``slots`` programs) and, up to ``MIN_TILES_PER_SPLIT``,
    ``cdiv(w, small_slots)``. Rounded up instead, equal contexts overshot ``slots`` by up to a program per request
    and head program: 8 x 32K over 64-token tiles took 9 splits, 576 programs for 528 slots, a second wave of 48
    (docs/kernels.md, fp8 decode)."""
    total = tl.full([], 0, tl.int32)
    for r0 in range(0, num_reqs, BALANCE_BLOCK):
        tiles, _ = _request_tiles(kv_lens_ptr, query_start_loc_ptr, r0 + tl.arange(0, BALANCE_BLOCK), num_reqs,
                                  BLOCK_N)
        total += tl.sum(tiles, 0)
    weight = total * head_programs
    target = tl.maximum(tl.maximum((weight + slots - 1) // slots, _SMALL_TILES),
                        tl.minimum((weight + small_slots - 1) // small_slots, _MIN_TILES))
    seen = tl.full([], 0, tl.int32)
    found = tl.full([], 0, tl.int64)  # the hit request's (r << 32) | (first work row << 8) | splits
    for r0 in range(0, num_reqs, BALANCE_BLOCK):
        r = r0 + tl.arange(0, BALANCE_BLOCK)
        tiles, takes = _request_tiles(kv_lens_ptr, query_start_loc_ptr, r, num_reqs, BLOCK_N)
        splits = tl.where(takes, tl.minimum(tl.maximum((2 * tiles + target - 1) // (2 * target), 1), max_splits), 0)
        end = tl.cumsum(splits, 0) + seen  # past request r's last work row
        hit = (end - splits <= work) & (work < end)
        found += tl.sum(tl.where(hit, (r.to(tl.int64) << 32) | ((end - splits).to(tl.int64) << 8) | splits, 0), 0)
        seen += tl.sum(splits, 0)
    req = (found >> 32).to(tl.int32)
    hit_any = found != 0
    return (tl.where(hit_any, req, num_reqs + work - seen),
            tl.where(hit_any, work - ((found >> 8) & 0xFFFFFF).to(tl.int32), 0),
            tl.where(hit_any, (found & 0xFF).to(tl.int32), 1))


def balanced_max_splits(*, max_kv_len: int, block_n: int, slots: int, head_programs: int) -> int:
    """The most splits ``balanced_split`` may give a request of at most ``max_kv_len`` tokens (host ints)."""
    return max(1, min(MAX_AUTO_SPLITS, cdiv(cdiv(max_kv_len, block_n), SMALL_GRID_TILES),
                      cdiv(slots, max(head_programs, 1))))
