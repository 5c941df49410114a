"""Checking a DCP path against one-rank attention, as ``torch.testing`` checks tensors: float64 attention written from
first principles, the tolerance an output is held to by dtype, a case's sequences (every rank derives the same ones
from its seed) with every rank's sharded paged cache built from them, and a stand-in DCP group.

The test suite and the benchmarks that check what they run (``benchmarks/dcp/multi_gpu_checks.py``, DCP over real
process groups) share it. It needs torch and the core's public names only: no engine, nothing of ``tests/``; the core
never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dcp_plugin import DcpBatch, HeadLayout, ParallelState, TokenLayout

# |actual - expected| <= atol + rtol * |expected|, by the lowest-precision dtype a kernel reads or writes.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),  # fp16 rounding of P before P @ V and of the stored output
    torch.bfloat16: (1.6e-2, 1.6e-2),  # same, with bf16's 8-bit mantissa
}


def causal_attention_f64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, *,
                         scale: float, q_per_kv: int, q_head_start: int = 0) -> torch.Tensor:
    """The one float64 oracle of causal attention, from first principles.

    ``q``: ``[T, H, D]``, the queries at sequence ``positions`` ``[T]`` of global Q heads ``q_head_start ..
    q_head_start + H - 1``; ``keys``/``values``: ``[L, KV, D]``, the whole sequence (every KV head). Query ``t``
    sees keys ``0 .. positions[t]``; global Q head ``g`` reads KV head ``g // q_per_kv``. Returns ``[T, H, D]``.
    """
    last = int(positions.max()) + 1
    visible = torch.arange(last, device=q.device)[None, :] <= positions.to(q.device)[:, None]  # [T, L]
    return attention_f64(q, keys, values, visible, scale=scale, q_per_kv=q_per_kv, q_head_start=q_head_start)


def attention_f64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, *, scale: float,
                  q_per_kv: int, q_head_start: int = 0) -> torch.Tensor:
    """Float64 attention of queries ``q`` ``[T, H, D]`` to the keys ``visible`` ``[T, L]`` shows each of them, among
    the sequence's first ``L`` (``keys``/``values`` ``[>= L, KV, D]``); heads as in ``causal_attention_f64``."""
    last = visible.shape[1]
    kv = torch.arange(q_head_start, q_head_start + q.shape[1], device=q.device) // q_per_kv
    k, v = keys[:last][:, kv].double(), values[:last][:, kv].double()  # [L, H, D]
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    probs = torch.softmax(scores.masked_fill(~visible.to(q.device), float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)


def shuffled_block_table(pages: list[int], *, generator: torch.Generator, width: int | None = None,
                         first_page: int = 0, fill: int | None = None, device=None) -> torch.Tensor:
    """An int32 block table ``[len(pages), width]`` (default width ``max(pages) + 1``) in which request ``b`` owns
    ``pages[b]`` distinct pages of ``first_page .. first_page + sum(pages) - 1``, in a random order (so page order
    and table order never agree by accident). Unused entries hold ``fill`` (default: the page after all of them,
    a spare the caller allocates and never reads)."""
    total = sum(pages)
    order = torch.randperm(total, generator=generator, device=device or generator.device).to(torch.int32) + first_page
    fill = first_page + total if fill is None else fill
    table = torch.full((len(pages), width or max(pages, default=0) + 1), fill, dtype=torch.int32, device=order.device)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start:start + count]
        start += count
    return table


@dataclass(frozen=True)
class Case:
    """One DCP configuration; ``requests`` are ``(cached context, new tokens)`` of the first step, then
    ``decode_steps`` steps add one token to every request."""

    name: str
    q_heads: int
    kv_heads: int
    kv_replication: str = "replicated"
    tp: int = 0  # 0: tp = dcp size
    group_index: int = 0  # which DCP group of the TP group the ranks play
    interleave: int = 1
    block_size: int = 4
    head_dim: int = 16
    requests: tuple[tuple[int, int], ...] = ((5, 1),)
    comm: str = "ag_rs"
    dtype: str = "float32"
    kernel_impl: str = "reference"  # DcpAttention(kernel_impl=...): "reference" or "triton"
    decode_steps: int = 0
    seed: int = 0
    device: str = "cpu"  # where the sequences, caches and batches live ("cuda" on the GPU tier)

    def layouts(self, n: int, rank: int) -> tuple[HeadLayout, TokenLayout]:
        tp = self.tp or n
        parallel = ParallelState.from_tp(tp_rank=self.group_index * n + rank, tp_size=tp, dcp_size=n)
        heads = HeadLayout.create(total_q_heads=self.q_heads, total_kv_heads=self.kv_heads, parallel=parallel,
                                  kv_replication=self.kv_replication)
        return heads, TokenLayout(dcp_size=n, dcp_rank=rank, interleave=self.interleave, block_size=self.block_size)


