"""The three collectives DCP attention needs, behind a small protocol so any engine's process group can serve."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DcpGroup(Protocol):
    """A DCP group as DcpAttention sees it: ``world_size`` ranks, this one being ``rank_in_group``.

    Every rank calls the collectives in the same order with tensors of the same shape and dtype.
    ``all_gather(t, dim)`` concatenates every rank's ``t`` along ``dim`` in rank order.
    ``reduce_scatter(t, dim)`` sums ``t`` over ranks and returns this rank's ``1 / world_size`` slice along ``dim``
    (``t.shape[dim]`` divisible by ``world_size``).
    ``all_to_all(t)`` splits ``t`` into ``world_size`` equal slices along dim 0, sends slice ``i`` to rank ``i``
    and returns the received slices concatenated in rank order (same shape as ``t``).
    A group of one rank returns its input unchanged and communicates nothing.

    A group may also offer the same three collectives into caller-provided contiguous buffers, with no allocation
    (what ``DcpAttention`` uses when present, so that a step allocates nothing and can be captured in a CUDA graph):
    ``all_gather_into(out, t)``: ``out`` holds ``world_size`` times ``t``'s elements, rank ``r``'s ``t`` in its
    ``r``-th contiguous slice; ``reduce_scatter_into(out, t)``: ``t`` holds ``world_size`` slices of ``out``'s size,
    this rank receives the sum of slice ``rank_in_group``; ``all_to_all_into(out, t)``: equal shapes, slice ``i``
    of ``t`` (dim 0) goes to rank ``i``, slice ``j`` of ``out`` comes from rank ``j``.
    ``BufferedGroup`` adds them to a group that lacks them (at the cost of a copy).
    """

    @property
    def world_size(self) -> int: ...

    @property
    def rank_in_group(self) -> int: ...

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor: ...


class TorchDcpGroup:
    """``DcpGroup`` over a ``torch.distributed`` process group (NCCL on GPU, gloo on CPU).

    ``process_group=None`` uses the default group (``torch.distributed`` must be initialised). Results along a
    non-zero ``dim`` are strided views (the collective itself runs on a contiguous dim-0 layout).

    Example::

        dist.init_process_group("gloo", ...)
        group = TorchDcpGroup()
        q_all = group.all_gather(q, dim=1)          # [T, world_size * H, D]
    """

    def __init__(self, process_group=None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "TorchDcpGroup needs torch.distributed to be initialised (dist.init_process_group) before it is "
                "built; for a single rank without torch.distributed pass group=None to DcpAttention instead"
            )
        self._dist = dist
        self._group = process_group
        # torch 2.13 renamed the tensor collectives to *_single and deprecates the old names (FutureWarning);
        # older torch has only the old ones. Same semantics, on gloo and NCCL.
        self._all_gather_dim0 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter_dim0 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._world_size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank_in_group(self) -> int:
        return self._rank

    @property
    def process_group(self):
        return self._group

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self._world_size == 1:
            return t
        dim = _check_dim("all_gather", t, dim)
        send = t.movedim(dim, 0).contiguous()
        recv = torch.empty((self._world_size * send.shape[0], *send.shape[1:]), dtype=t.dtype, device=t.device)
        self._all_gather_dim0(recv, send, group=self._group)
        return recv.movedim(0, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self._world_size == 1:
            return t
        dim = _check_dim("reduce_scatter", t, dim)
        if t.shape[dim] % self._world_size:
            raise ValueError(
                f"reduce_scatter: size {t.shape[dim]} of dim {dim} is not divisible by world_size={self._world_size}"
            )
        send = t.movedim(dim, 0).contiguous()
        recv = torch.empty((send.shape[0] // self._world_size, *send.shape[1:]), dtype=t.dtype, device=t.device)
        self._reduce_scatter_dim0(recv, send, group=self._group)
        return recv.movedim(0, dim)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return t
        if t.dim() == 0 or t.shape[0] % self._world_size:
            raise ValueError(
                f"all_to_all: dim 0 of shape {tuple(t.shape)} must be divisible by world_size={self._world_size}"
            )
        send = t.contiguous()
        recv = torch.empty_like(send)
        self._dist.all_to_all_single(recv, send, group=self._group)
        return recv

    # Into caller buffers (contiguous, along dim 0; DcpAttention checks the shapes once per step).
    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._all_gather_dim0(out.view(-1), t.view(-1), group=self._group)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._reduce_scatter_dim0(out.view(-1), t.view(-1), group=self._group)

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._dist.all_to_all_single(out.view(-1), t.view(-1), group=self._group)


class BufferedGroup:
    """The ``*_into`` collectives over any ``DcpGroup`` that has only the allocating three (each copies its result
    into the caller's buffer)."""

    def __init__(self, group: DcpGroup) -> None:
        self.group = group
        self.world_size, self.rank_in_group = group.world_size, group.rank_in_group

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        out.view(-1).copy_(self.group.all_gather(t.reshape(-1), dim=0))

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        out.view(-1).copy_(self.group.reduce_scatter(t.reshape(-1), dim=0))

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        out.copy_(self.group.all_to_all(t))


def buffered(group: DcpGroup):
    """``group`` itself when it has the ``*_into`` collectives, else a ``BufferedGroup`` over it."""
    into = ("all_gather_into", "reduce_scatter_into", "all_to_all_into")
    return group if all(callable(getattr(group, name, None)) for name in into) else BufferedGroup(group)


def _check_dim(op: str, t: torch.Tensor, dim: int) -> int:
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{op}: dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()
