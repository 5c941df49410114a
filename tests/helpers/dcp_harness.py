"""What the DCP core tests share: one global random sequence set per case, every rank's sharded paged cache built
from it, a float64 causal-attention reference written from first principles, and a per-rank case runner.

A case is plain data (picklable) so spawned processes can rebuild everything from it and its seed alone.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dcp_plugin import DcpAttention, DcpBatch, HeadLayout, ParallelState, TokenLayout
from tests.helpers import kernel_checks
from tests.helpers.kernel_checks import assert_matches

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


def causal_attention_f64(world: World, request: int, positions: torch.Tensor, q_heads: range) -> torch.Tensor:
    """Single-rank attention of the queries at ``positions`` (global Q heads ``q_heads``) to keys ``0..pos``."""
    q = world.queries[request][positions][:, q_heads.start:q_heads.stop]  # [T, H, D]
    return kernel_checks.causal_attention_f64(q, world.keys[request], world.values[request], positions,
                                              scale=world.scale, q_per_kv=world.q_per_kv, q_head_start=q_heads.start)


def tree_attention_f64(world: World, request: int, positions: torch.Tensor, tree: torch.Tensor,
                       q_heads: range) -> torch.Tensor:
    """Single-rank attention of a verify step's new tokens at ``positions`` (consecutive, after the request's
    cached context) whose ``tree`` ``[T, T]`` says which of them each sees: every cached token and those."""
    context = int(positions[0])
    visible = torch.zeros(len(positions), context + len(positions), dtype=torch.bool)
    visible[:, :context] = True
    visible[:, context:] = tree
    q = world.queries[request][positions][:, q_heads.start:q_heads.stop]
    return kernel_checks.attention_f64(q, world.keys[request], world.values[request], visible, scale=world.scale,
                                       q_per_kv=world.q_per_kv, q_head_start=q_heads.start)


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
        block_table = kernel_checks.shuffled_block_table(
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


def run_case(case: Case, n: int, rank: int, group, gather_heads: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Run every step of ``case`` on this rank and check the group's gathered output against the float64 reference
    (identical on every rank, so every rank fails at the same point). Returns the number of checked steps."""
    world = World(case)
    state = RankState.create(case, world, n, rank)
    heads = state.heads
    attn = serial(DcpAttention(heads=heads, tokens=state.tokens, group=group, scale=world.scale, comm=case.comm,
                               kernel_impl=case.kernel_impl))
    group_heads = range(heads.group_q_head_start, heads.group_q_head_start + heads.num_group_q_heads)
    schedule = [[new for _, new in case.requests]] + [[1] * len(case.requests)] * case.decode_steps
    for step, new_tokens in enumerate(schedule):
        q, k, v, batch, positions = state.step(new_tokens)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        result = attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        assert result is out, "forward must return the out buffer it was given"
        got = gather_heads(out)  # [T, group Q heads, D], rank order
        want = torch.cat([causal_attention_f64(world, b, p, group_heads) for b, p in enumerate(positions)])
        assert_matches(got, want, q.dtype, f"{case.name} (N={n}) step {step}")
    state.check_cache()
    return len(schedule)


def _valid(case: Case, n: int) -> bool:
    try:
        for rank in range(n):
            case.layouts(n, rank)
    except ValueError:
        return False
    return True


