"""vLLM's V2 model runner (``vllm/v1/worker/gpu/``, the default runner of vLLM 0.33) on CPU, from a scheduled batch
to an attention backend's metadata builder.

vLLM's own Python runs wherever it runs without CUDA: ``sort_batch_req_ids``, ``InputBuffers``, ``InputBatch`` (and
``make_dummy``), ``DefaultModelState.prepare_attn``, ``build_attn_metadata``, ``AttentionGroup`` (metadata builders,
``build_metadata``, ``build_metadata_for_cudagraph_capture``), ``BlockTables.get_dummy_block_tables`` /
``get_dummy_slot_mappings`` and ``prepare_inputs_to_capture`` (with, in 0.33, ``set_dcp_capture_context`` and
``set_dummy_context``). Its four Triton kernels are placeholders on a machine without GPU, so the functions below
copy them in torch (line numbers: vLLM 0.33); ``tests/unit/test_vllm_v2_runner.py`` checks the copies against the
real kernels under the Triton interpreter where vLLM lets Triton load (its CUDA build with no visible device).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.block_table import get_block_table_width
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.utils import AttentionGroup

from dcp_plugin.adapters.vllm.backend import DcpTritonBackend

LAYER = "model.layers.0.self_attn.attn"
PAD_SLOT_ID = -1


def prepare_pos_seq_lens(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens) -> None:
    """input_batch.py:357-411: request ``i``'s seq_len is its state's computed tokens plus its query length, its
    tokens' positions count on from the computed tokens; seq_lens past the batch are zeroed (FULL-graph padding)."""
    num_reqs = idx_mapping.shape[0]
    for i in range(num_reqs):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        computed = int(num_computed_tokens[idx_mapping[i]])
        seq_lens[i] = computed + end - start
        pos[start:end] = torch.arange(computed, computed + end - start)
    seq_lens[num_reqs:] = 0


