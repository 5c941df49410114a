"""Decode steps of DcpAttention captured in a CUDA graph and replayed on later steps, as vLLM's full decode graphs
run them (``tests/helpers/graph_replay.py``): single-token steps and speculative verify steps of 1 + 4 rows per request,
bf16 and fp16, 32 Q / 8 KV heads, head size 128, block tables addressing 4096 tokens per request; vs float64."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.graph_replay import Step, check_replays

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = ([4096, 17, 5, 2500, 640], [33, 4000, 3001, 6, 5, 129, 4095, 1000], [5])


@pytest.mark.parametrize("query_len", [1, 5], ids=["decode", "verify-k4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_step_replays_as_a_cuda_graph(dtype, query_len):
    step = Step(device="cuda", dtype=dtype, reqs=8, pages_per_req=256, query_len=query_len, heads=(32, 8),
                head_dim=128, block_size=16)
    check_replays(step, [list(lengths) for lengths in LENGTHS], graph=True)
