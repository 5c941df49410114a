"""Correctness part of multi_gpu_dcp.py: DCP attention over real process groups vs single-device attention.

The sequences, every rank's sharded paged cache (shuffled pages, NaN where nothing was written) and the float64 causal
reference come from ``dcp_plugin.testing``, as in the test suite's DCP checks: every rank derives the same sequences
from a case's seed and runs ``DcpAttention`` over its DCP subgroup. The outputs of all ranks are gathered with plain
``torch.distributed`` (every rank holds different Q heads, so together they hold all of them) and rank 0 compares them
with the reference; this module adds the cases of a multi-GPU run and its JSON report.

Kind ``decode-graph`` runs decode the way vLLM's full CUDA graphs would at DCP > 1: one step captured (collectives
included) after an eager warm-up, then later steps replayed after their inputs were copied into the captured
buffers and the batch rebuilt into ``DcpBatchBuffers``. On CPU (gloo) the capture is emulated by calling the
same closure again, which reads the same buffers and the same frozen host values, as a replay does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import dcp_plugin as dp
from dcp_plugin import testing

COMMS = ("ag_rs", "a2a")
LAYOUTS = ("tp", "replicated")
KINDS = ("decode", "prefill", "decode-graph")
GRAPH_STEPS = 3  # decode-graph: the eager warm-up step, then two replays


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Shapes of one run. ``decode``/``prefill`` are ``(cached context, new tokens)`` per request of a step."""

    head_dim: int
    block_size: int
    local_q_heads: int
    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...]


# Decode: a one-token fresh prompt, contexts shorter than the group (empty shards), long ones.
# Prefill: chunks continuing a cached prefix, a fresh prompt, a prefix shorter than the group; then one decode step.
GPU_SIZES = Sizes(head_dim=128, block_size=16, local_q_heads=8,
                  decode=((0, 1), (1, 1), (5, 1), (1000, 1), (8191, 1), (20000, 1)),
                  prefill=((1000, 257), (0, 300), (4096, 64), (3, 17)))
CPU_SIZES = Sizes(head_dim=64, block_size=4, local_q_heads=2,
                  decode=((0, 1), (1, 1), (5, 1), (33, 1)),
                  prefill=((9, 4), (0, 6), (20, 7), (1, 3)))


@dataclass(frozen=True, kw_only=True)
class Case:
    dcp: int
    layout: str
    comm: str
    kind: str
    seed: int

    def name(self, world: int) -> str:
        return f"tp{world}-dcp{self.dcp}-{self.layout}-{self.comm}-{self.kind}"


def dcp_splits(world: int) -> list[int]:
    """DCP = world, plus every TP x DCP split (DCP groups of consecutive ranks) when world >= 4."""
    return [world] + ([d for d in range(world - 1, 1, -1) if world % d == 0] if world >= 4 else [])


def all_cases(world: int) -> list[Case]:
    combos = [(d, layout, comm, kind) for d in dcp_splits(world) for layout in LAYOUTS for comm in COMMS
              for kind in KINDS]
    return [Case(dcp=d, layout=layout, comm=comm, kind=kind, seed=1000 + i)
            for i, (d, layout, comm, kind) in enumerate(combos)]


def model_heads(layout: str, world: int, dcp: int, local_q: int) -> tuple[int, int]:
    """(Q heads, KV heads) of the case's model at TP = world. ``tp``: vLLM's shape, one KV head per DCP group;
    ``group``: 2 KV heads replicated inside every DCP group."""
    q_heads = local_q * world
    if layout == "tp":
        return q_heads, world // dcp
    return q_heads, 2 if q_heads % 2 == 0 else 1


