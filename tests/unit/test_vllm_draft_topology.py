"""A draft model inside a DCP = 2 target: its own topology at DCP 1, its own KV-cache sharding, and the refusals.

One worker of tp = 2 (TP rank 1) whose vLLM DCP group has 2 ranks, simulated in one process: vLLM's real
``VllmConfig`` (a target with a ``draft_model`` speculative config), ``FullAttentionSpec(dcp_sharded=...)`` and our
metadata builder, with vLLM's group accessors patched. The draft's config is made as vLLM's V2 runner makes it:
the target's config with the draft's model config and ``speculative_config``'s own parallel config (DCP 1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import SpeculativeConfig, set_current_vllm_config  # noqa: E402
from vllm.config.utils import replace  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin.adapters.vllm import spec  # noqa: E402
from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from dcp_plugin.adapters.vllm.impl import DcpTritonImpl  # noqa: E402
from dcp_plugin.testing import causal_attention_f64  # noqa: E402
from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.unit.test_vllm_builder import BLOCK_SIZE, common_metadata  # noqa: E402
from tests.helpers.vllm_checks import single_process_vllm_groups, vllm_slot, write_llama_config  # noqa: E402

D = 64
TARGET = dict(num_attention_heads=4, num_key_value_heads=1)  # per TP rank: 2 Q heads, KV head 0 (shared by DCP)
DRAFT = dict(num_attention_heads=8, num_key_value_heads=2)  # per TP rank: 4 Q heads, 1 KV head; cannot run at DCP 2
DRAFT_LAYER = "draft_model.model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def target_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft_topology")
    target = write_llama_config(tmp / "target", head_dim=D, **TARGET)
    draft = write_llama_config(tmp / "draft", head_dim=D, **DRAFT)
    config = EngineArgs(model=str(target), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                        attention_backend="dcp-triton", speculative_config={
                            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                        }).create_engine_config()
    with set_current_vllm_config(config), single_process_vllm_groups(tmp):
        yield config


@pytest.fixture
def worker(target_config, monkeypatch):
    """TP rank 1 of 2 with a DCP group of 2 (DCP rank 1): the target's config and the draft's, as vLLM builds it."""
    parallel = target_config.parallel_config
    monkeypatch.setattr(parallel, "tensor_parallel_size", 2)
    monkeypatch.setattr(parallel, "decode_context_parallel_size", 2)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(world_size=2, rank_in_group=1))
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: SimpleNamespace(
        world_size=2, rank_in_group=1, device_group=None, device_communicator=None))
    # vLLM's answer for a group that DCP shards (enabled) or not.
    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank",
                        lambda enabled=True: (2, 1) if enabled else (1, 0))
    monkeypatch.setenv("DCP_TRITON_KERNELS", "reference")
    spec_config = target_config.speculative_config
    draft_parallel = SpeculativeConfig.create_draft_parallel_config(parallel, 2, spec_config.draft_model_config)
    draft_config = replace(target_config, model_config=spec_config.draft_model_config,
                           parallel_config=replace(draft_parallel, rank=parallel.rank))
    return SimpleNamespace(target=target_config, draft=draft_config)


def make_impl(config, model: dict) -> DcpTritonImpl:
    """A layer's impl as vLLM builds it under ``config``, with ``model``'s head counts per TP rank (KV heads
    replicated when fewer than the ranks)."""
    with set_current_vllm_config(config):
        return DcpTritonImpl(model["num_attention_heads"] // 2, D, D**-0.5, max(1, model["num_key_value_heads"] // 2))


def make_builder(config, *, dcp_sharded: bool, layers=(DRAFT_LAYER,)) -> DcpTritonMetadataBuilder:
    kv_spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=D, dtype=torch.float32,
                                dcp_sharded=dcp_sharded)
    return DcpTritonMetadataBuilder(kv_spec, list(layers), config, torch.device("cpu"))


@pytest.mark.parametrize("dcp_sharded, layout", [(True, (2, 1)), (False, (1, 0))])
def test_kv_cache_group_sharding_decides_the_token_layout(worker, dcp_sharded, layout):
    tokens = make_builder(worker.target, dcp_sharded=dcp_sharded).tokens
    assert (tokens.dcp_size, tokens.dcp_rank) == layout
    assert tokens.block_size == BLOCK_SIZE


def test_draft_gets_its_own_parallel_state_at_dcp_1(worker):
    target, draft = make_impl(worker.target, TARGET), make_impl(worker.draft, DRAFT)
    assert (target.dcp_world_size, draft.dcp_world_size) == (2, 1)  # vLLM's AttentionImplBase.__new__
    t, d = target.topology, draft.topology
    assert (t.parallel.tp_rank, t.parallel.tp_size, t.parallel.dcp_rank, t.parallel.dcp_size) == (1, 2, 1, 2)
    assert (d.parallel.tp_rank, d.parallel.tp_size, d.parallel.dcp_rank, d.parallel.dcp_size) == (1, 2, 0, 1)
    # The target: TP's 2 Q heads of 4, the DCP group's 4 gathered, the one KV head the group shares.
    assert (t.heads.dcp_size, t.heads.q_head_start, t.heads.num_q_heads, t.heads.num_group_q_heads) == (2, 2, 2, 4)
    assert (t.heads.kv_head_start, t.heads.num_kv_heads) == (0, 1)
    assert t.group is not None and (t.group.world_size, t.group.rank_in_group) == (2, 1)
    # The draft: TP's 4 Q heads of 8 and its KV head, all of them its own (no DCP slice, no group).
    assert (d.heads.dcp_size, d.heads.q_head_start, d.heads.num_q_heads, d.heads.num_group_q_heads) == (1, 4, 4, 4)
    assert (d.heads.kv_head_start, d.heads.num_kv_heads, d.heads.q_per_kv) == (1, 1, 4)
    assert d.group is None and draft.workspace is not target.workspace


def test_draft_attends_its_replicated_cache_exactly(worker):
    """A decode and a verify row (1 + 3 proposals) of the draft at DCP 1, on a cache vLLM does not shard."""
    impl = make_impl(worker.draft, DRAFT)
    query_lens, contexts = [1, 4], [21, 37]
    cm = common_metadata(query_lens, contexts, dcp=1, rank=0, interleave=1)
    metadata = make_builder(worker.target, dcp_sharded=False).build(0, cm)
    gen = torch.Generator().manual_seed(3)
    seq = [torch.randn(c + n, 3, 1, D, generator=gen) for c, n in zip(contexts, query_lens)]  # k, v, q (1 head)
    queries = [torch.randn(n, 4, D, generator=gen) for n in query_lens]
    kv_cache = torch.zeros(int(cm.block_table_tensor.max()) + 1, 1, BLOCK_SIZE, 2 * D)
    for r, c in enumerate(contexts):  # earlier steps' K/V, where vLLM's slot mapping puts them
        slots = torch.tensor([vllm_slot(p, cm.block_table_tensor[r].tolist(), block_size=BLOCK_SIZE, dcp=1, rank=0,
                                         interleave=1)
                              for p in range(c)])
        impl.do_kv_cache_update(None, seq[r][:c, 0], seq[r][:c, 1], kv_cache, slots)
    new = [s[c:] for s, c in zip(seq, contexts)]
    out = torch.full((sum(query_lens), 4, D), float("nan"))
    impl.forward(None, torch.cat(queries), torch.cat([s[:, 0] for s in new]), torch.cat([s[:, 1] for s in new]),
                 kv_cache, metadata, out)
    want = torch.cat([causal_attention_f64(q, s[:, 0], s[:, 1], c + torch.arange(q.shape[0]), scale=D**-0.5,
                                           q_per_kv=q.shape[1] // s.shape[2])
                      for q, s, c in zip(queries, seq, contexts)])
    assert_matches(out, want, torch.float32, "draft at DCP 1")


def test_draft_first_pass_metadata_keeps_a_true_context_bound(worker):
    """vLLM's draft-model proposer extends every query by one slot (``extend_all_queries_by_N``), which raises
    ``seq_lens`` and ``max_seq_len`` but not ``seq_lens_cpu_upper_bound``: the rank-invariant context bound the
    builder hands the core must still cover every context (the CPU build checks it against the tensors)."""
    from vllm.v1.spec_decode.utils import extend_all_queries_by_N

    query_lens, contexts = [4, 1], [37, 90]
    cm = common_metadata(query_lens, contexts, dcp=1, rank=0, interleave=1)
    extended = extend_all_queries_by_N(cm, 1, torch.arange(len(contexts) + 1, dtype=torch.int32),
                                       torch.arange(sum(query_lens) + len(contexts)))
    assert extended.seq_lens_cpu_upper_bound.tolist() == [41, 91] and extended.seq_lens.tolist() == [42, 92]
    batch = make_builder(worker.target, dcp_sharded=False).build(0, extended).batch
    assert batch.context_lens.tolist() == contexts and batch.max_context_len >= max(contexts)


def test_draft_on_a_sharded_cache_is_refused_at_its_first_step(worker):
    """impl._bind: a layer built at DCP 1 handed a batch of a KV-cache group sharded over DCP 2."""
    impl = make_impl(worker.draft, DRAFT)
    cm = common_metadata([1], [40], dcp=2, rank=1, interleave=1)
    metadata = make_builder(worker.target, dcp_sharded=True, layers=["unregistered"]).build(0, cm)
    x = torch.zeros(1, 4, D)
    with pytest.raises(ValueError, match=r"sharded over DCP size 2 .*runs at DCP size 1.*decode_context_parallel_size"):
        impl.forward(None, x, x[:, :1], x[:, :1], torch.zeros(8, 1, BLOCK_SIZE, 2 * D), metadata, x.clone())


@pytest.mark.parametrize("dcp_sharded", [True, False])
def test_builder_refuses_a_draft_group_at_startup(worker, monkeypatch, dcp_sharded):
    """The same mismatch, found when vLLM makes the group's builder (every layer's impl exists by then)."""
    context = worker.target.compilation_config.static_forward_context
    monkeypatch.setitem(context, DRAFT_LAYER, SimpleNamespace(impl=make_impl(worker.draft, DRAFT)))
    monkeypatch.setitem(context, "model.layers.0.self_attn.attn", SimpleNamespace(impl=make_impl(worker.target,
                                                                                                 TARGET)))
    assert make_builder(worker.target, dcp_sharded=True, layers=["model.layers.0.self_attn.attn"]).tokens.dcp_size == 2
    if not dcp_sharded:  # the replicated draft cache vLLM means to give it
        assert make_builder(worker.target, dcp_sharded=False).tokens.dcp_size == 1
        return
    with pytest.raises(ValueError, match=rf"layer {DRAFT_LAYER}\).*decode_context_parallel_size=1.*"
                                         r"VLLM_USE_V2_MODEL_RUNNER=0"):
        make_builder(worker.target, dcp_sharded=True)


def test_builder_refuses_a_draft_layer_reading_the_targets_cache(worker, monkeypatch):
    """vLLM 0.26's Gemma 4 / Step 3.5 MTP proposers point a draft layer at a target layer's cache after the impl was
    built; dcp-triton writes K/V in forward, so the draft's would land in the target's cache."""
    draft = SimpleNamespace(impl=make_impl(worker.draft, DRAFT), kv_sharing_target_layer_name=None)
    monkeypatch.setitem(worker.target.compilation_config.static_forward_context, DRAFT_LAYER, draft)
    assert make_builder(worker.target, dcp_sharded=False).tokens.dcp_size == 1  # its own cache: served
    draft.kv_sharing_target_layer_name = "model.layers.3.self_attn.attn"
    with pytest.raises(ValueError, match=r"kv_sharing_target_layer_name='model.layers.3.self_attn.attn'.*"
                                         r"overwrite the target's cache"):
        make_builder(worker.target, dcp_sharded=False)


def test_draft_heads_that_dcp_cannot_share_are_refused_naming_the_draft(worker, monkeypatch):
    """vLLM 0.26 builds the draft under a config at DCP 1 (so nothing in vLLM checks its heads against DCP) but its
    layers take the DCP group's size (0.26's ``AttentionImplBase.__new__`` reads ``get_dcp_group()``): 2 KV heads
    over tp = 2 would leave the two ranks of a DCP group with different KV heads."""
    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (2, 1))
    assert spec.is_draft(worker.draft) and not spec.is_draft(worker.target)
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=2, 8 Q heads, 2 KV heads.*"
                                         r"speculative_config's draft model"):
        make_impl(worker.draft, DRAFT)
