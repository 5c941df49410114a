"""DCP over fp8 KV shards, shared by the CPU test (tests/unit/test_fp8_kv.py) and the single-GPU simulation
(tests/gpu/test_dcp_sim_gpu.py): each rank's cache holds value / scale in fp8, the current chunk stays in the
model dtype, and the group's output must equal float64 attention over the dequantized cache."""

from __future__ import annotations

import torch

from dcp_plugin import DcpAttention
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import ThreadGroup, run_threads, serial
from tests.helpers.kernel_checks import assert_matches


def fp8_round_trip(world: World, dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Make the world's K/V exactly what an fp8 cache can hold, so the float64 reference sees what every path sees
    (the cache dequantized, the current chunk in the model dtype)."""
    limit = torch.finfo(dtype).max
    for tensors, scale in ((world.keys, k_scale.double().item()), (world.values, v_scale.double().item())):
        for i, t in enumerate(tensors):
            tensors[i] = (t / scale).clamp(-limit, limit).to(dtype).double() * scale


def run_fp8_dcp(case: Case, n: int, dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor, kernel_ops,
                *, label: str) -> list[int]:
    """Every rank of ``case`` on its own thread over an fp8 cache (``kernel_ops``: the kernel namespace); each step
    (the case's first, then ``case.decode_steps`` decodes) gathered over the group and checked against float64.
    Returns each rank's checked steps."""
    world = World(case)
    fp8_round_trip(world, dtype, k_scale, v_scale)
    schedule = [[new for _, new in case.requests]] + [[1] * len(case.requests)] * case.decode_steps

    def rank_fn(rank, exchange):
        state = RankState.create(case, world, n, rank)
        to_fp8 = [(c / s).to(dtype) for c, s in ((state.key_cache, k_scale), (state.value_cache, v_scale))]
        group = ThreadGroup(exchange, rank) if n > 1 else None
        attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=group, scale=world.scale,
                                   comm=case.comm), kernel_ops=kernel_ops)
        group_heads = range(state.heads.group_q_head_start,
                            state.heads.group_q_head_start + state.heads.num_group_q_heads)
        for step, new_tokens in enumerate(schedule):
            q, k, v, batch, positions = state.step(new_tokens)
            out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
            attn.forward(q, k, v, *to_fp8, batch, out=out, k_scale=k_scale, v_scale=v_scale)
            got = group.all_gather(out, dim=1) if n > 1 else out
            want = torch.cat([world.causal_attention_f64(b, p, group_heads) for b, p in enumerate(positions)])
            assert_matches(got, want, q.dtype, f"{label} N={n} step {step}")
        return len(schedule)

    return run_threads(n, rank_fn, timeout_s=300)
