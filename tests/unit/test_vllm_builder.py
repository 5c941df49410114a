"""The metadata builder on real vLLM ``CommonAttentionMetadata``: decode, prefill, mixed, padded, DCP-sharded.

Expected values come from the test's own request description and from vLLM's ``get_dcp_local_seq_lens``, never
from dcp_plugin's layout code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from tests.helpers.vllm_checks import vllm_slot  # noqa: E402

BLOCK_SIZE = 16

# (query_lens, context_lens): decode-only, prefill-only, and a mixed batch (decodes first, as vLLM orders them,
# then a chunk continuing a cached prefix, then a fresh prompt).
BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 16, 37, 200]),
    "prefill": ([5, 63, 17], [0, 0, 0]),
    "mixed": ([1, 1, 24, 40], [9, 130, 33, 0]),
    "verify": ([5, 5, 5], [7, 64, 300]),  # speculative decoding, 4 proposals per request
}
# (dcp_size, dcp_rank, interleave)
TOPOLOGIES = [(1, 0, 1), (2, 1, 1), (4, 3, 1), (4, 0, 8), (2, 1, 16)]


def common_metadata(query_lens, context_lens, *, dcp, rank, interleave, pad_tokens=0, pad_reqs=0, seed=0):
    """A CommonAttentionMetadata as vLLM's V1 runner fills it, with shuffled local pages and optional padding."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    width = max(1, -(-max(seq_lens) // (BLOCK_SIZE * dcp)))
    num_reqs = len(query_lens) + pad_reqs
    pages = torch.randperm(num_reqs * width, generator=gen).to(torch.int32).view(num_reqs, width)
    slots = []
    for req, (q, c) in enumerate(zip(query_lens, context_lens)):
        row = pages[req].tolist()
        slots += [vllm_slot(p, row, block_size=BLOCK_SIZE, dcp=dcp, rank=rank, interleave=interleave)
                  for p in range(c, c + q)]
    num_tokens = len(slots)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist() + [num_tokens] * pad_reqs, dtype=torch.int32)
    seq = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    local = get_dcp_local_seq_lens(seq, dcp, rank, interleave) if dcp > 1 else None
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=num_reqs,
        num_actual_tokens=num_tokens + pad_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=pages, slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(), dcp_local_seq_lens=local,
        dcp_local_seq_lens_cpu_upper_bound=None if local is None else local.clone(),
    )


def make_builder(monkeypatch, *, dcp, rank, interleave, dcp_sharded=True, speculative_tokens=0):
    # vLLM's DCP group needs dcp_size processes; the builder asks vLLM for (size, rank) through this one call.
    def dcp_world_size_and_rank(enabled: bool = True):
        return (dcp, rank) if enabled else (1, 0)

    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", dcp_world_size_and_rank)
    config = VllmConfig()
    config.parallel_config.cp_kv_cache_interleave_size = interleave
    if speculative_tokens:  # what the builder reads of a SpeculativeConfig (a real one needs a draft model)
        object.__setattr__(config, "speculative_config", SimpleNamespace(num_speculative_tokens=speculative_tokens,
                                                                         parallel_drafting=False))
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16,
                             dcp_sharded=dcp_sharded)
    return DcpTritonMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"dcp{t[0]}-rank{t[1]}-il{t[2]}")