def random_case(rng: random.Random, n: int, index: int) -> Case:
    """A random valid configuration for a group of ``n`` ranks (reference kernels)."""
    while True:
        kv_replication = rng.choice(["replicated", "replicated", "tp"])
        tp = n * rng.choice([1, 1, 2])
        if kv_replication == "tp":
            kv_heads = rng.choice([d for d in range(1, tp + 1) if tp % d == 0 and (tp // d) % n == 0])
        else:
            kv_heads = rng.choice([1, 2, 3, 4])
        q_per_kv = rng.choice([1, 2, 3, 4, 6, 8, 16])
        q_heads = kv_heads * q_per_kv
        if q_heads % tp:
            continue
        block_size = rng.choice([1, 2, 4, 8, 16])
        interleave = rng.choice([d for d in range(1, block_size + 1) if block_size % d == 0])
        requests = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["decode", "spec", "prefill", "fresh", "tiny"])
            ctx = {"fresh": 0, "tiny": rng.randint(0, n)}.get(kind, rng.randint(0, 40))
            new = {"decode": 1, "spec": rng.randint(2, 4)}.get(kind, rng.randint(1, 12))
            requests.append((ctx, new))
        case = Case(
            name=f"sweep{index}", q_heads=q_heads, kv_heads=kv_heads, kv_replication=kv_replication, tp=tp,
            group_index=rng.randrange(tp // n), interleave=interleave, block_size=block_size,
            head_dim=rng.choice([8, 16, 24, 32]), requests=tuple(requests), comm=rng.choice(["ag_rs", "a2a"]),
            dtype=rng.choice(["float32", "float32", "float16"]), decode_steps=rng.choice([0, 0, 0, 1, 2]),
            seed=rng.randrange(1 << 30),
        )
        if _valid(case, n):
            return case


KERNEL_OF_PLAN = {"plan_write_kv": "write_kv_cache", "plan_chunk": "chunk_attention",
                "plan_prefix": "prefix_attention", "plan_merge": "merge"}
_KERNEL_LOCK = threading.Lock()


def serial(attn: DcpAttention, log: list | None = None, *, kernel_ops=None) -> DcpAttention:
    """``attn`` with its launches run one at a time across threads, and logged into ``log`` (``SerialKernels``).
    ``kernel_ops``: a namespace with ``dcp_plugin.kernels``' ``plan_*`` functions to run instead of the one ``attn``
    chose by name. The one place tests replace what ``DcpAttention`` chose."""
    attn._kernel_ops = SerialKernels(attn._kernel_ops if kernel_ops is None else kernel_ops, log)
    return attn


class SerialKernels:
    """A kernel namespace whose launches run one at a time across threads (the Triton interpreter, and Triton's
    JIT cache, are not meant to be entered by several threads at once; on a GPU launches are asynchronous, so this
    serialises little). With ``log``, every launch appends ``(kernel name, its tensors, its plan's keywords)`` when
    it runs, in execution order."""

    def __init__(self, kernel_ops, log: list | None = None) -> None:
        self._kernel_ops, self._log = kernel_ops, log

    def __getattr__(self, name):
        fn = getattr(self._kernel_ops, name)
        if name not in KERNEL_OF_PLAN:
            return fn

        def plan(*args, **kwargs):
            with _KERNEL_LOCK:
                launch = fn(*args, **kwargs)

            def run(*tensors):
                if self._log is not None:
                    self._log.append((KERNEL_OF_PLAN[name], tensors, kwargs))
                with _KERNEL_LOCK:
                    launch(*tensors)

            return run

        return plan


class Exchange:
    """Threads of one process as ranks: every rank deposits a tensor, waits for the others, and reads all of them
    (on a GPU all ranks share one stream, so the tensors are ready in order)."""

    def __init__(self, n: int, *, timeout_s: float = 120) -> None:
        self.slots: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def swap(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody deposits the next tensor before everyone has read this one
        return parts


class ThreadGroup:
    """A ``DcpGroup`` over the threads of an ``Exchange``, with ``TorchDcpGroup``'s collective semantics; the name of
    each collective is appended to ``log`` when one is given."""

    def __init__(self, exchange: Exchange, rank: int, *, log: list | None = None) -> None:
        self.exchange, self.rank_in_group, self.world_size = exchange, rank, len(exchange.slots)
        self.log = log

    def _swap(self, op: str, t: torch.Tensor) -> list[torch.Tensor]:
        if self.log is not None:
            self.log.append(op)
        return self.exchange.swap(self.rank_in_group, t)

    def all_gather(self, t, dim):
        return torch.cat(self._swap("all_gather", t), dim=dim)

    def reduce_scatter(self, t, dim):
        summed = torch.stack(self._swap("reduce_scatter", t)).sum(0)
        return summed.chunk(self.world_size, dim=dim)[self.rank_in_group]

    def all_to_all(self, t):
        parts = self._swap("all_to_all", t)
        return torch.cat([part.chunk(self.world_size)[self.rank_in_group] for part in parts])


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


def run_threads(n: int, fn: Callable[[int, Exchange], object], *, timeout_s: float = 120) -> list:
    """``fn(rank, exchange)`` for ranks ``0..n-1``, each on its own thread over one ``Exchange``; returns the
    results in rank order. A failing rank releases the others (their barrier breaks) and its error is re-raised."""
    exchange, results, errors = Exchange(n, timeout_s=timeout_s), [None] * n, []

    def target(rank):
        try:
            results[rank] = fn(rank, exchange)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other ranks are released
            errors.append(exc)
            exchange.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a rank thread hung"
    if errors:  # the root cause, not the broken barriers it left the other ranks with
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
