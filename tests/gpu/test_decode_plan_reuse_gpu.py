"""Steady decoding on the GPU's own decode path (balanced splits, a split pass whose last split may merge, 64-token
pages): decode steps over persistent buffers replay the last step's plan until the longest shard passes its bound, and
every step matches float64 (``tests/helpers/steady_decode.py``), at DCP = 1 and 2, both comm modes, bf16, head size
128."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import step_plan
from dcp_plugin.testing import Case
from tests.helpers.dcp_harness import run_threads
from tests.helpers.steady_decode import run_steady_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Contexts of 1-3.3K tokens, 40 decode steps: with bounds every 64 tokens the longest shard passes one or two.
REQUESTS = tuple((ctx, 1) for ctx in (3300, 17, 1000, 2500, 64, 640, 1, 2047, 3000, 129, 900, 5, 1500, 2200, 30, 777))


@pytest.mark.parametrize("heads", [(32, 8), (16, 1)], ids=["32q-8kv", "16q-1kv"])
@pytest.mark.parametrize("n, comm", [(1, "ag_rs"), (2, "ag_rs"), (2, "a2a")])
def test_steady_decoding_replays_its_plan_and_stays_exact(monkeypatch, n, comm, heads):
    monkeypatch.setattr(step_plan, "DECODE_BOUND_STEP", 64)
    case = Case(name=f"steady-N{n}-{comm}", q_heads=heads[0], kv_heads=heads[1], block_size=64, head_dim=128,
                requests=REQUESTS, comm=comm, dtype="bfloat16", kernel_impl="triton", decode_steps=40, seed=11,
                device="cuda")
    results = run_threads(n, lambda rank, exchange: run_steady_decode(case, n, rank, exchange), timeout_s=300)
    made, distinct = results[0]
    assert 1 < distinct < case.decode_steps + 1
    assert results == [(distinct, distinct)] * n