@pytest.mark.parametrize("kind", list(BATCHES))
def test_batch_matches_the_requests(monkeypatch, kind, topology):
    dcp, rank, interleave = topology
    query_lens, context_lens = BATCHES[kind]
    cm = common_metadata(query_lens, context_lens, dcp=dcp, rank=rank, interleave=interleave)
    meta = make_builder(monkeypatch, dcp=dcp, rank=rank, interleave=interleave).build(0, cm)
    batch = meta.batch

    assert (batch.tokens.dcp_size, batch.tokens.dcp_rank) == (dcp, rank)
    assert (batch.tokens.interleave, batch.tokens.block_size) == (interleave, BLOCK_SIZE)
    assert batch.num_reqs == len(query_lens) and batch.num_tokens == sum(query_lens)
    assert meta.num_actual_tokens == sum(query_lens)
    assert batch.query_lens.tolist() == query_lens
    assert batch.context_lens.tolist() == context_lens
    assert batch.seq_lens.tolist() == [q + c for q, c in zip(query_lens, context_lens)]
    expected_local = get_dcp_local_seq_lens(torch.tensor(context_lens), dcp, rank, interleave) if dcp > 1 \
        else torch.tensor(context_lens)
    assert batch.local_context_lens.tolist() == expected_local.tolist()
    assert torch.equal(batch.slot_mapping, cm.slot_mapping)
    assert torch.equal(batch.block_table, cm.block_table_tensor)
    # Rank-invariant host bounds: the global maximum context decides whether collectives run at all.
    assert batch.max_context_len == max(context_lens)
    assert batch.max_query_len == max(query_lens)
    assert batch.max_local_context_len >= int(expected_local.max())
    if dcp > 1:
        # Internal consistency of this test's slot mapping with vLLM's own local lengths of the full sequences.
        owned_new = [sum(s >= 0 for s in cm.slot_mapping[a:b].tolist())
                     for a, b in zip(cm.query_start_loc_cpu[:-1].tolist(), cm.query_start_loc_cpu[1:].tolist())]
        assert (expected_local + torch.tensor(owned_new)).tolist() == cm.dcp_local_seq_lens.tolist()


def test_prefill_without_cached_prefix_skips_the_prefix_pass(monkeypatch):
    cm = common_metadata([7, 30], [0, 0], dcp=2, rank=0, interleave=1)
    batch = make_builder(monkeypatch, dcp=2, rank=0, interleave=1).build(0, cm).batch
    assert batch.max_context_len == 0  # same on every rank: no rank enters a collective


def test_padding_rows_and_requests_are_cut(monkeypatch):
    cm = common_metadata([1, 1, 12], [20, 5, 40], dcp=2, rank=1, interleave=1, pad_tokens=6, pad_reqs=2)
    meta = make_builder(monkeypatch, dcp=2, rank=1, interleave=1).build(0, cm)
    assert meta.num_actual_tokens == 14 + 6
    assert meta.batch.num_tokens == 14
    assert meta.batch.num_reqs == 5  # padding requests stay, with no tokens and no context
    assert meta.batch.query_lens.tolist() == [1, 1, 12, 0, 0]
    assert meta.batch.context_lens.tolist() == [20, 5, 40, 0, 0]
    assert torch.equal(meta.batch.slot_mapping, cm.slot_mapping[:14])


@pytest.mark.parametrize("case", ["exact bound", "short bound", "padded", "a request without tokens"])
def test_a_decode_steps_context_bound(monkeypatch, case):
    """At most one token per request: the rank-invariant context bound equals the longest context when vLLM's host
    bound is exact (with padding requests, or a request of no new tokens, too), and is max_seq_len - 1 when that
    bound falls short of max_seq_len (a draft's extended steps)."""
    contexts = [3, 250, 17, 64]
    query_lens = [1, 0, 1, 1] if case == "a request without tokens" else [1] * 4
    cm = common_metadata(query_lens, contexts, dcp=2, rank=1, interleave=1, pad_reqs=2 if case == "padded" else 0)
    if case == "short bound":
        cm.max_seq_len = 256  # within the block table (8 pages of 16 per rank)
    batch = make_builder(monkeypatch, dcp=2, rank=1, interleave=1).build(0, cm).batch
    assert batch.max_context_len == (255 if case == "short bound" else 250)
    assert batch.num_tokens == sum(query_lens) and batch.context_lens.tolist()[:4] == contexts


def test_unsharded_kv_group_runs_at_dcp_1(monkeypatch):
    """A replicated draft's KV-cache group (dcp_sharded=False) inside a DCP=2 process group."""
    cm = common_metadata([1, 3], [50, 9], dcp=1, rank=0, interleave=1)
    builder = make_builder(monkeypatch, dcp=2, rank=1, interleave=1, dcp_sharded=False)
    batch = builder.build(0, cm).batch
    assert (batch.tokens.dcp_size, batch.tokens.dcp_rank) == (1, 0)
    assert batch.local_context_lens.tolist() == [50, 9]


def test_decode_first_reordering_is_requested(monkeypatch):
    builder = make_builder(monkeypatch, dcp=1, rank=0, interleave=1)
    assert builder.reorder_batch_threshold == 1


