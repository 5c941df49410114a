"""Per-step metadata: vLLM's ``CommonAttentionMetadata`` -> one ``DcpBatch`` that every layer of the group reads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from dcp_plugin.adapters.vllm import compat, spec
from dcp_plugin.batch import DcpBatch, DcpBatchBuffers, leading_decodes
from dcp_plugin.kernels.checks import env_switch
from dcp_plugin.layout import TokenLayout


FULL_GRAPHS_ENV = "DCP_TRITON_DCP_FULL_GRAPHS"


def full_graphs_at_dcp() -> bool:
    """Whether uniform decode steps at DCP > 1 (single-token ones and speculative verify steps of 1 + k rows per
    request) replay full CUDA graphs (``DCP_TRITON_DCP_FULL_GRAPHS``, 0/1, default 1)."""
    return env_switch(FULL_GRAPHS_ENV, on="full CUDA graphs for decode at DCP > 1",
                      off="piecewise graphs, attention eager")


@dataclass(frozen=True, slots=True)
class DcpTritonMetadata:
    """``batch``: the step as DCP attention sees it; ``num_actual_tokens``: rows of ``output`` vLLM reads (the
    batch's ``num_tokens`` plus any padding rows, which forward zeroes)."""

    batch: DcpBatch
    num_actual_tokens: int


class DcpTritonMetadataBuilder(AttentionMetadataBuilder[DcpTritonMetadata]):
    """Builds the ``DcpBatch`` once per step on the host; forward does no host work.

    The token layout follows the KV-cache group: a group vLLM does not shard over DCP (``dcp_sharded=False``,
    e.g. a replicated draft model) gets DCP size 1 inside a DCP target's process group.

    CUDA graphs (``UNIFORM_BATCH``): decode steps replay as full graphs, single-token ones and, with speculative
    decoding, verify steps of 1 + k rows per request (vLLM's ``uniform_decode_query_len``; without this support
    vLLM falls back to piecewise graphs for every step of a speculative run). Every tensor those passes read is one
    of vLLM's persistent inputs, lives in this builder's ``DcpBatchBuffers`` or in the impl's ``DcpWorkspace``,
    and the split-KV count, which a graph freezes, is sized for the block table's capacity (``max_model_len`` in
    whole pages) on every such step once full graphs are on (a short context leaves the extra splits empty). At DCP > 1
    the collectives go through vLLM's NCCL communicator, which a graph captures (run on two H200s: float32
    agreement and throughput with full graphs at DCP = 2); ``DCP_TRITON_DCP_FULL_GRAPHS=0`` keeps DCP > 1
    piecewise (attention eager).

    Both vLLM model runners call ``build`` once per step and KV-cache group: V1 (``v1/worker/gpu_model_runner.py``,
    ``_build_attention_metadata``) and V2 (``v1/worker/gpu/attn_utils.py``, ``build_attn_metadata``: vLLM 0.33's
    default, and 0.26's for the Llamas this repository ran on GPUs). What this builder reads they fill alike: the
    device ``query_start_loc``, ``seq_lens``, block table and slot mapping in persistent buffers, the host
    ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound``, ``max_query_len`` and ``max_seq_len``. Under a FULL
    graph both pass the padded request and token counts (a padded request has no tokens, seq_len 0, a zeroed
    block-table row; padded slots are -1) and capture through ``build_for_cudagraph_capture`` (inherited: ``build``)
    with ``max_seq_len = max_model_len``. ``dcp_local_seq_lens`` is never read: V1 computes it on the host, V2 on the
    device with its own kernel (``v1/worker/gpu/cp_utils.py``) and leaves its host bound None; the local lengths come
    from ``TokenLayout`` over the device ``seq_lens``. (``tests/unit/test_vllm_v2_runner.py`` drives V2's code.)
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if vllm_config.parallel_config.decode_context_parallel_size > 1 and not full_graphs_at_dcp():
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        dcp_size, dcp_rank = compat.dcp_world_size_and_rank(kv_cache_spec)
        interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
        if not isinstance(interleave, int) or interleave < 1 or kv_cache_spec.block_size % interleave:
            raise ValueError(
                f"cp_kv_cache_interleave_size={interleave} must divide the KV-cache block size "
                f"{kv_cache_spec.block_size}; supported: "
                f"{[d for d in range(1, kv_cache_spec.block_size + 1) if kv_cache_spec.block_size % d == 0]}"
            )
        # The KV-cache group's own sharding (a draft vLLM does not shard gets DCP size 1 inside a DCP target).
        self.tokens = TokenLayout(dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave,
                                  block_size=kv_cache_spec.block_size)
        spec.check_kv_cache_group(self.tokens, layer_names, vllm_config)  # start-up, not the first request
        # Decode rows first. V1 reorders by this threshold (spec-decode verify rows count as decodes); V2 ignores
        # it and always sorts: rows with drafts, then rows of exactly its decode query length, then by length
        # (0.33 v1/worker/gpu/model_runner.py sort_batch_req_ids), so single-token rows lead only without drafts.
        # num_decodes counts the leading single-token rows; any other order runs as one pass, which the kernels
        # take for any mix, so DCP needs no forced threshold of 1.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True, supports_dcp_with_varlen=True)
        # One per builder, and vLLM makes one builder per micro-batch: no two live batches share it.
        self.buffers = DcpBatchBuffers(vllm_config.scheduler_config.max_num_seqs, device)
        # The query rows of the steps a full decode graph replays: 1, or 1 + k proposals with speculative decoding.
        speculative = vllm_config.speculative_config
        self.uniform_query_len = 1 + ((speculative.num_speculative_tokens or 0) if speculative is not None else 0)

    def _full_decode_graphs(self) -> bool:
        # Read per step: vLLM settles the mode (e.g. down to piecewise) after the builders exist.
        mode = self.vllm_config.compilation_config.cudagraph_mode
        return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DcpTritonMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise ValueError(
                f"causal={cm.causal!r}: the dcp-triton backend runs causal decoder attention only; supported: True"
            )
        num_reqs = cm.num_reqs
        # Host arithmetic on a few hundred ints: numpy views of vLLM's CPU tensors (a torch op on a small CPU
        # tensor costs microseconds of dispatch each, and so does a slice: none where the length is already right).
        query_start_loc_cpu = cm.query_start_loc_cpu.numpy()[: num_reqs + 1]
        num_tokens = int(query_start_loc_cpu[-1])  # real tokens, without padding rows
        # A step of one token per request (num_tokens requests of at most one token each) needs no per-request
        # query lengths: each is 1.
        one_each = cm.max_query_len == 1 and num_tokens == num_reqs
        query_lens_cpu = None if one_each else np.diff(query_start_loc_cpu)
        max_context_len = None
        if cm.seq_lens_cpu_upper_bound is not None and num_reqs > 0:
            # Host data, identical on every rank: a rank-invariant bound for the skip-the-prefix decision (V2 keeps
            # it optimistic under async spec decoding: host computed tokens plus scheduled ones, still a bound).
            # When max_seq_len exceeds it, the contexts are bounded by max_seq_len alone: V1's draft metadata leaves
            # the bound short (extend_all_queries_by_N adds N to seq_lens and max_seq_len only); FULL-graph capture
            # (both runners) passes max_model_len, and so do V2's draft-model steps (0.33 spec_decode/speculator.py).
            upper = cm.seq_lens_cpu_upper_bound.numpy()[:num_reqs]
            upper_max = int(upper.max())
            if upper_max < cm.max_seq_len:
                min_query_len = 1 if one_each else int(query_lens_cpu.min())
                max_context_len = max(0, cm.max_seq_len - min_query_len)
            elif one_each:
                max_context_len = max(0, upper_max - 1)
            else:
                max_context_len = max(0, int((upper - query_lens_cpu).max()))
        max_seq_len = cm.max_seq_len
        if cm.max_query_len in (1, self.uniform_query_len) and self._full_decode_graphs():
            # The split count a captured decode graph replays with, the same for capture, warm-up and every step:
            # sized for the longest sequence the block table addresses (max_model_len rounded up to whole pages).
            capacity = cm.block_table_tensor.shape[1] * self.tokens.block_size * self.tokens.dcp_size
            max_seq_len = max(max_seq_len, capacity)
            if cm.max_query_len > 1:  # a verify step's prefix pass, likewise (a bound: no host sync either)
                max_context_len = max(max_context_len or 0, capacity - cm.max_query_len)
        batch = DcpBatch.build(
            num_decodes=leading_decodes(query_start_loc_cpu) if cm.max_query_len > 1 else 0,
            query_start_loc=_first(cm.query_start_loc, num_reqs + 1),
            seq_lens=_first(cm.seq_lens, num_reqs),
            block_table=cm.block_table_tensor,
            slot_mapping=_first(cm.slot_mapping, num_tokens),
            tokens=self.tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=max_seq_len,
            max_context_len=max_context_len,
            buffers=self.buffers,
        )
        return DcpTritonMetadata(batch=batch, num_actual_tokens=cm.num_actual_tokens)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata,
                           draft_index: int) -> DcpTritonMetadata:
        """A draft model's step. At DCP > 1 vLLM's V1 drafter gives its later steps (``draft_index`` >= 1: one new
        token per request, at position seq_len - 1) slots computed as if the cache were not sharded (its EAGLE step
        kernel: ``block_table[pos // block_size] * block_size + pos % block_size``, on every rank), so each draft
        token would land in another token's row: they are rewritten in place, in vLLM's own slot buffer (which its
        KV-cache update reads too), to the owner rank's slot and -1 on the others. Where vLLM's slots were right
        already (its V2 runner) the same values are written."""
        cm = common_attn_metadata
        if draft_index > 0 and self.tokens.dcp_size > 1 and cm.max_query_len == 1 and cm.num_reqs:
            _owner_slots(cm, self.tokens)
        return self.build(common_prefix_len=0, common_attn_metadata=cm, fast_build=True)


def _owner_slots(cm: CommonAttentionMetadata, tokens: TokenLayout) -> None:
    """Each request's one new token (position seq_len - 1) given this rank's slot for it in ``cm.slot_mapping``, -1
    where another rank owns it; slots vLLM left at -1 (padding, a position past the model's length) stay -1."""
    n = cm.num_reqs
    slots, table = cm.slot_mapping[:n], cm.block_table_tensor[:n]
    pos = cm.seq_lens[:n].to(torch.int64) - 1
    column = tokens.virtual_block(pos.clamp_min(0)).clamp_max(table.shape[1] - 1)
    block = table.gather(1, column[:, None]).squeeze(1).to(torch.int64)
    mine = (tokens.owner(pos) == tokens.dcp_rank) & (pos >= 0) & (slots >= 0)
    slots.copy_(torch.where(mine, block * tokens.block_size + tokens.local_offset(pos), -1))


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, or ``t`` itself when it has ``n`` entries (vLLM's eager steps pass them cut to size already)."""
    return t if t.shape[0] == n else t[:n]