class World:
    """The full sequences of a case (every rank derives the same ones from the seed), in float64."""

    def __init__(self, case: Case) -> None:
        device = torch.device(case.device)
        gen = torch.Generator(device=device).manual_seed(case.seed)
        dtype = getattr(torch, case.dtype)
        self.total_lens = [ctx + new + case.decode_steps for ctx, new in case.requests]

        def rand(*shape):  # values exactly representable in the case dtype, so the reference sees the inputs
            return torch.randn(*shape, generator=gen, dtype=torch.float64, device=device).to(dtype).to(torch.float64)

        self.keys = [rand(length, case.kv_heads, case.head_dim) for length in self.total_lens]
        self.values = [rand(length, case.kv_heads, case.head_dim) for length in self.total_lens]
        self.queries = [rand(length, case.q_heads, case.head_dim) for length in self.total_lens]
        self.q_per_kv = case.q_heads // case.kv_heads
        self.scale = case.head_dim**-0.5

    def causal_attention_f64(self, request: int, positions: torch.Tensor, q_heads: range) -> torch.Tensor:
        """Single-rank attention of the queries at ``positions`` (global Q heads ``q_heads``) to keys ``0..pos``."""
        q = self.queries[request][positions][:, q_heads.start:q_heads.stop]  # [T, H, D]
        return causal_attention_f64(q, self.keys[request], self.values[request], positions, scale=self.scale,
                                    q_per_kv=self.q_per_kv, q_head_start=q_heads.start)

    def tree_attention_f64(self, request: int, positions: torch.Tensor, tree: torch.Tensor,
                           q_heads: range) -> torch.Tensor:
        """Single-rank attention of a verify step's new tokens at ``positions`` (consecutive, after the request's
        cached context) whose ``tree`` ``[T, T]`` says which of them each sees: every cached token and those."""
        context = int(positions[0])
        visible = torch.zeros(len(positions), context + len(positions), dtype=torch.bool)
        visible[:, :context] = True
        visible[:, context:] = tree
        q = self.queries[request][positions][:, q_heads.start:q_heads.stop]
        return attention_f64(q, self.keys[request], self.values[request], visible, scale=self.scale,
                             q_per_kv=self.q_per_kv, q_head_start=q_heads.start)