def test_non_causal_metadata_is_refused(monkeypatch):
    cm = common_metadata([3], [0], dcp=1, rank=0, interleave=1)
    cm.causal = False
    with pytest.raises(ValueError, match="causal=False.*causal decoder attention only"):
        make_builder(monkeypatch, dcp=1, rank=0, interleave=1).build(0, cm)


def test_interleave_must_divide_the_block(monkeypatch):
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=3 must divide the KV-cache block size 16"):
        make_builder(monkeypatch, dcp=2, rank=0, interleave=3)


@pytest.mark.parametrize("flag, at_dcp2", [(None, "UNIFORM_BATCH"), ("0", "NEVER"), ("1", "UNIFORM_BATCH")])
def test_cudagraph_support_is_uniform_batches_at_every_dcp_unless_switched_off(monkeypatch, flag, at_dcp2):
    # UNIFORM_BATCH: full graphs for single-token decodes and for speculative verify steps (1 + k rows each); a
    # lower level makes vLLM drop to piecewise graphs for every step of a speculative run.
    if flag is None:
        monkeypatch.delenv("DCP_TRITON_DCP_FULL_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("DCP_TRITON_DCP_FULL_GRAPHS", flag)
    config = VllmConfig()
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16)
    support = DcpTritonMetadataBuilder.get_cudagraph_support
    assert support(config, spec) == AttentionCGSupport.UNIFORM_BATCH
    config.parallel_config.decode_context_parallel_size = 2
    assert support(config, spec) == getattr(AttentionCGSupport, at_dcp2)


@pytest.mark.parametrize("dcp", [1, 2])
def test_vllm_keeps_full_graphs_for_a_speculative_run_on_this_backend(monkeypatch, dcp):
    """vLLM's own resolution of the graph mode (CompilationConfig.resolve_cudagraph_mode_and_sizes) for a run with
    4 proposed tokens a step: with the builder's support it keeps FULL_AND_PIECEWISE; with the level it declared
    before (UNIFORM_SINGLE_TOKEN_DECODE, the control) vLLM drops the whole run to PIECEWISE."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    monkeypatch.delenv("DCP_TRITON_DCP_FULL_GRAPHS", raising=False)
    config = VllmConfig()
    config.parallel_config.decode_context_parallel_size = dcp
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16)
    ours = DcpTritonMetadataBuilder.get_cudagraph_support(config, spec)

    def resolved(support):
        compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
        compilation.set_splitting_ops_for_v1(all2all_backend="naive")  # attention splits the piecewise graphs
        return compilation.resolve_cudagraph_mode_and_sizes(support, "DCP_TRITON", uniform_decode_query_len=5,
                                                            use_v2_model_runner=True)

    assert resolved(ours) == CUDAGraphMode.FULL_AND_PIECEWISE
    assert resolved(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE) == CUDAGraphMode.PIECEWISE


def test_a_bad_full_graphs_flag_is_named(monkeypatch):
    monkeypatch.setenv("DCP_TRITON_DCP_FULL_GRAPHS", "yes")
    config = VllmConfig()
    config.parallel_config.decode_context_parallel_size = 2
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"DCP_TRITON_DCP_FULL_GRAPHS must be 1 \(full CUDA graphs for decode at DCP "
                                         r"> 1, the default\) or 0 .*got 'yes'"):
        DcpTritonMetadataBuilder.get_cudagraph_support(config, spec)


def test_consecutive_steps_reuse_the_workspace(monkeypatch):
    """What a replayed decode graph reads must sit at the captured addresses with the new step's values."""
    builder = make_builder(monkeypatch, dcp=1, rank=0, interleave=1)
    first = builder.build(0, common_metadata([1, 1, 1], [4, 90, 17], dcp=1, rank=0, interleave=1)).batch
    pointer = first.local_seq_lens.data_ptr()
    second = builder.build(0, common_metadata([1, 1, 1], [5, 91, 18], dcp=1, rank=0, interleave=1, seed=1)).batch
    assert second.local_seq_lens.data_ptr() == pointer
    assert second.local_seq_lens.tolist() == [6, 92, 19]


@pytest.mark.parametrize("mode, kind, spec_tokens, sized_for_capacity", [
    ("FULL_AND_PIECEWISE", "decode", 0, True), ("FULL_DECODE_ONLY", "decode", 0, True),
    ("FULL_AND_PIECEWISE", "verify", 4, True), ("FULL_AND_PIECEWISE", "decode", 4, True),
    ("FULL_AND_PIECEWISE", "verify", 0, False), ("FULL_AND_PIECEWISE", "verify", 2, False),
    ("FULL_AND_PIECEWISE", "mixed", 0, False), ("PIECEWISE", "decode", 0, False), ("PIECEWISE", "verify", 4, False),
    ("NONE", "decode", 0, False)])
