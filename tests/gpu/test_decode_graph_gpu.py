"""A decode step of DcpAttention captured in a CUDA graph and replayed on later steps, as vLLM's full decode graphs
run it: persistent inputs refreshed in place, a ``DcpBatchWorkspace`` rebuilt per step, fewer real requests than the
graph was captured for (padding requests with no tokens), contexts longer than at capture; vs float64."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import DcpAttention, DcpBatch, DcpBatchWorkspace, HeadLayout, ParallelState, TokenLayout
from dcp_plugin.kernels import reference
from tests.kernel_checks import assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CAPTURED_REQS, PAGES_PER_REQ = 8, 256  # the block table addresses 4096 tokens per request


class Step:
    """The engine's persistent decode inputs (fixed addresses) and a cache of random pages."""

    def __init__(self, dtype: torch.dtype) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.gen, self.dtype = gen, dtype
        num_pages = CAPTURED_REQS * PAGES_PER_REQ
        self.cache = torch.randn(num_pages, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM, device="cuda", generator=gen).to(dtype)
        self.qsl = torch.zeros(CAPTURED_REQS + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.zeros(CAPTURED_REQS, dtype=torch.int32, device="cuda")
        self.table = torch.zeros(CAPTURED_REQS, PAGES_PER_REQ, dtype=torch.int32, device="cuda")
        self.slots = torch.full((CAPTURED_REQS,), -1, dtype=torch.int64, device="cuda")
        self.q, self.k, self.v = (torch.empty(CAPTURED_REQS, h, HEAD_DIM, dtype=dtype, device="cuda")
                                  for h in (Q_HEADS, KV_HEADS, KV_HEADS))
        self.out = torch.empty(CAPTURED_REQS, Q_HEADS, HEAD_DIM, dtype=dtype, device="cuda")

    def refresh(self, seq_lens: list[int]) -> None:
        """Next step's values, in place: ``len(seq_lens)`` real decode requests, then padding requests."""
        real = len(seq_lens)
        self.qsl.copy_(torch.tensor([*range(real + 1), *[real] * (CAPTURED_REQS - real)]))
        self.seq_lens.copy_(torch.tensor(seq_lens + [0] * (CAPTURED_REQS - real)))
        self.table.copy_(torch.randperm(self.table.numel(), device="cuda", generator=self.gen).view_as(self.table))
        # The new token of request b sits at position seq_lens[b] - 1 of its pages.
        slots = [int(self.table[b, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                 for b, n in enumerate(seq_lens)]
        self.slots.copy_(torch.tensor(slots + [-1] * (CAPTURED_REQS - real)))
        for t in (self.q, self.k, self.v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=self.gen))

    def batch(self, tokens: TokenLayout, workspace: DcpBatchWorkspace, real: int) -> DcpBatch:
        """As the vLLM builder builds it: all (padded) requests, the real tokens' slots, and host bounds at the
        table's capacity, so the split count frozen at capture suits every later step."""
        capacity = PAGES_PER_REQ * BLOCK_SIZE
        return DcpBatch.build(query_start_loc=self.qsl, seq_lens=self.seq_lens, block_table=self.table,
                              slot_mapping=self.slots[:real], tokens=tokens, max_query_len=1, max_seq_len=capacity,
                              max_context_len=capacity - 1, workspace=workspace)

    def expected(self, real: int) -> torch.Tensor:
        """float64: the new K/V stored at their slots, then each real request's query over its whole sequence."""
        cache = self.cache.double()
        flat = cache.view(-1, KV_HEADS, 2 * HEAD_DIM)
        flat[self.slots[:real]] = torch.cat([self.k[:real], self.v[:real]], dim=-1).double()
        out, _ = reference.paged_attention(
            self.q[:real].double(), cache[..., :HEAD_DIM], cache[..., HEAD_DIM:], self.table[:real],
            self.seq_lens[:real], self.qsl[:real + 1], scale=HEAD_DIM ** -0.5, q_head_start=0,
            q_per_kv=Q_HEADS // KV_HEADS, kv_head_start=0, max_kv_len=PAGES_PER_REQ * BLOCK_SIZE)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_step_replays_as_a_cuda_graph(dtype):
    ps = ParallelState.from_tp(tp_rank=0, tp_size=1, dcp_size=1)
    heads = HeadLayout.create(total_q_heads=Q_HEADS, total_kv_heads=KV_HEADS, ps=ps)
    tokens = TokenLayout(dcp_size=1, dcp_rank=0, interleave=1, block_size=BLOCK_SIZE)
    attention = DcpAttention(heads=heads, tokens=tokens, group=None, scale=HEAD_DIM ** -0.5)
    workspace = DcpBatchWorkspace(CAPTURED_REQS, "cuda")
    step = Step(dtype)
    key_cache, value_cache = step.cache[..., :HEAD_DIM], step.cache[..., HEAD_DIM:]

    def forward(batch):
        attention.forward(step.q, step.k, step.v, key_cache, value_cache, batch, out=step.out)

    # Capture at short contexts with every slot real (as vLLM captures: dummy lengths), after one eager warm-up.
    step.refresh([1, 2, 3, 4, 5, 6, 7, 8])
    batch = step.batch(tokens, workspace, CAPTURED_REQS)  # built outside the capture, as vLLM builds it
    forward(batch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(batch)

    for seq_lens in ([4096, 17, 1, 2500, 640], [33, 4000, 3001, 2, 1, 129, 4095, 1000], [1]):
        step.refresh(seq_lens)
        step.batch(tokens, workspace, len(seq_lens))  # the engine's per-step build: refreshes the workspace
        want = step.expected(len(seq_lens))
        step.out.fill_(float("nan"))
        graph.replay()
        assert_matches(step.out[:len(seq_lens)], want, dtype, f"replayed decode, seq_lens {seq_lens}")
        padding = step.out[len(seq_lens):]
        assert not padding.isnan().any() and not padding.any(), "padding rows must be written as zeros"
