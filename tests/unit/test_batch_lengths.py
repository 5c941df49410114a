"""The one-launch per-request lengths kernel against counts taken position by position from the placement rule."""

import pytest
import torch

from dcp_plugin.kernels.batch_lengths import plan_batch_lengths


def owned(length: int, *, n: int, rank: int, interleave: int) -> int:
    """Positions ``[0, length)`` whose owner is ``rank``: ``owner(p) = (p // I) % N`` (the page size drops out of
    the owner because it is a multiple of I)."""
    return sum(1 for p in range(length) if (p // interleave) % n == rank)


@pytest.mark.parametrize("n,rank,interleave", [(1, 0, 1), (2, 1, 1), (4, 3, 2), (3, 0, 16), (8, 5, 4)])
def test_lengths_match_the_placement_rule(n, rank, interleave):
    gen = torch.Generator().manual_seed(n * 100 + rank)
    num_reqs = 37
    query_lens = torch.randint(0, 70, (num_reqs,), generator=gen, dtype=torch.int32)
    context = torch.randint(0, 300, (num_reqs,), generator=gen, dtype=torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    seq_lens = context + query_lens
    outs = [torch.full((num_reqs + 5,), -7, dtype=torch.int32) for _ in range(4)]  # poisoned, with a tail
    plan_batch_lengths(num_reqs, dcp_size=n, dcp_rank=rank, interleave=interleave)(qsl, seq_lens,
                                                                                     *(o[:num_reqs] for o in outs))
    ql, cl, lcl, lsl = (o.tolist() for o in outs)
    assert ql[:num_reqs] == query_lens.tolist()
    assert cl[:num_reqs] == context.tolist()
    assert lcl[:num_reqs] == [owned(c, n=n, rank=rank, interleave=interleave) for c in context.tolist()]
    assert lsl[:num_reqs] == [owned(s, n=n, rank=rank, interleave=interleave) for s in seq_lens.tolist()]
    assert all(o[num_reqs:] == [-7] * 5 for o in (ql, cl, lcl, lsl))  # nothing past the batch is written