def test_decode_split_count_is_fixed_under_full_graphs(monkeypatch, mode, kind, spec_tokens, sized_for_capacity):
    # A captured graph freezes the split count: with full decode graphs every step a graph may replay (single-token
    # decodes, and verify steps of exactly 1 + k rows) sizes it for the block table's capacity (not for the
    # capture's dummy lengths); other steps keep the batch's own maxima.
    builder = make_builder(monkeypatch, dcp=1, rank=0, interleave=1, speculative_tokens=spec_tokens)
    builder.vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    query_lens, context_lens = BATCHES[kind]
    cm = common_metadata(query_lens, context_lens, dcp=1, rank=0, interleave=1)
    batch = builder.build(0, cm).batch
    capacity = cm.block_table_tensor.shape[1] * BLOCK_SIZE
    assert capacity > cm.max_seq_len
    assert batch.max_seq_len == (capacity if sized_for_capacity else cm.max_seq_len)
    own_context = max(context_lens)
    context = capacity - cm.max_query_len if sized_for_capacity and kind == "verify" else own_context
    assert batch.max_context_len == context


@pytest.mark.parametrize("topology", [(2, 0, 1), (2, 1, 1), (4, 3, 1), (4, 1, 8)],
                         ids=lambda t: f"dcp{t[0]}-rank{t[1]}-il{t[2]}")
def test_a_v1_drafters_later_steps_get_the_owner_ranks_slots(monkeypatch, topology):
    """vLLM's V1 drafter computes the slots of its later draft steps (EAGLE / MTP with 2+ speculative tokens) with
    its EAGLE step kernel, ``block_table[pos // B] * B + pos % B`` on every rank (``v1/spec_decode/utils.py``), as if
    the cache were not sharded. ``build_for_drafting`` gives each new token (position seq_len - 1) vLLM's own DCP slot
    (``vllm_slot``: the owner rank's row, -1 elsewhere), in vLLM's buffer too; the first draft step (index 0, the
    target's slots) and a slot vLLM padded (-1) are kept."""
    dcp, rank, interleave = topology
    builder = make_builder(monkeypatch, dcp=dcp, rank=rank, interleave=interleave, speculative_tokens=3)
    seq_lens = [71, 2, 130, 1, 47]
    width = -(-max(seq_lens) // (BLOCK_SIZE * dcp)) + 2
    pages = torch.randperm(len(seq_lens) * width, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    pages = pages.view(len(seq_lens), width)

    def eagle_step_slot(req: int) -> int:  # vLLM's kernel, its block number clamped to the table's width
        pos = seq_lens[req] - 1
        return int(pages[req, min(pos // BLOCK_SIZE, width - 1)]) * BLOCK_SIZE + pos % BLOCK_SIZE

    def drafting_step(draft_index: int, padded: int | None = None):
        slots = [eagle_step_slot(r) for r in range(len(seq_lens))]
        if padded is not None:
            slots[padded] = -1
        n = len(seq_lens)
        qsl, seq = torch.arange(n + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=n, num_actual_tokens=n,
            max_query_len=1, max_seq_len=max(seq_lens), block_table_tensor=pages,
            slot_mapping=torch.tensor(slots + [-1, -1], dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone())
        return cm, builder.build_for_drafting(cm, draft_index=draft_index).batch.slot_mapping.tolist(), slots

    want = [vllm_slot(s - 1, pages[r].tolist(), block_size=BLOCK_SIZE, dcp=dcp, rank=rank, interleave=interleave)
            for r, s in enumerate(seq_lens)]
    cm, got, _ = drafting_step(draft_index=1)
    assert got == want and cm.slot_mapping.tolist() == want + [-1, -1]
    assert got != [eagle_step_slot(r) for r in range(len(seq_lens))]  # vLLM's kernel got some of them wrong
    _, got, _ = drafting_step(draft_index=2, padded=2)
    assert got == want[:2] + [-1] + want[3:]
    _, got, given = drafting_step(draft_index=0)
    assert got == given
