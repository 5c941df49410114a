"""Decode steps as an engine runs them: every step's batch tensors copied into the same persistent buffers, so
``DcpAttention`` may replay the last decode step's plan (``dcp_plugin.step_plan.decode_signature``). The runner checks
every step against float64 causal attention and reports how many plans were prepared. Used by the CPU suite
(``tests/unit/test_decode_plan_reuse.py``) and the GPU tier (``tests/gpu/test_decode_plan_reuse_gpu.py``)."""

from __future__ import annotations

import torch

from dcp_plugin import DcpAttention, DcpBatch, DcpBatchBuffers
from dcp_plugin.step_plan import decode_bound
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import ThreadGroup, serial
from tests.helpers.kernel_checks import assert_matches


class EngineBuffers:
    """An engine's persistent step tensors (as vLLM keeps them): every step's values copied into the same memory."""

    def __init__(self, state: RankState, num_reqs: int) -> None:
        device = state.block_table.device
        self.state = state
        self.query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(num_reqs, dtype=torch.int64, device=device)
        self.derived = DcpBatchBuffers(num_reqs, device)

    def decode_step(self):
        """The harness's next decode step (one token per request), its batch rebuilt over these buffers."""
        q, k, v, fresh, positions = self.state.step([1] * self.seq_lens.shape[0])
        for mine, theirs in ((self.query_start_loc, fresh.query_start_loc), (self.seq_lens, fresh.seq_lens),
                             (self.slot_mapping, fresh.slot_mapping)):
            mine.copy_(theirs)
        batch = DcpBatch.build(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                               block_table=self.state.block_table, slot_mapping=self.slot_mapping,
                               tokens=self.state.tokens, buffers=self.derived, max_query_len=1,
                               max_seq_len=max(self.state.lens), max_context_len=max(self.state.lens) - 1)
        return q, k, v, batch, positions


def counted(attn: DcpAttention) -> list:
    """``attn`` with every plan it prepares counted: the returned list gets one entry per new plan."""
    made, inner = [], attn._plan

    def plan(*args, **kwargs):
        made.append(1)
        return inner(*args, **kwargs)

    attn._plan = plan
    return made


def run_steady_decode(case: Case, n: int, rank: int, exchange) -> tuple[int, int]:
    """``case.decode_steps + 1`` decode steps on this rank over persistent buffers, each output (gathered over the
    group) checked against float64, and the prefix pass of each planned for a bound covering its shards. Returns
    (plans prepared, distinct bounds)."""
    world = World(case)
    state = RankState.create(case, world, n, rank)
    log: list = []
    attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, scale=world.scale, comm=case.comm,
                               kernel_impl=case.kernel_impl, group=ThreadGroup(exchange, rank) if n > 1 else None), log)
    made = counted(attn)
    engine = EngineBuffers(state, len(case.requests))
    heads = state.heads
    group_heads = range(heads.group_q_head_start, heads.group_q_head_start + heads.num_group_q_heads)
    bounds = set()
    for step in range(case.decode_steps + 1):
        q, k, v, batch, positions = engine.decode_step()
        bounds.add(decode_bound(batch))
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        del log[:]
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        (paged,) = [kwargs for name, _, kwargs in log if name == "prefix_attention"]
        assert batch.max_local_seq_len <= paged["max_kv_len"] == decode_bound(batch), f"step {step}"
        got = out if n == 1 else torch.cat(exchange.swap(rank, out), dim=1)
        want = torch.cat([world.causal_attention_f64(b, p, group_heads) for b, p in enumerate(positions)])
        assert_matches(got, want, q.dtype, f"{case.name} rank {rank} step {step}")
    state.check_cache()
    return len(made), len(bounds)
