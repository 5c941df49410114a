"""The worker's DCP topology from SGLang's runner and parallel context, read once when the backend is built."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_plugin.group import DcpGroup, TorchDcpGroup
from dcp_plugin.layout import HeadLayout
from dcp_plugin.parallel_state import ParallelState


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """What the backend of one model runner needs: its ranks, its head layout (SGLang's: KV heads replicated in the
    DCP group, ``kv_replication="replicated"``), the DCP group (``None`` at DCP = 1) and the merge mode (``comm``)."""

    parallel: ParallelState
    heads: HeadLayout
    group: DcpGroup | None
    comm: str = "ag_rs"


def build(*, total_q_heads: int, total_kv_heads: int, tp_rank: int, tp_size: int, dcp_size: int,
          group: DcpGroup | None, comm: str = "ag_rs") -> Topology:
    """``Topology`` of attention-TP rank ``tp_rank`` of ``tp_size`` in DCP groups of ``dcp_size`` consecutive ranks.
    A bad combination raises ``ValueError`` naming SGLang's options."""
    try:
        parallel = ParallelState.from_tp(tp_rank=tp_rank, tp_size=tp_size, dcp_size=dcp_size)
        heads = HeadLayout.create(total_q_heads=total_q_heads, total_kv_heads=total_kv_heads, parallel=parallel,
                                  kv_replication="replicated")
    except ValueError as err:
        raise ValueError(f"dcp-triton cannot place the heads of this model (--tp-size {tp_size} of attention, "
                         f"--dcp-size {dcp_size}, {total_q_heads} Q heads, {total_kv_heads} KV heads): {err}") from None
    if comm not in ("ag_rs", "a2a"):
        raise ValueError(f"--dcp-comm-backend {comm}: dcp-triton merges with 'ag_rs' or 'a2a'")
    if dcp_size > 1 and (group is None or (group.world_size, group.rank_in_group) != (dcp_size, parallel.dcp_rank)):
        raise ValueError(f"the DCP group does not match --dcp-size {dcp_size} at attention-TP rank {tp_rank}")
    return Topology(parallel=parallel, heads=heads, group=group if dcp_size > 1 else None, comm=comm)


def from_sglang(model_runner) -> Topology:
    """Read SGLang's parallel context for this runner. A draft runner never joins the DCP group (its KV cache is not
    sharded), so it runs at DCP = 1 inside a DCP target's process."""
    from sglang.srt.runtime_context import get_parallel

    runtime = get_parallel()
    dcp_size = 1 if model_runner.is_draft_worker else runtime.attn_dcp_size
    config = model_runner.model_config
    group = None
    if dcp_size > 1:
        coordinator = runtime.dcp_group
        group = TorchDcpGroup(coordinator.device_group)
    comm = _comm_backend(model_runner) if dcp_size > 1 else "ag_rs"
    return build(total_q_heads=config.num_attention_heads, total_kv_heads=config.get_total_num_kv_heads(),
                 tp_rank=runtime.attn_tp_rank, tp_size=runtime.attn_tp_size, dcp_size=dcp_size, group=group,
                 comm=comm)


def _comm_backend(model_runner) -> str:
    """SGLang's ``--dcp-comm-backend`` (its resolved value; ``ag_rs`` when it names none)."""
    from dcp_plugin.adapters.sglang import compat

    value = compat.resolved_server_arg(model_runner, "dcp_comm_backend")
    return "ag_rs" if value in (None, "auto") else value
