"""What the DCP core tests share: a per-rank case runner (each step's gathered output against float64 attention),
random cases, kernels serialised across threads, and threads of one process as the ranks of a DCP group. The cases,
their sequences and each rank's sharded cache, and the float64 references, are ``dcp_plugin.testing``'s.

A case is plain data (picklable) so spawned processes can rebuild everything from it and its seed alone.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import torch

from dcp_plugin import DcpAttention
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.kernel_checks import assert_matches


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
        want = torch.cat([world.causal_attention_f64(b, p, group_heads) for b, p in enumerate(positions)])
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
