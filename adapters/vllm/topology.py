"""The worker's DCP topology from vLLM's process groups, built once per layer at model construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_plugin.adapters.vllm import spec
from dcp_plugin.group import TorchDcpGroup
from dcp_plugin.layout import HeadLayout
from dcp_plugin.parallel_state import ParallelState


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """What one attention layer of this worker needs: ranks, heads, the DCP group, the merge mode (``comm``)."""

    parallel: ParallelState
    heads: HeadLayout
    interleave: int
    comm: str
    group: VllmDcpGroup | None


class VllmDcpGroup:
    """``DcpGroup`` over vLLM's DCP ``GroupCoordinator``.

    The collectives into caller buffers go through the coordinator's NCCL communicator (vLLM's PyNccl: the current
    stream, no allocation, capturable in a CUDA graph, as vLLM's own DCP backends use it), or through
    ``torch.distributed`` on the coordinator's device group where vLLM has none (one process, CPU).
    """

    def __init__(self, coordinator) -> None:
        self.world_size, self.rank_in_group = coordinator.world_size, coordinator.rank_in_group
        self._torch = TorchDcpGroup(coordinator.device_group)
        self._nccl = getattr(getattr(coordinator, "device_communicator", None), "pynccl_comm", None)

    @property
    def uses_nccl(self) -> bool:
        return self._nccl is not None and not self._nccl.disabled

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._torch.all_gather(t, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._torch.reduce_scatter(t, dim)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        return self._torch.all_to_all(t)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self.uses_nccl:
            self._nccl.all_gather(out, t)
        else:
            self._torch.all_gather_into(out, t)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self.uses_nccl:
            self._nccl.reduce_scatter(out, t)
        else:
            self._torch.reduce_scatter_into(out, t)

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if not self.uses_nccl:
            self._torch.all_to_all_into(out, t)
            return
        nccl = self._nccl
        nccl.group_start()  # one grouped send/receive per peer (itself included): one NCCL launch
        for peer, (send, recv) in enumerate(zip(t.unflatten(0, (self.world_size, -1)),
                                                out.unflatten(0, (self.world_size, -1)))):
            nccl.send(send, peer)
            nccl.recv(recv, peer)
        nccl.group_end()


def head_layout(*, num_heads: int, num_kv_heads: int, total_kv_heads: int, parallel: ParallelState) -> HeadLayout:
    """vLLM's head layout ("tp": each rank keeps the KV heads TP gives it), checked against the layer's counts.

    ``num_heads`` / ``num_kv_heads`` are the layer's per-TP-rank counts (what vLLM passes the impl).
    """
    try:
        heads = HeadLayout.create(
            total_q_heads=num_heads * parallel.tp_size, total_kv_heads=total_kv_heads, parallel=parallel,
            kv_replication="tp",
        )
    except ValueError as err:
        raise ValueError(
            f"dcp-triton cannot place the heads of this model (tensor_parallel_size={parallel.tp_size}, "
            f"decode_context_parallel_size={parallel.dcp_size}, {num_heads * parallel.tp_size} Q heads, "
            f"{total_kv_heads} KV heads): {err}"
        ) from err
    if heads.num_kv_heads != num_kv_heads:
        raise ValueError(
            f"the attention layer holds {num_kv_heads} KV heads per rank, but vLLM's tensor-parallel split of "
            f"{total_kv_heads} KV heads over {parallel.tp_size} ranks gives {heads.num_kv_heads}"
        )
    return heads


def from_vllm(*, num_heads: int, num_kv_heads: int, dcp_size: int, dcp_rank: int, vllm_config) -> Topology:
    """Read vLLM's TP/DCP groups and the current config once (startup), never again.

    ``dcp_size``/``dcp_rank`` are the impl's (``AttentionImplBase.__new__`` sets them from the config of the
    model being built, so a replicated draft gets 1/0 inside a DCP target's process group). Outside an engine (no
    TP group initialized, or no model in the config: how vLLM's own backend tests build an impl), the layer is one
    rank at DCP = 1 holding the heads its constructor names, as vLLM's ``AttentionImplBase`` takes DCP = 1 there.
    """
    parallel = vllm_config.parallel_config
    if parallel.prefill_context_parallel_size > 1:
        raise ValueError(
            f"prefill_context_parallel_size={parallel.prefill_context_parallel_size}: dcp-triton supports "
            "decode context parallelism only; supported: 1"
        )
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "ubatch_size", 1) > 1:
        raise ValueError(
            "enable_dbo / ubatch_size > 1 (micro-batching): dcp-triton shares one scratch workspace between the "
            "layers of a worker, which two micro-batches in flight would overwrite; supported: enable_dbo=False"
        )
    interleave, comm = parallel.cp_kv_cache_interleave_size, parallel.dcp_comm_backend or "ag_rs"
    tp = _tp_group_or_none()
    if tp is None or vllm_config.model_config is None:
        return _standalone(num_heads=num_heads, num_kv_heads=num_kv_heads, dcp_size=dcp_size, interleave=interleave,
                           comm=comm)
    parallel = ParallelState.from_tp(tp_rank=tp.rank_in_group, tp_size=tp.world_size, dcp_size=dcp_size)
    if parallel.dcp_rank != dcp_rank:
        raise ValueError(
            f"vLLM's DCP rank {dcp_rank} is not tp_rank % decode_context_parallel_size = {parallel.dcp_rank}: "
            "dcp-triton needs DCP groups of consecutive TP ranks"
        )
    try:
        heads = head_layout(
            num_heads=num_heads, num_kv_heads=num_kv_heads,
            total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(), parallel=parallel,
        )
    except ValueError as err:  # vLLM checks only the target's heads against DCP: say when these are a draft's
        raise ValueError(f"{err}{spec.draft_note(vllm_config) if dcp_size > 1 else ''}") from err
    group = None
    if dcp_size > 1:
        from vllm.distributed.parallel_state import get_dcp_group

        group = VllmDcpGroup(get_dcp_group())
    return Topology(parallel=parallel, heads=heads, interleave=interleave, comm=comm, group=group)


def _tp_group_or_none():
    """vLLM's TP group coordinator, or None where none is initialized (as vLLM's ``AttentionImplBase`` treats the
    PCP group)."""
    from vllm.distributed.parallel_state import get_tp_group

    try:
        return get_tp_group()
    except AssertionError:
        return None


def _standalone(*, num_heads: int, num_kv_heads: int, dcp_size: int, interleave: int, comm: str) -> Topology:
    """One rank at DCP = 1 with the constructor's heads: an impl built outside an engine."""
    if dcp_size > 1:
        raise ValueError(
            f"decode_context_parallel_size={dcp_size} without vLLM's tensor-parallel group or a model config: "
            "dcp-triton reads the DCP topology from them; outside an engine supported: 1"
        )
    parallel = ParallelState.trivial()
    try:
        heads = HeadLayout.create(total_q_heads=num_heads, total_kv_heads=num_kv_heads, parallel=parallel,
                                  kv_replication="tp")
    except ValueError as err:
        raise ValueError(f"dcp-triton cannot place num_heads={num_heads} over num_kv_heads={num_kv_heads}: {err}") \
            from err
    return Topology(parallel=parallel, heads=heads, interleave=interleave, comm=comm, group=None)
