"""The CPU twin of tests/gpu/test_decode_graph_gpu.py: a decode step and a speculative verify step (1 + k rows per
request) prepared once and replayed after the inputs, the workspace, the request count and the contexts change,
under the interpreter (the replay re-runs the capture's prepared launches; see tests/helpers/graph_replay.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.graph_replay import Step, check_replays


@pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "verify-k2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_step_prepared_once_replays_on_later_steps(dtype, query_len):
    step = Step(device="cpu", dtype=dtype, reqs=3, pages_per_req=8, query_len=query_len, heads=(4, 2), head_dim=16,
                block_size=4)
    check_replays(step, [[32, 5, 11], [7, 30], [3]], graph=False)
