"""Per-worker parallel topology, built once per worker and passed down (never read from process globals)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcp_plugin.kernels.checks import check_int


_FORMER = {"attn_dcp_size": "dcp_size", "attn_dcp_rank": "dcp_rank"}  # former field names -> current


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelState:
    """The parallel topology of one worker's attention layers.

    DCP groups are consecutive TP ranks: with ``tp_size=8, dcp_size=4`` the groups are TP ranks
    ``{0..3}`` and ``{4..7}``, and ``dcp_rank = tp_rank % dcp_size``. A draft model whose KV cache is
    not sharded runs in the same process with ``dcp_size=1``.

    Example::

        parallel = ParallelState.from_tp(tp_rank=5, tp_size=8, dcp_size=4)   # dcp_rank == 1
    """

    tp_rank: int = 0
    tp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for size_field, rank_field in (
            ("tp_size", "tp_rank"),
            ("dcp_size", "dcp_rank"),
            ("pp_size", "pp_rank"),
            ("dp_size", "dp_rank"),
        ):
            size, rank = getattr(self, size_field), getattr(self, rank_field)
            check_int(f"ParallelState.{size_field}", size, low=1)
            check_int(f"ParallelState.{rank_field}", rank, low=0, high=size - 1, note=f" ({size_field}={size})")
        if self.tp_size % self.dcp_size:
            divisors = [d for d in range(1, self.tp_size + 1) if self.tp_size % d == 0]
            raise ValueError(
                f"ParallelState.dcp_size={self.dcp_size} must divide tp_size={self.tp_size} "
                f"(DCP groups are carved out of the TP group); allowed: {divisors}"
            )
        if self.tp_rank % self.dcp_size != self.dcp_rank:
            raise ValueError(
                f"ParallelState.dcp_rank={self.dcp_rank} does not match tp_rank={self.tp_rank}: "
                f"DCP groups are consecutive TP ranks, so dcp_rank must be "
                f"tp_rank % dcp_size = {self.tp_rank % self.dcp_size}"
            )

    @classmethod
    def from_tp(cls, *, tp_rank: int, tp_size: int, dcp_size: int, **others: int) -> ParallelState:
        """Topology of TP rank ``tp_rank`` when DCP groups of ``dcp_size`` consecutive TP ranks are used."""
        if not isinstance(dcp_size, int) or dcp_size < 1:
            raise ValueError(f"dcp_size must be an int >= 1, got {dcp_size!r}")
        return cls(
            tp_rank=tp_rank, tp_size=tp_size, dcp_rank=tp_rank % dcp_size, dcp_size=dcp_size, **others
        )

    @classmethod
    def trivial(cls, **overrides: int) -> ParallelState:
        """A single-GPU topology (everything 1/0) with optional field overrides (``attn_dcp_size`` /
        ``attn_dcp_rank``, the former names, still mean ``dcp_size`` / ``dcp_rank``)."""
        return cls(**{_FORMER.get(name, name): value for name, value in overrides.items()})

    @property
    def attn_dcp_size(self) -> int:
        """``dcp_size`` under its former name, kept for code outside this repository."""
        return self.dcp_size

    @property
    def attn_dcp_rank(self) -> int:
        """``dcp_rank`` under its former name, kept for code outside this repository."""
        return self.dcp_rank

    @property
    def dcp_group_first_tp_rank(self) -> int:
        """TP rank of rank 0 of this worker's DCP group."""
        return self.tp_rank - self.dcp_rank

    def replace(self, **changes: int) -> ParallelState:
        return dataclasses.replace(self, **changes)