class GraphStep:
    """One decode step of ``attn`` captured once and replayed on later steps (see the module docstring)."""

    def __init__(self, attn: dp.DcpAttention, shard: testing.RankState) -> None:
        self.attn, self.shard, self.replay = attn, shard, None

    def run(self, q, k, v, batch: dp.DcpBatch) -> torch.Tensor:
        if self.replay is None:  # first step: persistent buffers, eager warm-up, capture
            self.inputs = {name: t.clone() for name, t in dict(
                q=q, k=k, v=v, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                slot_mapping=batch.slot_mapping, block_table=batch.block_table).items()}
            self.workspace = dp.DcpBatchBuffers(batch.num_reqs, q.device)
            self.out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
            captured = self._build()
            step = lambda: self.attn.forward(self.inputs["q"], self.inputs["k"], self.inputs["v"],  # noqa: E731
                                             self.shard.key_cache, self.shard.value_cache, captured, out=self.out)
            step()  # the eager warm-up computes this step (compiles kernels, initialises the communicators)
            self.replay = step
            if q.device.type == "cuda":
                torch.cuda.synchronize()
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    step()
                self.replay = cuda_graph.replay
            return self.out.clone()
        for name, t in dict(q=q, k=k, v=v, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                            slot_mapping=batch.slot_mapping).items():
            self.inputs[name].copy_(t)
        self._build()  # the engine's per-step build, outside the graph: refreshes the workspace in place
        self.out.fill_(float("nan"))
        self.replay()
        return self.out.clone()

    def _build(self) -> dp.DcpBatch:
        # Host bounds at the block table's capacity, as the vLLM builder passes them under full graphs.
        tokens, table = self.shard.tokens, self.inputs["block_table"]
        capacity = table.shape[1] * tokens.block_size * tokens.dcp_size
        return dp.DcpBatch.build(
            query_start_loc=self.inputs["query_start_loc"], seq_lens=self.inputs["seq_lens"], block_table=table,
            slot_mapping=self.inputs["slot_mapping"], tokens=tokens, max_query_len=1, max_seq_len=capacity,
            max_context_len=capacity - 1, buffers=self.workspace)


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict:
    """Errors of ``got`` vs the float64 ``want``; passes when no NaN and every element is within the dtype's
    ``atol + rtol * |want|``. ``max_rel_err`` is the largest error relative to the largest reference value."""
    atol, rtol = testing.TOLERANCES[dtype]
    got, want = got.to(torch.float64), want.to(got.device, torch.float64)
    nan_count = int(torch.isnan(got).sum())
    err = (got - want).abs().nan_to_num(nan=float("inf"))
    max_abs = float(err.max())
    return dict(max_abs_err=max_abs, max_rel_err=max_abs / max(float(want.abs().max()), 1e-30),
                tol_ratio=float((err / (atol + rtol * want.abs())).max()), nan_count=nan_count,
                passed=nan_count == 0 and bool((err <= atol + rtol * want.abs()).all()))


def worst(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return dict(max_abs_err=max(a["max_abs_err"], b["max_abs_err"]), max_rel_err=max(a["max_rel_err"],
                b["max_rel_err"]), tol_ratio=max(a["tol_ratio"], b["tol_ratio"]),
                nan_count=a["nan_count"] + b["nan_count"], passed=a["passed"] and b["passed"])


def run_case(case: Case, *, sizes: Sizes, groups: dict, rank: int, world: int, dtype: torch.dtype,
             device: torch.device, ops) -> dict | None:
    """Run every step of ``case`` on this rank; rank 0 returns the worst errors over the steps, others None."""
    q_heads, kv_heads = model_heads(case.layout, world, case.dcp, sizes.local_q_heads)
    requests = sizes.prefill if case.kind == "prefill" else sizes.decode
    decode_steps = {"decode": 0, "prefill": 1, "decode-graph": GRAPH_STEPS - 1}[case.kind]  # after the first step
    spec = testing.Case(
        name=case.name(world), q_heads=q_heads, kv_heads=kv_heads, kv_replication=case.layout, tp=world,
        group_index=rank // case.dcp, block_size=sizes.block_size, head_dim=sizes.head_dim, requests=requests,
        comm=case.comm, dtype=str(dtype).removeprefix("torch."), decode_steps=decode_steps, seed=case.seed,
        device=str(device),
    )
    sequences = testing.World(spec)
    shard = testing.RankState.create(spec, sequences, case.dcp, rank % case.dcp)
    attn = dp.DcpAttention(heads=shard.heads, tokens=shard.tokens, group=groups[case.dcp], scale=sequences.scale,
                           comm=case.comm, kernel_impl=ops)
    graph = GraphStep(attn, shard) if case.kind == "decode-graph" else None
    steps = [[new for _, new in requests]] + [[1] * len(requests)] * decode_steps
    result = None
    for new_tokens in steps:
        q, k, v, batch, positions = shard.step(new_tokens)
        if graph is not None:
            out = graph.run(q, k, v, batch)
        else:
            out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
            attn.forward(q, k, v, shard.key_cache, shard.value_cache, batch, out=out)
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out)  # TP rank r holds Q heads [r * local_q, (r + 1) * local_q)
        if rank == 0:
            want = torch.cat([sequences.causal_attention_f64(b, p, range(q_heads))
                              for b, p in enumerate(positions)])
            result = worst(result, compare(torch.cat(parts, dim=1), want, dtype))
    shard.check_cache()  # every owned token at its slot, bit for bit (raises otherwise)
    if rank == 0:
        return dict(case=case.name(world), tp=world, dcp=case.dcp, layout=case.layout, comm=case.comm,
                    kind=case.kind, q_heads=q_heads, kv_heads=kv_heads, steps=len(steps), **result)
    return None