@dataclass
class RankState:
    """One rank's sharded paged cache (shuffled pages, poisoned with NaN where nothing was written)."""

    case: Case
    world: World
    heads: HeadLayout
    tokens: TokenLayout
    block_table: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    lens: list[int] = field(default_factory=list)  # tokens of each request already in the (global) cache

    @classmethod
    def create(cls, case: Case, world: World, n: int, rank: int) -> RankState:
        heads, tokens = case.layouts(n, rank)
        block = case.block_size
        pages = [-(-int(tokens.local_len(length)) // block) for length in world.total_lens]
        width = max(1, max(-(-tokens.max_local_len(length) // block) for length in world.total_lens))
        num_pages = sum(pages) + 2  # the first and the last never hold data; unused table entries point at the last
        block_table = shuffled_block_table(
            pages, generator=torch.Generator().manual_seed(case.seed * 131 + rank), width=width, first_page=1)
        # K and V as strided halves of one buffer, like engines that pack them.
        dtype = getattr(torch, case.dtype)
        packed = torch.full((num_pages, block, heads.num_kv_heads, 2 * case.head_dim), float("nan"), dtype=dtype,
                            device=case.device)
        state = cls(case, world, heads, tokens, block_table.to(case.device), packed[..., :case.head_dim],
                    packed[..., case.head_dim:], [ctx for ctx, _ in case.requests])
        for b, (ctx, _) in enumerate(case.requests):
            positions = torch.arange(ctx)
            state._store(b, positions[tokens.owner(positions) == tokens.dcp_rank])
        return state

    def _kv_slice(self) -> slice:
        return slice(self.heads.kv_head_start, self.heads.kv_head_start + self.heads.num_kv_heads)

    def _local_slots(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        index = self.tokens.local_index(positions.to(self.block_table.device))
        return self.block_table[request, index // self.case.block_size].long() * self.case.block_size \
            + index % self.case.block_size

    def _store(self, request: int, positions: torch.Tensor) -> None:
        slots = self._local_slots(request, positions)
        page, row = slots // self.case.block_size, slots % self.case.block_size
        dtype = self.key_cache.dtype
        self.key_cache[page, row] = self.world.keys[request][positions][:, self._kv_slice()].to(dtype)
        self.value_cache[page, row] = self.world.values[request][positions][:, self._kv_slice()].to(dtype)

    def step(self, new_tokens: list[int], chunk_mask: torch.Tensor | None = None):
        """Inputs of one step adding ``new_tokens[b]`` tokens to request ``b``: (q, k, v, batch, positions).
        ``chunk_mask``: the batch's (``DcpBatch.build``)."""
        dtype = getattr(torch, self.case.dtype)
        heads, kv = self.heads, self._kv_slice()
        q_heads = slice(heads.q_head_start, heads.q_head_start + heads.num_q_heads)
        positions = [torch.arange(self.lens[b], self.lens[b] + t) for b, t in enumerate(new_tokens)]
        q = torch.cat([self.world.queries[b][p][:, q_heads] for b, p in enumerate(positions)]).to(dtype)
        k = torch.cat([self.world.keys[b][p][:, kv] for b, p in enumerate(positions)]).to(dtype)
        v = torch.cat([self.world.values[b][p][:, kv] for b, p in enumerate(positions)]).to(dtype)
        device = self.block_table.device
        slots = []
        for b, p in enumerate(positions):
            mine = self.tokens.owner(p) == self.tokens.dcp_rank
            request_slots = torch.full(p.shape, -1, dtype=torch.int64, device=device)
            request_slots[mine.to(device)] = self._local_slots(b, p[mine])
            slots.append(request_slots)
        self.lens = [length + t for length, t in zip(self.lens, new_tokens)]
        batch = DcpBatch.build(
            query_start_loc=torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32,
                                         device=device),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32, device=device),
            block_table=self.block_table,
            slot_mapping=torch.cat(slots),
            tokens=self.tokens,
            chunk_mask=None if chunk_mask is None else chunk_mask.to(device),
        )
        return q, k, v, batch, positions

    def check_cache(self) -> None:
        """Every token this rank owns so far sits at its slot, bit for bit."""
        for b, length in enumerate(self.lens):
            positions = torch.arange(length)
            mine = positions[self.tokens.owner(positions) == self.tokens.dcp_rank]
            slots = self._local_slots(b, mine)
            page, row = slots // self.case.block_size, slots % self.case.block_size
            want = self.world.keys[b][mine][:, self._kv_slice()].to(self.key_cache.dtype)
            assert torch.equal(self.key_cache[page, row], want), f"{self.case.name}: key cache of request {b} differs"
            want = self.world.values[b][mine][:, self._kv_slice()].to(self.value_cache.dtype)
            assert torch.equal(self.value_cache[page, row], want), f"{self.case.name}: value cache of request {b}"


class ShapeOnlyGroup:
    """Collectives with the right output shapes whose values mean nothing: rank ``rank`` of ``n`` alone, for meta
    tensors (forward must not read a value) and for timing one rank's local work (each collective is one copy)."""

    def __init__(self, n: int, rank: int) -> None:
        self.world_size, self.rank_in_group = n, rank

    def all_gather(self, t, dim):
        return torch.cat([t] * self.world_size, dim=dim)

    def reduce_scatter(self, t, dim):
        return t.chunk(self.world_size, dim=dim)[self.rank_in_group].clone()

    def all_to_all(self, t):
        return t.clone()
