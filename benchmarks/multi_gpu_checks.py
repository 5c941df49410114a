"""Correctness part of multi_gpu_dcp.py: DCP attention over real process groups vs single-device attention.

Every rank derives the same random sequences from a case's seed (one CPU generator, so identical on all ranks),
stores the tokens its ``TokenLayout`` gives it in its own paged cache (shuffled pages, NaN where nothing was
written), and runs ``DcpAttention`` over its DCP subgroup. The outputs of all ranks are gathered with plain
``torch.distributed`` (every rank holds different Q heads, so together they hold all of them) and rank 0 compares
them with float64 causal attention over the full, unsharded sequences, written here in plain torch.

Kind ``decode-graph`` runs decode the way vLLM's full CUDA graphs would at DCP > 1: one step captured (collectives
included) after an eager warm-up, then later steps replayed after their inputs were copied into the captured
buffers and the batch rebuilt into a ``DcpBatchWorkspace``. On CPU (gloo) the capture is emulated by calling the
same closure again, which reads the same buffers and the same frozen host values, as a replay does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import dcp_plugin as dp


def _tolerances() -> dict:
    """The project's one tolerance table per dtype (tests/kernel_checks.py), loaded by path: the repository root
    on sys.path would shadow the installed dcp_plugin with its source folder."""
    path = Path(__file__).resolve().parents[1] / "tests" / "kernel_checks.py"
    spec = importlib.util.spec_from_file_location("dcp_kernel_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOLERANCES


TOLERANCES = _tolerances()

COMMS = ("ag_rs", "a2a")
LAYOUTS = ("tp", "group")
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


class Sequences:
    """A case's full random sequences, float64 holding values exact in the run's dtype (so the reference sees
    exactly the inputs), identical on every rank."""

    def __init__(self, seed: int, total_lens: list[int], q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._dtype, self.q_heads, self.head_dim = dtype, q_heads, head_dim
        self.keys = [self._rand(length, kv_heads, head_dim) for length in total_lens]
        self.values = [self._rand(length, kv_heads, head_dim) for length in total_lens]

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._gen, dtype=torch.float64).to(self._dtype).to(torch.float64)

    def queries(self, new_tokens: list[int]) -> list[torch.Tensor]:
        """All Q heads of one step's new tokens, ``[new_tokens[b], Q, D]`` per request (same call order on all
        ranks, so the same values)."""
        return [self._rand(t, self.q_heads, self.head_dim) for t in new_tokens]


class Shard:
    """This rank's paged cache of a case's sequences: shuffled pages, NaN wherever nothing was written."""

    def __init__(self, seqs: Sequences, contexts: list[int], total_lens: list[int], heads: dp.HeadLayout,
                 tokens: dp.TokenLayout, *, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        block, dim = tokens.block_size, seqs.head_dim
        pages = [-(-int(tokens.local_len(length)) // block) for length in total_lens]
        width = max(1, max(-(-tokens.max_local_len(length) // block) for length in total_lens))
        perm = torch.randperm(sum(pages) + 1, generator=torch.Generator().manual_seed(seed))
        self.table = torch.full((len(pages), width), int(perm[-1]), dtype=torch.int32)  # unused -> spare page
        start = 0
        for b, count in enumerate(pages):
            self.table[b, :count] = perm[start:start + count]
            start += count
        # K and V as strided halves of one buffer, as engines that pack them do.
        packed = torch.full((sum(pages) + 1, block, heads.num_kv_heads, 2 * dim), float("nan"), dtype=dtype,
                            device=device)
        self.key_cache, self.value_cache = packed[..., :dim], packed[..., dim:]
        self.seqs, self.tokens, self.dtype, self.device = seqs, tokens, dtype, device
        self.kv = slice(heads.kv_head_start, heads.kv_head_start + heads.num_kv_heads)
        self.lens = list(contexts)
        for b, ctx in enumerate(contexts):
            positions = torch.arange(ctx)
            mine = positions[tokens.owner(positions) == tokens.dcp_rank]
            slots = self._slots(b, mine)
            block_of, row = (slots // block).to(device), (slots % block).to(device)
            self.key_cache[block_of, row] = self._kv(self.seqs.keys[b][mine])
            self.value_cache[block_of, row] = self._kv(self.seqs.values[b][mine])

    def _kv(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.kv].to(self.dtype).to(self.device)

    def _slots(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        index = self.tokens.local_index(positions)
        block = self.tokens.block_size
        return self.table[request, index // block].long() * block + index % block

    def step(self, new_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], dp.DcpBatch]:
        """(k, v, positions per request, batch) of a step adding ``new_tokens[b]`` tokens to request ``b``."""
        positions = [torch.arange(self.lens[b], self.lens[b] + t) for b, t in enumerate(new_tokens)]
        k = torch.cat([self._kv(self.seqs.keys[b][p]) for b, p in enumerate(positions)])
        v = torch.cat([self._kv(self.seqs.values[b][p]) for b, p in enumerate(positions)])
        slots = []
        for b, p in enumerate(positions):
            request_slots = torch.full(p.shape, -1, dtype=torch.int64)  # -1: another rank owns the token
            mine = self.tokens.owner(p) == self.tokens.dcp_rank
            request_slots[mine] = self._slots(b, p[mine])
            slots.append(request_slots)
        self.lens = [length + t for length, t in zip(self.lens, new_tokens)]
        batch = dp.DcpBatch.build(
            query_start_loc=torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32,
                                         device=self.device),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32, device=self.device),
            block_table=self.table.to(self.device), slot_mapping=torch.cat(slots).to(self.device),
            tokens=self.tokens,
        )
        return k, v, positions, batch


class GraphStep:
    """One decode step of ``attn`` captured once and replayed on later steps (see the module docstring)."""

    def __init__(self, attn: dp.DcpAttention, shard: Shard) -> None:
        self.attn, self.shard, self.replay = attn, shard, None

    def run(self, q, k, v, batch: dp.DcpBatch) -> torch.Tensor:
        if self.replay is None:  # first step: persistent buffers, eager warm-up, capture
            self.inputs = {name: t.clone() for name, t in dict(
                q=q, k=k, v=v, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                slot_mapping=batch.slot_mapping, block_table=batch.block_table).items()}
            self.workspace = dp.DcpBatchWorkspace(batch.num_reqs, q.device)
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
            max_context_len=capacity - 1, workspace=self.workspace)


def causal_reference(seqs: Sequences, request: int, positions: torch.Tensor, q: torch.Tensor,
                     device: torch.device) -> torch.Tensor:
    """Float64 attention of ``q [T, Q, D]`` at ``positions`` to keys ``0..pos`` of the full sequence."""
    last = int(positions[-1]) + 1
    keys = seqs.keys[request][:last].to(device)  # [L, KV, D]
    values = seqs.values[request][:last].to(device)
    num_tokens, q_heads, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.to(device).view(num_tokens, kv_heads, q_heads // kv_heads, dim)  # Q head g reads KV g // q_per_kv
    scores = torch.einsum("tkgd,lkd->kgtl", grouped, keys) * dim**-0.5
    visible = torch.arange(last, device=device)[None, :] <= positions.to(device)[:, None]  # [T, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("kgtl,lkd->tkgd", probs, values).reshape(num_tokens, q_heads, dim)


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict:
    """Errors of ``got`` vs the float64 ``want``; passes when no NaN and every element is within the dtype's
    ``atol + rtol * |want|``. ``max_rel_err`` is the largest error relative to the largest reference value."""
    atol, rtol = TOLERANCES[dtype]
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
    ps = dp.ParallelState.from_tp(tp_rank=rank, tp_size=world, dcp_size=case.dcp)
    q_heads, kv_heads = model_heads(case.layout, world, case.dcp, sizes.local_q_heads)
    heads = dp.HeadLayout.create(total_q_heads=q_heads, total_kv_heads=kv_heads, ps=ps, kv_replication=case.layout)
    tokens = dp.TokenLayout(dcp_size=case.dcp, dcp_rank=ps.attn_dcp_rank, block_size=sizes.block_size)
    requests = sizes.prefill if case.kind == "prefill" else sizes.decode
    if case.kind == "decode-graph":
        steps = [[1] * len(requests)] * GRAPH_STEPS
    else:
        steps = [[new for _, new in requests]] + ([[1] * len(requests)] if case.kind == "prefill" else [])
    contexts = [ctx for ctx, _ in requests]
    total_lens = [ctx + sum(step[b] for step in steps) for b, ctx in enumerate(contexts)]
    seqs = Sequences(case.seed, total_lens, q_heads, kv_heads, sizes.head_dim, dtype)
    shard = Shard(seqs, contexts, total_lens, heads, tokens, dtype=dtype, device=device, seed=case.seed + rank)
    attn = dp.DcpAttention(heads=heads, tokens=tokens, group=groups[case.dcp], scale=sizes.head_dim**-0.5,
                           comm=case.comm, ops=ops)
    mine = slice(heads.q_head_start, heads.q_head_start + heads.num_q_heads)
    graph = GraphStep(attn, shard) if case.kind == "decode-graph" else None
    result = None
    for new_tokens in steps:
        queries = seqs.queries(new_tokens)
        k, v, positions, batch = shard.step(new_tokens)
        q = torch.cat(queries)[:, mine].to(dtype).to(device)
        if graph is not None:
            out = graph.run(q, k, v, batch)
        else:
            out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
            attn.forward(q, k, v, shard.key_cache, shard.value_cache, batch, out=out)
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out)  # TP rank r holds Q heads [r * local_q, (r + 1) * local_q)
        if rank == 0:
            want = torch.cat([causal_reference(seqs, b, p, queries[b], device) for b, p in enumerate(positions)])
            result = worst(result, compare(torch.cat(parts, dim=1), want, dtype))
    if rank == 0:
        return dict(case=case.name(world), tp=world, dcp=case.dcp, layout=case.layout, comm=case.comm,
                    kind=case.kind, q_heads=q_heads, kv_heads=kv_heads, steps=len(steps), **result)
    return None
