"""A step of DCP attention allocates (almost) nothing beyond what is allocated before the engine sizes its KV cache.

vLLM measures its memory with a profiling forward that carries no attention metadata, so a backend's per-step
scratch must live in buffers allocated at model construction (``DcpWorkspace``, sized for ``max_num_batched_tokens``;
``DcpBatchBuffers``) or be small. Here one rank (DCP = 1, and DCP = 2 with collectives that copy into the
workspace's buffers, as vLLM's communicator does) runs a 16K-token prefill chunk over a 16K-token cached prefix and
a 512-request decode step; after a first step (compiles, caches), the CUDA caching allocator's peak above the
memory already allocated must stay under 1 MiB (the batch's per-request int32 tensors), against ~128 MiB of
activations that a 16K-token chunk's attention passes through.
"""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import DcpAttention, DcpBatch, DcpBatchBuffers, DcpWorkspace, HeadLayout, ParallelState, TokenLayout
from dcp_plugin import kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_TOKENS = 32, 8, 128, 16, 16384
STEPS = {"chunk-16k": ([16384], [16384]), "decode-512": ([1] * 512, [4096] * 512)}  # (query lens, cached lens)


class CopyIntoGroup:
    """Rank 0 of ``n``: each collective is one copy into the caller's buffer (vLLM's communicator writes into
    preallocated buffers too), so the step's own allocations are all that is counted."""

    def __init__(self, n: int) -> None:
        self.world_size, self.rank_in_group = n, 0

    def all_gather_into(self, out, t):
        out.view(self.world_size, -1).copy_(t.reshape(1, -1))

    def reduce_scatter_into(self, out, t):
        out.view(-1).copy_(t.reshape(self.world_size, -1)[0])

    def all_to_all_into(self, out, t):
        out.copy_(t)

    def all_gather(self, t, dim):
        raise AssertionError("DcpAttention must use the buffered collectives")

    reduce_scatter = all_to_all = all_gather


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("n, comm", [(1, "ag_rs"), (2, "ag_rs"), (2, "a2a")])
def test_a_step_allocates_under_a_mebibyte(n, comm, step):
    parallel = ParallelState.from_tp(tp_rank=0, tp_size=n, dcp_size=n)
    heads = HeadLayout.create(total_q_heads=Q_HEADS, total_kv_heads=KV_HEADS, parallel=parallel,
                              kv_replication="replicated")
    tokens = TokenLayout(dcp_size=n, dcp_rank=0, interleave=1, block_size=BLOCK_SIZE)
    query_lens, cached = STEPS[step]
    num_reqs, num_tokens = len(query_lens), sum(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, cached)]
    pages = [-(-tokens.max_local_len(s) // BLOCK_SIZE) for s in seq_lens]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(sum(pages) + 1, BLOCK_SIZE, heads.num_kv_heads, 2 * HEAD_DIM, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
    table = torch.randperm(sum(pages), device="cuda", generator=gen).to(torch.int32)
    table = torch.nn.functional.pad(table, (0, max(pages) * num_reqs - sum(pages)), value=sum(pages)).view(num_reqs, -1)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda")  # the new K/V written nowhere
    q, k, v = (torch.randn(num_tokens, h, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (heads.num_q_heads, heads.num_kv_heads, heads.num_kv_heads))
    out = torch.empty_like(q)
    workspace = DcpWorkspace(heads=heads, head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                             max_num_tokens=MAX_TOKENS, comm=comm,
                             split_elements=kernels.split_capacity(HEAD_DIM, torch.device("cuda")))
    attention = DcpAttention(heads=heads, tokens=tokens, group=CopyIntoGroup(n) if n > 1 else None,
                             scale=HEAD_DIM ** -0.5, comm=comm, workspace=workspace)
    batch_buffers = DcpBatchBuffers(num_reqs, "cuda")

    def run_step():  # as the engine runs it: the builder's per-step build, then the layer's forward
        batch = DcpBatch.build(query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots,
                               tokens=tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                               max_context_len=max(cached), buffers=batch_buffers)
        attention.forward(q, k, v, cache[..., :HEAD_DIM], cache[..., HEAD_DIM:], batch, out=out)

    run_step()  # compiles and caches
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert not out.isnan().any()
    assert extra < 1 << 20, \
        f"{step} at DCP = {n} ({comm}) allocated {extra / 2**20:.2f} MiB beyond its workspace and buffers"
