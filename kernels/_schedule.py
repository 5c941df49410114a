"""Query blocks of a varlen batch without a host sync: which request (and which block of it) a program owns.

Request ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]``. Its blocks of ``BLOCK`` rows are given the
program ids ``first(b) .. first(b + 1) - 1`` with ``first(b) = query_start_loc[b] // BLOCK + b``: at least
``cdiv(rows, BLOCK)`` ids per request, and ``num_tokens // BLOCK + num_reqs`` ids in all, a bound the host knows
without reading the device. A mixed step (many one-row decodes and one long chunk) so costs about one program per
decode plus the chunk's blocks, not ``requests x longest query`` mostly-empty programs. Programs past the bound
cover rows after ``query_start_loc[num_reqs]`` (padding a CUDA graph left): ``tail`` rows, written as empty.
"""

import triton
import triton.language as tl


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
