"""Regression for the seeds' bug class (SGLang #34161, GSM8K 0.95 -> 0.77): the current chunk must use the KV
heads its local Q heads map to, with no communication and no K/V slicing. Kept forever.

TP4/DCP4 with 32 Q / 2 KV heads in the group layout: every rank stores KV heads 0 and 1, rank r holds Q heads
8r..8r+7, so ranks 0-1 read KV head 0 only and ranks 2-3 KV head 1 only in the current chunk. The four ranks run
as threads of this process; the group below counts collectives and moves real tensors between them.
"""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import DcpAttention
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import ThreadGroup, run_threads, serial
from tests.helpers.kernel_checks import assert_matches

N = 4
FRESH = ((0, 5), (0, 1), (0, 3))  # no cached prefix anywhere: the current chunk is the whole answer
MIXED = ((0, 5), (9, 1), (14, 4), (2, 2))  # fresh prompt, decode, chunked prefill on a prefix, context < N
_COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_to_all")
COLLECTIVES = {"ag_rs": ["all_gather", "all_gather", "reduce_scatter"], "a2a": ["all_gather", "all_to_all"]}
def _seed_case(requests, comm: str, kernels: str) -> Case:
    return Case(name="seed", q_heads=32, kv_heads=2, kv_replication="replicated", tp=4, block_size=4, head_dim=64,
                requests=requests, comm=comm, kernel_impl=kernels, seed=34161)


def _forward(case: Case, poison_kv_head: dict[int, int] | None = None):
    """Run one step on the four ranks; returns per rank (log, k, v, heads, out, want) with the step's k/v poisoned
    with NaN in KV head ``poison_kv_head[rank]``."""
    world = World(case)

    def rank_fn(rank, exchange):
        state = RankState.create(case, world, N, rank)
        log = []
        group = ThreadGroup(exchange, rank, log=log)
        attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=group, scale=world.scale,
                                   comm=case.comm, kernel_impl=case.kernel_impl), log)
        q, k, v, batch, positions = state.step([new for _, new in case.requests])
        if poison_kv_head and rank in poison_kv_head:
            k[:, poison_kv_head[rank]] = float("nan")
            v[:, poison_kv_head[rank]] = float("nan")
        out = attn.forward(q, k, v, state.key_cache, state.value_cache, batch,
                           out=torch.full(q.shape, float("nan"), dtype=q.dtype))
        local = range(state.heads.q_head_start, state.heads.q_head_start + state.heads.num_q_heads)
        want = torch.cat([world.causal_attention_f64(b, p, local) for b, p in enumerate(positions)])
        return log, k, v, state.heads, out, want

    return run_threads(N, rank_fn)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_fresh_prompts_issue_no_collective(comm, kernels):
    for rank, (log, _, _, _, out, want) in enumerate(_forward(_seed_case(FRESH, comm, kernels))):
        assert [e for e in log if isinstance(e, str)] == [], f"rank {rank} communicated: {log}"
        assert_matches(out, want, torch.float32, f"rank {rank}")


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_current_chunk_takes_full_kv_and_global_head_map(comm, kernels):
    for rank, (log, k, v, heads, out, want) in enumerate(_forward(_seed_case(MIXED, comm, kernels))):
        names = [e if isinstance(e, str) else e[0] for e in log]
        chunk = names.index("chunk_attention")
        assert "all_gather" not in names[:chunk], f"rank {rank}: a collective before the current chunk: {names}"
        assert [n for n in names if n in _COLLECTIVE_NAMES] == COLLECTIVES[comm], f"rank {rank}: {names}"
        _, tensors, kwargs = log[chunk]
        assert tensors[1] is k and tensors[2] is v, f"rank {rank}: the current chunk got sliced or copied K/V"
        assert (kwargs["q_head_start"], kwargs["q_per_kv"], kwargs["kv_head_start"]) == (8 * rank, 16, 0)
        assert heads.current_chunk_kv == ((0, 1) if rank < 2 else (1, 2))
        assert_matches(out, want, torch.float32, f"rank {rank}")


@pytest.mark.parametrize("requests", [FRESH, MIXED], ids=["fresh", "mixed"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_current_chunk_never_reads_the_other_kv_head(requests, comm):
    # Ranks 0-1 read KV head 0 only, ranks 2-3 KV head 1 only: NaN in the head a rank must not read changes nothing.
    results = _forward(_seed_case(requests, comm, "reference"), poison_kv_head={0: 1, 1: 1, 2: 0, 3: 0})
    for rank, (_, _, _, _, out, want) in enumerate(results):
        assert_matches(out, want, torch.float32, f"rank {rank} with its unused KV head poisoned")


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_poisoning_the_head_a_rank_reads_is_detected(comm):
    # The converse, so the test above can fail: rank 1 reads KV head 0, rank 2 reads KV head 1.
    results = _forward(_seed_case(MIXED, comm, "reference"), poison_kv_head={1: 0, 2: 1})
    for rank in (1, 2):
        out, want = results[rank][4].double(), results[rank][5]
        # NaN keys make the rows that read them NaN (never a finite wrong answer), so the poison shows.
        assert torch.isnan(out).any(), f"rank {rank} ignored its own KV head"
    for rank in (0, 3):
        assert_matches(results[rank][4], results[rank][5], torch.float32, f"rank {rank}")
