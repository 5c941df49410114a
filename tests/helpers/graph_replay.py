"""A decode step of DcpAttention (single-token rows, or speculative verify rows of 1 + k tokens per request) captured
once and replayed on later steps, as vLLM's full decode graphs run it: persistent inputs refreshed in place, a
``DcpBatchBuffers`` rebuilt per step, fewer real requests than captured (padding requests with no tokens, padding
rows past the last real token), contexts longer than at capture; each replay against float64.

On a GPU the step is a real CUDA graph; on CPU (the interpreter) "replay" runs the step prepared at capture again
(``DcpAttention.forward`` with the capture's batch, whose prepared launches it keeps): the same launches on the same
addresses, so a value taken from the capture's host ints instead of the refreshed buffers fails there too.
"""

from __future__ import annotations

import torch

from dcp_plugin import DcpAttention, DcpBatch, DcpBatchBuffers, HeadLayout, ParallelState, TokenLayout
from dcp_plugin.testing import causal_attention_f64
from tests.helpers.kernel_checks import assert_matches


class Step:
    """The engine's persistent inputs (fixed addresses) for ``reqs`` requests of ``query_len`` rows, and a cache of
    random pages, ``pages_per_req`` per request."""

    def __init__(self, *, device: str, dtype: torch.dtype, reqs: int, pages_per_req: int, query_len: int,
                 heads: tuple[int, int], head_dim: int, block_size: int) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.gen, self.dtype, self.device = gen, dtype, device
        self.reqs, self.query_len, self.block_size, self.head_dim = reqs, query_len, block_size, head_dim
        self.q_heads, self.kv_heads = heads
        self.capacity = pages_per_req * block_size
        rows = reqs * query_len
        self.cache = torch.randn(reqs * pages_per_req, block_size, self.kv_heads, 2 * head_dim, device=device,
                                 generator=gen).to(dtype)
        self.qsl = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=device)
        self.table = torch.zeros(reqs, pages_per_req, dtype=torch.int32, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.q, self.k, self.v = (torch.empty(rows, h, head_dim, dtype=dtype, device=device)
                                  for h in (self.q_heads, self.kv_heads, self.kv_heads))
        self.out = torch.empty(rows, self.q_heads, head_dim, dtype=dtype, device=device)

    def refresh(self, seq_lens: list[int]) -> None:
        """Next step's values, in place: ``len(seq_lens)`` real requests (``seq_lens`` include the step's rows),
        then padding requests with no rows."""
        real, rows = len(seq_lens), self.query_len
        self.qsl.copy_(torch.tensor([rows * min(b, real) for b in range(self.reqs + 1)]))
        self.seq_lens.copy_(torch.tensor(seq_lens + [0] * (self.reqs - real)))
        self.table.copy_(torch.randperm(self.table.numel(), device=self.device, generator=self.gen)
                         .view_as(self.table))
        # Request b's rows are positions seq_lens[b] - rows .. seq_lens[b] - 1 of its pages.
        slots = [int(self.table[b, p // self.block_size]) * self.block_size + p % self.block_size
                 for b, n in enumerate(seq_lens) for p in range(n - rows, n)]
        self.slots.copy_(torch.tensor(slots + [-1] * (self.slots.numel() - len(slots))))
        for t in (self.q, self.k, self.v):
            t.copy_(torch.randn(t.shape, device=self.device, generator=self.gen))

    def batch(self, tokens: TokenLayout, buffers: DcpBatchBuffers, real: int) -> DcpBatch:
        """As the vLLM builder builds it under full graphs: all (padded) requests, the real rows' slots, and host
        bounds at the table's capacity, so the split count frozen at capture suits every later step."""
        return DcpBatch.build(query_start_loc=self.qsl, seq_lens=self.seq_lens, block_table=self.table,
                              slot_mapping=self.slots[:real * self.query_len], tokens=tokens,
                              max_query_len=self.query_len, max_seq_len=self.capacity,
                              max_context_len=self.capacity - self.query_len,
                              num_decodes=0 if self.query_len > 1 else None, buffers=buffers)

    def expected(self, real: int) -> torch.Tensor:
        """float64: the new K/V stored at their slots, then each real request's rows, causally, over its
        sequence."""
        cache = self.cache.double()
        flat = cache.view(-1, self.kv_heads, 2 * self.head_dim)
        rows = real * self.query_len
        flat[self.slots[:rows]] = torch.cat([self.k[:rows], self.v[:rows]], dim=-1).double()
        want = []
        for b in range(real):
            n = int(self.seq_lens[b])
            positions = torch.arange(n, device=self.device)
            seq = flat[self.table[b, positions // self.block_size].long() * self.block_size
                       + positions % self.block_size]
            q = self.q[b * self.query_len:(b + 1) * self.query_len].double()
            want.append(causal_attention_f64(q, seq[..., :self.head_dim], seq[..., self.head_dim:],
                                             positions[n - self.query_len:], scale=self.head_dim ** -0.5,
                                             q_per_kv=self.q_heads // self.kv_heads))
        return torch.cat(want)


def check_replays(step: Step, lengths: list[list[int]], *, graph: bool) -> None:
    """Capture one step with every request real at short contexts, then replay it for each of ``lengths``."""
    parallel = ParallelState.from_tp(tp_rank=0, tp_size=1, dcp_size=1)
    heads = HeadLayout.create(total_q_heads=step.q_heads, total_kv_heads=step.kv_heads, parallel=parallel)
    tokens = TokenLayout(dcp_size=1, dcp_rank=0, interleave=1, block_size=step.block_size)
    attention = DcpAttention(heads=heads, tokens=tokens, group=None, scale=step.head_dim ** -0.5)
    buffers = DcpBatchBuffers(step.reqs, step.device)
    key_cache, value_cache = step.cache[..., :step.head_dim], step.cache[..., step.head_dim:]

    def forward(batch):
        attention.forward(step.q, step.k, step.v, key_cache, value_cache, batch, out=step.out)

    step.refresh([step.query_len + b for b in range(step.reqs)])  # as vLLM captures: dummy short lengths
    captured = step.batch(tokens, buffers, step.reqs)  # built outside the capture, as vLLM builds it
    forward(captured)
    if graph:
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            forward(captured)
        replay = cuda_graph.replay
    else:
        def replay():
            forward(captured)

    for seq_lens in lengths:
        real = len(seq_lens)
        step.refresh(seq_lens)
        step.batch(tokens, buffers, real)  # the engine's per-step build: refreshes the buffers
        want = step.expected(real)
        step.out.fill_(float("nan"))
        replay()
        rows = real * step.query_len
        name = f"replayed step of {step.query_len} rows per request, seq_lens {seq_lens}"
        assert_matches(step.out[:rows], want, step.dtype, name)
        padding = step.out[rows:]
        assert not padding.isnan().any() and not padding.any(), f"{name}: padding rows must be written as zeros"
