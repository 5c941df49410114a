"""Where heads and tokens live under DCP: pure integer math, conventions of docs/design.md section 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from dcp_plugin.kernels.checks import check_int
from dcp_plugin.parallel_state import ParallelState

KvReplication = Literal["tp", "replicated"]
KV_REPLICATIONS = ("tp", "replicated")
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadLayout:
    """Which Q and KV heads one rank holds, for both head layouts.

    ``kv_replication="tp"`` is vLLM's layout: each rank stores the KV heads tensor parallelism gives it, so the
    ranks of a DCP group must hold the same ones: at DCP > 1, ``tp_size`` a multiple of ``total_kv_heads`` with
    ``(tp_size / total_kv_heads) % dcp_size == 0``, hence ``tp_size > total_kv_heads``.
    ``kv_replication="replicated"`` is SGLang's: the KV heads are replicated across the DCP group, every rank storing
    the KV heads of all the group's Q heads.
    Q heads are sharded by TP in both. Global Q head ``g`` reads global KV head ``g // q_per_kv``.

    Example (the seeds' topology)::

        parallel = ParallelState.from_tp(tp_rank=1, tp_size=4, dcp_size=4)
        heads = HeadLayout.create(total_q_heads=32, total_kv_heads=2, parallel=parallel, kv_replication="replicated")
        heads.q_head_start, heads.num_q_heads      # (8, 8)
        heads.kv_head_start, heads.num_kv_heads    # (0, 2): the group's 32 Q heads need KV heads 0 and 1
        heads.current_chunk_kv                     # (0, 1): local Q heads 8..15 need KV head 0 only
    """

    total_q_heads: int
    total_kv_heads: int
    q_per_kv: int
    kv_replication: KvReplication
    dcp_size: int
    dcp_rank: int
    q_head_start: int
    num_q_heads: int
    group_q_head_start: int
    num_group_q_heads: int
    kv_head_start: int
    num_kv_heads: int

    @classmethod
    def create(cls, *, total_q_heads: int, total_kv_heads: int, parallel: ParallelState | None = None,
               kv_replication: KvReplication = "tp", ps: ParallelState | None = None) -> HeadLayout:
        """Layout of rank ``parallel`` for a model with ``total_q_heads`` / ``total_kv_heads`` heads in all (the
        fields of the same names; the layout's ``num_q_heads`` / ``num_kv_heads`` are this rank's counts). ``ps``:
        ``parallel`` under its former keyword, kept for code outside this repository."""
        if (parallel is None) == (ps is None):
            raise ValueError("HeadLayout.create takes the rank's ParallelState once, as parallel= (or ps=)")
        parallel = parallel if ps is None else ps
        total_q, total_kv = total_q_heads, total_kv_heads
        for name, value in (("total_q_heads", total_q), ("total_kv_heads", total_kv)):
            check_int(name, value, low=1)
        if kv_replication not in KV_REPLICATIONS:
            raise ValueError(f"kv_replication must be one of {list(KV_REPLICATIONS)}, got {kv_replication!r}")
        if total_q % total_kv:
            raise ValueError(
                f"total_q_heads={total_q} is not a multiple of total_kv_heads={total_kv}: "
                "every KV head must serve the same number of Q heads"
            )
        tp, n = parallel.tp_size, parallel.dcp_size
        if total_q % tp:
            raise ValueError(
                f"total_q_heads={total_q} is not divisible by tp_size={tp}; use a tp_size that divides it: "
                f"{[d for d in range(1, total_q + 1) if total_q % d == 0]}"
            )
        q_per_kv = total_q // total_kv
        local_q = total_q // tp
        q_start = parallel.tp_rank * local_q
        group_q_start = parallel.dcp_group_first_tp_rank * local_q
        group_q = local_q * n

        if kv_replication == "tp":
            kv_start, kv_count = _tp_kv_heads(total_kv, tp, parallel.tp_rank)
            if n > 1 and (tp < total_kv or (tp // total_kv) % n):
                good = [d for d in range(1, tp + 1) if tp % d == 0 and tp >= total_kv and (tp // total_kv) % d == 0]
                raise ValueError(
                    f"kv_replication='tp' with dcp_size={n}, tp_size={tp}, total_kv_heads={total_kv}: the ranks "
                    f"of a DCP group would hold different KV heads. It needs tp_size a multiple of "
                    f"total_kv_heads with (tp_size / total_kv_heads) % dcp_size == 0, hence tp_size > total_kv_heads "
                    f"(dcp_size in {good or [1]} here), or kv_replication='replicated'"
                )
        else:
            kv_start = group_q_start // q_per_kv
            kv_count = (group_q_start + group_q - 1) // q_per_kv + 1 - kv_start

        return cls(
            total_q_heads=total_q,
            total_kv_heads=total_kv,
            q_per_kv=q_per_kv,
            kv_replication=kv_replication,
            dcp_size=n,
            dcp_rank=parallel.dcp_rank,
            q_head_start=q_start,
            num_q_heads=local_q,
            group_q_head_start=group_q_start,
            num_group_q_heads=group_q,
            kv_head_start=kv_start,
            num_kv_heads=kv_count,
        )

    def kv_index(self, global_q_head: int) -> int:
        """Index into this rank's stored KV heads that global Q head ``global_q_head`` reads."""
        index = global_q_head // self.q_per_kv - self.kv_head_start
        if not 0 <= index < self.num_kv_heads:
            raise ValueError(
                f"global Q head {global_q_head} reads global KV head {global_q_head // self.q_per_kv}, which this "
                f"rank does not store (it stores {self.kv_head_start}..{self.kv_head_start + self.num_kv_heads - 1})"
            )
        return index

    @property
    def current_chunk_kv(self) -> tuple[int, int]:
        """``(start, stop)`` into the stored KV heads: exactly the KV heads the local Q heads read."""
        first = self.q_head_start // self.q_per_kv - self.kv_head_start
        last = (self.q_head_start + self.num_q_heads - 1) // self.q_per_kv - self.kv_head_start
        return first, last + 1


def _tp_kv_heads(total_kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """KV heads of TP rank ``tp_rank`` as vLLM's QKVParallelLinear assigns them: ``(start, count)``."""
    if tp >= total_kv_heads:
        if tp % total_kv_heads:
            raise ValueError(
                f"kv_replication='tp': tp_size={tp} must be a multiple of total_kv_heads={total_kv_heads} when it is "
                "larger (each KV head is replicated over tp_size / total_kv_heads ranks)"
            )
        return tp_rank // (tp // total_kv_heads), 1
    if total_kv_heads % tp:
        raise ValueError(
            f"kv_replication='tp': total_kv_heads={total_kv_heads} must be divisible by tp_size={tp} when it is larger"
        )
    per_rank = total_kv_heads // tp
    return tp_rank * per_rank, per_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLayout:
    """Which rank stores KV token ``pos`` of a request and where (vLLM's placement).

    Tokens are dealt to ranks in runs of ``interleave`` consecutive positions; a rank stores the tokens it owns
    densely in order, ``block_size`` tokens per local page, so its shard is an ordinary paged sequence.
    Every method takes ints or integer tensors.

    Example::

        tokens = TokenLayout.create(parallel=ParallelState.from_tp(tp_rank=1, tp_size=4, dcp_size=4), block_size=16)
        tokens.owner(5), tokens.local_len(10)      # (1, 3): rank 1 stores positions 1, 5, 9
    """

    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    block_size: int = 16

    @classmethod
    def create(cls, *, parallel: ParallelState, interleave: int = 1, block_size: int = 16) -> TokenLayout:
        """The token layout of rank ``parallel``: its DCP size and rank come from ``parallel``, as
        ``HeadLayout.create``'s do."""
        return cls(dcp_size=parallel.dcp_size, dcp_rank=parallel.dcp_rank, interleave=interleave, block_size=block_size)

    def __post_init__(self) -> None:
        for name in ("dcp_size", "interleave", "block_size"):
            check_int(f"TokenLayout.{name}", getattr(self, name), low=1)
        if not isinstance(self.dcp_rank, int) or not 0 <= self.dcp_rank < self.dcp_size:
            raise ValueError(f"TokenLayout.dcp_rank must be in [0, {self.dcp_size - 1}], got {self.dcp_rank!r}")
        if self.block_size % self.interleave:
            divisors = [d for d in range(1, self.block_size + 1) if self.block_size % d == 0]
            raise ValueError(
                f"TokenLayout.interleave={self.interleave} must divide block_size={self.block_size}; "
                f"allowed: {divisors}"
            )

    @property
    def _span(self) -> int:
        return self.dcp_size * self.interleave

    def owner(self, pos: IntOrTensor) -> IntOrTensor:
        """DCP rank that stores global position ``pos``."""
        return (pos // self.interleave) % self.dcp_size

    def local_offset(self, pos: IntOrTensor) -> IntOrTensor:
        """Offset of ``pos`` inside its local page (meaningful on the owner rank only)."""
        v = pos % (self.block_size * self.dcp_size)
        return (v // self._span) * self.interleave + v % self.interleave

    def virtual_block(self, pos: IntOrTensor) -> IntOrTensor:
        """Block-table column of ``pos``: one column covers ``block_size * dcp_size`` global positions."""
        return pos // (self.block_size * self.dcp_size)

    def local_index(self, pos: IntOrTensor) -> IntOrTensor:
        """Dense index of ``pos`` within the owner's shard of the request."""
        return self.virtual_block(pos) * self.block_size + self.local_offset(pos)

    def global_position(self, local_index: IntOrTensor) -> IntOrTensor:
        """Inverse of ``local_index`` on this rank."""
        j = local_index
        return (j // self.interleave) * self._span + self.dcp_rank * self.interleave + j % self.interleave

    def local_len(self, seq_len: IntOrTensor, rank: int | None = None) -> IntOrTensor:
        """How many of positions ``[0, seq_len)`` rank ``rank`` (default: this rank) stores."""
        if self.dcp_size == 1:  # one rank stores everything: no per-step device arithmetic at DCP 1
            return seq_len
        r = self.dcp_rank if rank is None else rank
        full = seq_len // self._span
        rest = seq_len - full * self._span - r * self.interleave
        if isinstance(rest, torch.Tensor):
            rest = rest.clamp(0, self.interleave)
        else:
            rest = min(max(rest, 0), self.interleave)
        return full * self.interleave + rest

    def max_local_len(self, seq_len: int) -> int:
        """Upper bound of ``local_len(seq_len, r)`` over all ranks (rank-invariant)."""
        return -(-seq_len // self._span) * self.interleave


def check_same_position(heads: HeadLayout, tokens: TokenLayout, *, hint: str = "") -> None:
    """The one agreement check between a layer's head and token layouts: the same DCP size and rank."""
    if (tokens.dcp_size, tokens.dcp_rank) != (heads.dcp_size, heads.dcp_rank):
        raise ValueError(
            f"the token layout is sharded over DCP size {tokens.dcp_size} (rank {tokens.dcp_rank}) but the head "
            f"layout runs at DCP size {heads.dcp_size} (rank {heads.dcp_rank}){hint}"
        )