def gather_block_tables(tables: BlockTables, idx_mapping, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
    """block_table.py:160-211 and 274-330 (no sliding window): row ``i`` copies the first ``num_blocks`` entries of
    its request's row (the rest keep what an earlier batch left); rows past the batch, up to the most rows an earlier
    batch dirtied, are zeroed. ``tables.src`` / ``tables.src_num_blocks`` stand for the staged per-request tables."""
    num_reqs = idx_mapping.shape[0]
    num_rows = max(num_reqs_padded, tables._num_dirty_rows)
    tables._num_dirty_rows = num_reqs
    for out, src, counts in zip(tables.input_block_tables, tables.src, tables.src_num_blocks):
        for i in range(num_rows):
            if i >= num_reqs:
                out[i] = 0
                continue
            req = int(idx_mapping[i])
            out[i, :counts[req]] = src[req, :counts[req]]
    return tuple(bt[:num_reqs_padded] for bt in tables.input_block_tables)


def compute_slot_mappings(tables: BlockTables, idx_mapping, query_start_loc, positions,
                          num_tokens_padded: int) -> torch.Tensor:
    """block_table.py:229-260 and 333-414 (every group DCP-sharded): position ``p`` lives in virtual block
    ``p // (B * N)``; rank ``(p % (B * N)) // I % N`` owns it at local offset ``off // (I * N) * I + off % I``; other
    ranks get PAD_SLOT_ID, and so does every slot from the batch's last real token on."""
    n, rank, interleave = tables.cp_size, tables.cp_rank, tables.cp_interleave
    num_reqs = idx_mapping.shape[0]
    for group, (block, src) in enumerate(zip(tables.block_sizes, tables.src)):
        out = tables.slot_mappings[group]
        for i in range(num_reqs):
            req = int(idx_mapping[i])
            for t in range(int(query_start_loc[i]), int(query_start_loc[i + 1])):
                virtual_block, offset = divmod(int(positions[t]), block * n)
                if (offset // interleave) % n != rank:
                    out[t] = PAD_SLOT_ID
                    continue
                local = virtual_block * block + offset // (interleave * n) * interleave + offset % interleave
                out[t] = int(src[req, local // block]) * block + local % block
        out[int(query_start_loc[num_reqs]):] = PAD_SLOT_ID
    return tables.slot_mappings[:, :num_tokens_padded]


def prepare_dcp_local_seq_lens(out, seq_lens, num_reqs, dcp_size, dcp_rank, cp_interleave, *,
                               num_reqs_padded=None) -> torch.Tensor:
    """cp_utils.py:8-63: tokens of each sequence this DCP rank stores, round-robin in runs of ``cp_interleave``;
    zero past the batch."""
    lens = seq_lens[:num_reqs].long()
    span = dcp_size * cp_interleave
    rest = (lens % span - dcp_rank * cp_interleave).clamp(0, cp_interleave)
    out.zero_()
    out[:num_reqs] = (lens // span * cp_interleave + rest).to(out.dtype)
    return out[:num_reqs_padded]


def table_width(spec, vllm_config, max_model_len: int) -> int:
    """Block-table entries per request, as ``initialize_kv_cache`` sizes them (model_runner.py:663-672): the
    DCP-sharded spec's pages for ``max_model_len``, rounded up to whole 128-token runs."""
    return get_block_table_width(spec.max_num_blocks_per_req(vllm_config, max_model_len), spec.block_size,
                                 token_alignment=spec.block_table_token_alignment)


def make_input_batch(**values) -> InputBatch:
    """vLLM's InputBatch from the fields this vLLM has (its fields differ between releases; a new required one
    fails here, by name)."""
    names = {f.name for f in dataclasses.fields(InputBatch)}
    return InputBatch(**{k: v for k, v in values.items() if k in names})


class V2Runner:
    """One worker's V2-runner state for one KV-cache group of dcp-triton layers: vLLM's buffers and block tables,
    each request's page row (``pages``, its rank-local pages in order) and computed tokens, and the metadata builder
    vLLM's ``AttentionGroup`` made for ``DcpTritonBackend``.

    ``step`` mirrors ``GPUModelRunner.prepare_inputs`` / ``prepare_attn`` (model_runner.py:1388-1614) and the DCP
    block of ``execute_model`` (1924-1934), then calls vLLM's ``DefaultModelState.prepare_attn``; ``capture`` calls
    vLLM's ``prepare_inputs_to_capture`` as ``CudaGraphManager.capture`` does for a FULL decode graph (731-742).
    """

    def __init__(self, vllm_config, *, block_size: int, dcp: int, rank: int, pages: dict[str, list[int]],
                 max_model_len: int, num_kv_blocks: int, max_num_reqs: int = 8, max_num_tokens: int = 128,
                 decode_query_len: int = 1, num_kv_heads: int = 1, head_size: int = 64) -> None:
        interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                 dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_kv_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
        group = AttentionGroup(DcpTritonBackend, [LAYER], spec, 0)
        group.create_metadata_builders(vllm_config, torch.device("cpu"))
        self.attn_groups = [[group]]
        self.dcp, self.decode_query_len, self.max_num_reqs = dcp, decode_query_len, max_num_reqs
        self.buffers = InputBuffers(max_num_reqs, max_num_tokens, torch.device("cpu"))
        width = table_width(spec, vllm_config, max_model_len)
        tables = object.__new__(BlockTables)  # its constructor needs pinned memory; the state it sets, by hand
        tables.__dict__.update(
            block_sizes=[block_size], num_kv_cache_groups=1, max_num_reqs=max_num_reqs, device=torch.device("cpu"),
            cp_size=dcp, cp_rank=rank, cp_interleave=interleave, _num_dirty_rows=0,
            input_block_tables=[torch.zeros(max_num_reqs, width, dtype=torch.int32)],
            slot_mappings=torch.zeros(1, max_num_tokens, dtype=torch.int64),
            src=[torch.zeros(max_num_reqs, width, dtype=torch.int32)],
            src_num_blocks=[torch.zeros(max_num_reqs, dtype=torch.int32)])
        self.index = {}
        for i, (req, row) in enumerate(pages.items()):
            self.index[req] = i
            tables.src[0][i, :len(row)] = torch.tensor(row, dtype=torch.int32)
            tables.src_num_blocks[0][i] = len(row)
        self.tables = tables
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int32)  # the device copy (vLLM's RequestState)
        self.host_ahead = np.zeros(max_num_reqs, dtype=np.int32)  # the host copy's optimism (async spec decode)
        self.model_state = object.__new__(DefaultModelState)
        self.model_state.__dict__.update(supports_mm_inputs=False, encoder_cache=None,
                                         model_config=SimpleNamespace(max_model_len=max_model_len))

    def step(self, scheduled: dict[str, int], *, drafts: dict[str, int] | None = None,
             cg_mode: CUDAGraphMode = CUDAGraphMode.NONE, num_reqs_padded: int | None = None,
             num_tokens_padded: int | None = None):
        """One step's metadata for the layer, and the batch order: ``(metadata, req_ids, input_batch)``.
        ``drafts``: draft tokens scheduled per request (counted in ``scheduled``)."""
        draft_tokens = {req: [0] * n for req, n in (drafts or {}).items() if n}
        req_ids = sort_batch_req_ids(scheduled, draft_tokens, self.decode_query_len)
        num_scheduled = np.array([scheduled[r] for r in req_ids], dtype=np.int32)
        idx_np = np.array([self.index[r] for r in req_ids], dtype=np.intp)
        idx_mapping = torch.from_numpy(idx_np).long()
        num_reqs, num_tokens = len(req_ids), int(num_scheduled.sum())
        num_reqs_padded = num_reqs_padded or num_reqs
        num_tokens_padded = max(num_tokens, num_tokens_padded or 0)
        qsl_np = np.empty(self.max_num_reqs + 1, dtype=np.int32)  # model_runner.py:1457-1464
        qsl_np[0] = 0
        np.cumsum(num_scheduled, out=qsl_np[1:num_reqs + 1])
        qsl_np[num_reqs + 1:] = num_tokens
        buffers = self.buffers
        buffers.query_start_loc.copy_(torch.from_numpy(qsl_np))
        qsl = buffers.query_start_loc[:num_reqs_padded + 1]
        prepare_pos_seq_lens(idx_mapping, qsl, self.num_computed, buffers.positions, buffers.seq_lens)
        computed_np = self.num_computed.numpy()[idx_np] + self.host_ahead[idx_np]
        upper = np.zeros(num_reqs_padded, dtype=np.int32)  # model_runner.py:1535-1542
        upper[:num_reqs] = computed_np + num_scheduled
        num_drafts = np.array([len(draft_tokens.get(r, ())) for r in req_ids], dtype=np.int32)
        input_batch = make_input_batch(
            req_ids=req_ids, num_reqs=num_reqs, num_reqs_after_padding=num_reqs_padded, idx_mapping=idx_mapping,
            idx_mapping_np=idx_np, expanded_idx_mapping=idx_mapping, expanded_local_pos=torch.zeros(num_reqs),
            num_scheduled_tokens=num_scheduled, num_tokens=num_tokens, num_tokens_after_padding=num_tokens_padded,
            num_draft_tokens=int(num_drafts.sum()), num_draft_tokens_per_req=num_drafts if draft_tokens else None,
            query_start_loc=qsl, query_start_loc_np=qsl_np[:num_reqs_padded + 1],
            seq_lens=buffers.seq_lens[:num_reqs_padded], seq_lens_cpu_upper_bound=torch.from_numpy(upper),
            dcp_local_seq_lens=None, num_computed_tokens_np=computed_np, prefill_len_np=computed_np,
            num_computed_prefill_tokens_np=computed_np, is_prefilling_np=np.zeros(num_reqs, dtype=bool),
            has_prefill=False, decode_graph_eligible=True, input_ids=buffers.input_ids[:num_tokens_padded],
            positions=buffers.positions[:num_tokens_padded], is_padding=buffers.is_padding[:num_tokens_padded],
            logits_indices=qsl[1:num_reqs + 1] - 1, cu_num_logits=torch.arange(num_reqs + 1),
            cu_num_logits_np=np.arange(num_reqs + 1), has_structured_output_reqs=False, prompt_lens=None)
        block_tables = gather_block_tables(self.tables, idx_mapping, num_reqs_padded)
        slot_mappings = compute_slot_mappings(self.tables, idx_mapping, qsl, buffers.positions, num_tokens_padded)
        if self.dcp > 1:
            input_batch.dcp_local_seq_lens = prepare_dcp_local_seq_lens(
                buffers.dcp_local_seq_lens, input_batch.seq_lens, num_reqs, self.dcp, self.tables.cp_rank,
                self.tables.cp_interleave, num_reqs_padded=num_reqs_padded)
        metadata = self.model_state.prepare_attn(input_batch, cg_mode, block_tables, slot_mappings,
                                                 self.attn_groups, self.kv_cache_config)
        return metadata[LAYER], req_ids, input_batch

    def advance(self, scheduled: dict[str, int], rejected: dict[str, int] | None = None) -> None:
        """After sampling (``post_update``): the device's computed tokens grow by the accepted ones; the host's, which
        async scheduling keeps optimistic until the scheduler hears back, by every scheduled one."""
        for req, n in scheduled.items():
            dropped = (rejected or {}).get(req, 0)
            self.num_computed[self.index[req]] += n - dropped
            self.host_ahead[self.index[req]] = dropped

    def capture(self, monkeypatch, num_tokens: int):
        """The metadata a FULL decode graph of ``num_tokens`` one-token requests is captured with."""
        monkeypatch.setattr(cudagraph_utils, "prepare_dcp_local_seq_lens", prepare_dcp_local_seq_lens)
        state = cudagraph_utils.prepare_inputs_to_capture(
            num_tokens, num_tokens, self.model_state, self.buffers, self.tables, self.attn_groups,
            self.kv_cache_config, full_cudagraph=True, max_query_len=1)
        return state.attn_metadata[LAYER]


def dcp_size_patch(monkeypatch, dcp: int, rank: int) -> None:
    """vLLM's DCP group needs ``dcp`` processes; the builder asks for ``(size, rank)`` through this one call."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank",
                        lambda enabled=True: (dcp, rank) if enabled else (1, 0))

