"""The impl built as vLLM's own attention-backend tests build every backend: outside an engine.

vLLM's attention-backend unit tests set a default ``VllmConfig`` as the current config (no model in it), initialize
no TP/DCP group, build the backend's metadata builder with a config that does have a model, then the impl from its
constructor arguments alone, and run ``forward`` on a paged cache they filled with every request's context. This
test does the same, on vLLM's batch shapes and the head counts of a Llama-3-8B-like model at tp 1, 2 and 4, and
compares with float64 attention over whole sequences.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.testing import causal_attention_f64, shuffled_block_table  # noqa: E402
from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.helpers.vllm_checks import cpu_platform_if_unspecified, write_llama_config  # noqa: E402

BLOCK, HEAD = 16, 128
# vLLM's BATCH_SPECS (seq_lens, query_lens) that its causal test runs, the CPU-sized ones.
BATCHES = {
    "small_decode": ([32, 40], [1, 1]),
    "small_prefill": ([32, 40], [8, 8]),
    "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5]),
    "medium_decode": ([128, 256, 512, 1024, 128, 256, 512, 1024], [1] * 8),
    "single_prefill": ([1024], [64]),
}
HEADS = {1: (32, 8), 2: (16, 4), 4: (8, 2)}  # tp -> the (Q, KV) heads vLLM's test gives a rank of Llama-3-8B
CASES = [("reference", "cpu", torch.float16, tp, batch) for tp in HEADS for batch in BATCHES]
CASES += [("triton", "cpu", torch.float32, 4, batch) for batch in ("small_decode", "mixed_small")]
CASES += [pytest.param("triton", "cuda", torch.bfloat16, tp, batch, marks=pytest.mark.gpu)
          for tp in HEADS for batch in BATCHES]


@pytest.fixture
def outside_an_engine(monkeypatch, tmp_path):
    """vLLM's test set-up: the builder's config has a model; the current config (the impl's) does not."""
    cpu_platform_if_unspecified(monkeypatch)
    model = write_llama_config(tmp_path / "llama", num_attention_heads=32, num_key_value_heads=8, head_dim=HEAD)
    builder_config = EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=BLOCK,
                                max_model_len=2048).create_engine_config()
    with set_current_vllm_config(VllmConfig()):
        yield builder_config


def paged_step(seq_lens, query_lens, q_heads, kv_heads, dtype, device, gen):
    """The step's queries and new K/V, the whole sequences' K/V, a cache holding each context at shuffled pages
    (vLLM's logical ``[num_blocks, kv_heads, block, K||V]`` view), and the metadata a runner gives the builder."""
    pages = [-(-s // BLOCK) for s in seq_lens]
    table = shuffled_block_table(pages, generator=gen, width=max(pages), fill=-1).to(device)
    cache = torch.zeros(sum(pages) + 1, kv_heads, BLOCK, 2 * HEAD, dtype=dtype, device=device)
    q, k_new, v_new, k_all, v_all, slots = [], [], [], [], [], []
    for r, (s, n) in enumerate(zip(seq_lens, query_lens)):
        k = torch.randn(s, kv_heads, HEAD, generator=gen).to(device, dtype)
        v = torch.randn(s, kv_heads, HEAD, generator=gen).to(device, dtype)
        pos = torch.arange(s, device=device)
        page, row = table[r, pos // BLOCK].long(), pos % BLOCK
        cache[page[: s - n], :, row[: s - n], :HEAD] = k[: s - n]
        cache[page[: s - n], :, row[: s - n], HEAD:] = v[: s - n]
        slots.append(page[s - n:] * BLOCK + row[s - n:])
        q.append(torch.randn(n, q_heads, HEAD, generator=gen).to(device, dtype))
        k_new.append(k[s - n:]), v_new.append(v[s - n:]), k_all.append(k), v_all.append(v)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table, slot_mapping=torch.cat(slots), seq_lens_cpu_upper_bound=seq.clone(),
    )
    return torch.cat(q), torch.cat(k_new), torch.cat(v_new), k_all, v_all, cache, metadata


@pytest.mark.parametrize(("kernels", "device", "dtype", "tp", "batch"), CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if not isinstance(v, int) else f"tp{v}")
def test_built_outside_an_engine_it_matches_attention(outside_an_engine, monkeypatch, kernels, device, dtype, tp,
                                                      batch):
    monkeypatch.setenv("DCP_TRITON_KERNELS", kernels)
    q_heads, kv_heads = HEADS[tp]
    seq_lens, query_lens = BATCHES[batch]
    gen = torch.Generator().manual_seed(42)
    q, k, v, k_all, v_all, cache, common = paged_step(seq_lens, query_lens, q_heads, kv_heads, dtype, device, gen)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=kv_heads, head_size=HEAD, dtype=dtype)
    builder = DcpTritonBackend.get_builder_cls()(spec, ["placeholder"], outside_an_engine, torch.device(device))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    impl = DcpTritonBackend.get_impl_cls()(num_heads=q_heads, head_size=HEAD, scale=HEAD**-0.5,
                                           num_kv_heads=kv_heads, alibi_slopes=None, sliding_window=None,
                                           kv_cache_dtype="auto")
    layer = SimpleNamespace(_q_scale=torch.tensor(1.0), _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    output = impl.forward(layer, q, k, v, cache, metadata, output=torch.full_like(q, float("nan")))

    assert (impl.topology.parallel.tp_size, impl.topology.heads.dcp_size) == (1, 1)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    expected = torch.cat([
        causal_attention_f64(q[a:b], k_all[r], v_all[r], torch.arange(seq_lens[r] - (b - a), seq_lens[r]),
                             scale=HEAD**-0.5, q_per_kv=q_heads // kv_heads)
        for r, (a, b) in enumerate(zip(starts[:-1], starts[1:]))
    ])
    assert_matches(output, expected, dtype, f"{kernels}/{batch}/tp{tp}")


def test_dcp_above_one_outside_an_engine_is_refused(outside_an_engine, monkeypatch):
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (2, 0))
    with pytest.raises(ValueError, match="decode_context_parallel_size=2 without vLLM's tensor-parallel group"):
        DcpTritonBackend.get_impl_cls()(num_heads=8, head_size=HEAD, scale=1.0, num_kv_heads=2)
