"""The impl on vLLM's own KV-cache views (every KVCacheLayout): cache write, forward vs float64 attention, padding.

One vLLM worker's state in this process: a real VllmConfig for a tiny Llama config and vLLM's TP/DCP groups of
one rank. The step has decodes, a fresh prompt and a chunk continuing a cached prefix; ``forward`` writes the
step's K/V (the backend declares ``forward_includes_kv_cache_update``), earlier steps' K/V reach the cache through
``do_kv_cache_update``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheLayout, KVCacheTensor, compute_layout_strides, create_kv_cache_views,
)

from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from dcp_plugin.adapters.vllm.impl import DcpTritonImpl  # noqa: E402
from dcp_plugin.testing import causal_attention_f64, shuffled_block_table  # noqa: E402
from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.helpers.vllm_checks import single_process_vllm_groups, write_llama_config  # noqa: E402

H_Q, H_KV, D, BLOCK, NUM_BLOCKS = 4, 2, 64, 16, 24
BATCHES = {  # (cached context, new tokens) per request
    "mixed": [(37, 1), (0, 20), (130, 5), (16, 1)],
    "decode": [(37, 1), (130, 1), (0, 1), (16, 1)],  # one query token each: the core's whole-shard decode path
}
PAD_TOKENS = 3  # rows past the batch's tokens, as a padded vLLM step has them
CASES = [("reference", layout, dtype, "auto") for layout in KVCacheLayout for dtype in (torch.float32, torch.float16)]
CASES += [("triton", layout, torch.float32, "auto") for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LHBNC)]
# vLLM allocates an fp8 cache as bytes; the impl views it as fp8 and scales by the layer's _k_scale / _v_scale.
CASES += [("reference", KVCacheLayout.LBNHC, torch.float16, "fp8"), ("reference", KVCacheLayout.LHBNC, torch.float32,
                                                                     "fp8_e5m2")]
CASE_IDS = [f"{k}-{layout.name}-{str(dt).removeprefix('torch.')}-{c}" for k, layout, dt, c in CASES]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
K_SCALE, V_SCALE = 0.5, 0.25  # powers of two: the test's K/V (fp8 values times these) are exact in every dtype


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_impl")
    model = write_llama_config(tmp / "tiny", num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D)
    config = EngineArgs(model=str(model), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
                        attention_backend="dcp-triton").create_engine_config()
    with set_current_vllm_config(config), single_process_vllm_groups(tmp):
        yield config


def layer_kv_cache(layout: KVCacheLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1 of a two-layer allocation, viewed exactly as vLLM's allocate_kv_cache views it; also layer 0."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H_KV, head_size=D, dtype=dtype)
    strides = compute_layout_strides(spec, NUM_BLOCKS, 2, layout)
    size = 2 * NUM_BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=["l0", "l1"], layer_stride=strides[0], block_stride=strides[1])
    layer0, layer1 = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, NUM_BLOCKS, layout, tensor)
    return layer1, layer0


def make_impl(monkeypatch, kernels: str, kv_cache_dtype: str = "auto") -> DcpTritonImpl:
    monkeypatch.setenv("DCP_TRITON_KERNELS", kernels)
    return DcpTritonImpl(H_Q, D, D**-0.5, H_KV, kv_cache_dtype=kv_cache_dtype)


def naive_attention(q, k_ctx, v_ctx, k_new, v_new) -> torch.Tensor:
    """float64 causal attention of one request's new queries over context + new keys, Q head h -> KV h // q_per_kv."""
    positions = k_ctx.shape[0] + torch.arange(q.shape[0])
    return causal_attention_f64(q, torch.cat([k_ctx, k_new]), torch.cat([v_ctx, v_new]), positions, scale=D**-0.5,
                                q_per_kv=H_Q // H_KV)


@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize(("kernels", "layout", "dtype", "cache"), CASES, ids=CASE_IDS)
def test_cache_write_and_forward_match_attention_over_whole_sequences(worker, monkeypatch, kernels, layout, dtype,
                                                                     cache, batch_kind):
    requests = BATCHES[batch_kind]
    gen = torch.Generator().manual_seed(7)
    fp8 = FP8.get(cache)
    kv_cache, other_layer = layer_kv_cache(layout, dtype if fp8 is None else torch.uint8)
    impl = make_impl(monkeypatch, kernels, cache)
    layer = SimpleNamespace(_k_scale=torch.tensor(K_SCALE), _v_scale=torch.tensor(V_SCALE))  # vLLM's buffers
    pages = [-(-(c + q) // BLOCK) for c, q in requests]
    table = shuffled_block_table(pages, generator=gen, width=max(pages), fill=-1)

    def slots(r: int, start: int, stop: int) -> list[int]:
        return [int(table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in range(start, stop)]

    def rand(*shape, scale=1.0):
        """Model-dtype values; for an fp8 cache, ones it holds exactly (so the float64 oracle needs no rounding)."""
        x = torch.randn(*shape, generator=gen)
        return (x if fp8 is None else x.to(fp8).float() * scale).to(dtype)

    k_ctx = [rand(c, H_KV, D, scale=K_SCALE) for c, _ in requests]
    v_ctx = [rand(c, H_KV, D, scale=V_SCALE) for c, _ in requests]
    # Earlier steps: the cached contexts, written through the same path as this step's tokens.
    ctx_slots = torch.tensor(sum((slots(r, 0, c) for r, (c, _) in enumerate(requests)), []), dtype=torch.int64)
    impl.do_kv_cache_update(layer, torch.cat(k_ctx), torch.cat(v_ctx), kv_cache, ctx_slots)

    num_tokens = sum(q for _, q in requests)
    q_all = torch.randn(num_tokens + PAD_TOKENS, H_Q, D, generator=gen).to(dtype)
    k_all, v_all = rand(num_tokens + PAD_TOKENS, H_KV, D, scale=K_SCALE), rand(num_tokens + PAD_TOKENS, H_KV, D,
                                                                                scale=V_SCALE)
    step_slots = torch.tensor(sum((slots(r, c, c + q) for r, (c, q) in enumerate(requests)), []), dtype=torch.int64)
    query_lens = [q for _, q in requests]
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(requests),
        num_actual_tokens=num_tokens + PAD_TOKENS, max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.cat([step_slots, torch.full((PAD_TOKENS,), -1)]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H_KV, head_size=D, dtype=kv_cache.dtype)
    metadata = DcpTritonMetadataBuilder(spec, ["l1"], worker, torch.device("cpu")).build(0, cm)
    output = torch.full((num_tokens + PAD_TOKENS, H_Q, D), float("nan"), dtype=dtype)
    returned = impl.forward(layer, q_all, k_all, v_all, kv_cache, metadata, output)  # padding rows: no slot

    assert returned is output
    # The cache through vLLM's logical [block, kv_head, row, K||V] view: every written token where its slot says,
    # nothing anywhere else, the other layer untouched.
    written = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    stored = kv_cache if fp8 is None else kv_cache.view(fp8).to(dtype) * torch.tensor([K_SCALE] * D + [V_SCALE] * D,
                                                                                     dtype=dtype)
    for slot_list, k_rows, v_rows in ((ctx_slots, torch.cat(k_ctx), torch.cat(v_ctx)), (step_slots, k_all, v_all)):
        page, row = slot_list // BLOCK, slot_list % BLOCK
        assert torch.equal(stored[page, :, row, :D], k_rows[: len(slot_list)])
        assert torch.equal(stored[page, :, row, D:], v_rows[: len(slot_list)])
        written[page, row] = True
    assert not kv_cache.transpose(1, 2)[~written].any(), "K/V written to a slot nobody owns (padding rows?)"
    assert not other_layer.any()

    expected = torch.cat([
        naive_attention(q_all[a:b], k_ctx[r], v_ctx[r], k_all[a:b], v_all[a:b])
        for r, (a, b) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist()))
    ])
    assert_matches(output[:num_tokens], expected, dtype, f"{kernels}/{layout.name}/{dtype}")
    assert torch.equal(output[num_tokens:], torch.zeros(PAD_TOKENS, H_Q, D, dtype=dtype)), "padding rows not zeroed"


def test_profiling_run_fills_zeros(worker, monkeypatch):
    impl = make_impl(monkeypatch, "reference")
    output = torch.full((5, H_Q, D), float("nan"))
    kv_cache, _ = layer_kv_cache(KVCacheLayout.LBNHC, torch.float32)
    impl.forward(None, torch.randn(5, H_Q, D), torch.randn(5, H_KV, D), torch.randn(5, H_KV, D), kv_cache, None,
                 output)
    assert torch.equal(output, torch.zeros_like(output))


def test_fused_output_quantization_is_refused(worker, monkeypatch):
    impl = make_impl(monkeypatch, "reference")
    output = torch.zeros(1, H_Q, D)
    with pytest.raises(ValueError, match="output_scale"):
        impl.forward(None, output, output, output, output, None, output, output_scale=torch.ones(1))


def test_topology_comes_from_vllm_groups(worker, monkeypatch):
    impl = make_impl(monkeypatch, "reference")
    t = impl.topology
    assert (t.parallel.tp_size, t.parallel.tp_rank, t.parallel.dcp_size, t.parallel.dcp_rank) == (1, 0, 1, 0)
    assert (t.heads.num_q_heads, t.heads.num_kv_heads, t.heads.q_per_kv) == (H_Q, H_KV, H_Q // H_KV)
    assert (t.interleave, t.comm, t.group) == (1, "ag_rs", None)
    assert impl.kernel_path.startswith("reference")


def test_micro_batching_is_refused_at_startup(worker, monkeypatch):
    monkeypatch.setattr(worker.parallel_config, "enable_dbo", True)
    with pytest.raises(ValueError, match="enable_dbo"):
        make_impl(monkeypatch, "reference")


def test_forward_writes_the_cache_and_layers_share_one_workspace(worker, monkeypatch):
    from dcp_plugin.adapters.vllm.backend import DcpTritonBackend

    assert DcpTritonBackend.forward_includes_kv_cache_update  # vLLM then never calls do_kv_cache_update
    first, second = make_impl(monkeypatch, "reference"), make_impl(monkeypatch, "reference")
    assert first.workspace is second.workspace
    assert first.workspace.max_num_tokens == worker.scheduler_config.max_num_batched_tokens


def test_fp8_cache_with_the_triton_interpreter_is_refused_at_startup(worker, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' with the Triton interpreter"):
        make_impl(monkeypatch, "triton", "fp8")


def test_an_engine_on_a_gpu_starts_its_compile_workers_when_it_builds_the_model(worker, monkeypatch):
    """Each layer built inside an engine on a GPU asks for the compile workers ahead (``workers_ahead``: started
    once, then counted); a layer built outside an engine (no model config) or off the GPU does not."""
    from dcp_plugin.adapters.vllm import impl as impl_module

    asked = []
    monkeypatch.setattr(impl_module, "workers_ahead", lambda device: asked.append(device.type) or 8)
    make_impl(monkeypatch, "reference")
    assert asked == []  # this machine has no GPU
    monkeypatch.setattr(impl_module.torch.cuda, "is_available", lambda: True)
    make_impl(monkeypatch, "reference")
    make_impl(monkeypatch, "reference")
    assert asked == ["cuda", "cuda"]
    monkeypatch.setattr(worker, "model_config", None)
    make_impl(monkeypatch, "reference")
    assert asked == ["cuda", "cuda"]


def test_the_profiling_run_starts_the_warm_up_early_on_a_cache_laid_out_as_vllms(worker, monkeypatch):
    """vLLM's profiling run (an empty KV cache, no metadata) starts compiling the warm-up's kernel variants in worker
    processes (``warm_up_early``), once per layer kind, over a cache of two blocks whose K/V views have the real
    cache's block shape and dtype, and strides Triton specializes alike (1, or multiples of 16) in every layout vLLM
    allocates; the first forward with the real cache runs the warm-up proper on the same ``DcpAttention``."""
    from dcp_plugin.adapters.vllm import impl as impl_module
    from dcp_plugin.adapters.vllm.impl import split_kv_cache

    calls = []
    monkeypatch.setattr(impl_module, "warm_up_early", lambda attention, **t: calls.append(("early", attention, t)))
    monkeypatch.setattr(impl_module, "timed_warm_up", lambda attention, **t: calls.append(("proper", attention, t))
                        or "warmed up")
    monkeypatch.setattr(impl_module, "_warmed_early", set())
    monkeypatch.setattr(impl_module, "_warmed", set())
    first, second = make_impl(monkeypatch, "reference"), make_impl(monkeypatch, "reference")
    first._compiled = second._compiled = True  # as on a GPU (the torch reference kernels compile nothing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # this torch has no CUDA
    q, k, v = torch.randn(5, H_Q, D), torch.randn(5, H_KV, D), torch.randn(5, H_KV, D)
    output = torch.full((5, H_Q, D), float("nan"))
    for impl in (first, first, second):  # two layers of one kind, the first called twice
        impl.forward(None, q, k, v, torch.empty(0), None, output)
    assert [c[0] for c in calls] == ["early"] and torch.equal(output, torch.zeros_like(output))
    early = calls[0][2]

    def specialized(t: torch.Tensor) -> list[bool]:
        return [s == 1 or s % 16 == 0 for s in t.stride()]

    for layout in KVCacheLayout:
        real_k, real_v = split_kv_cache(layer_kv_cache(layout, torch.float32)[0], D)
        for mine, theirs in ((early["key_cache"], real_k), (early["value_cache"], real_v)):
            assert (mine.shape[1:], mine.dtype) == (theirs.shape[1:], theirs.dtype)
            assert specialized(mine) == specialized(theirs), layout
    kv_cache, _ = layer_kv_cache(KVCacheLayout.LBNHC, torch.float32)
    first.forward(None, q, k, v, kv_cache, None, output)
    assert [c[0] for c in calls] == ["early", "proper"] and calls[1][1] is calls[0][1]


@pytest.mark.parametrize(("block", "want"), [(64, 64), (16, 16), (192, 192), (24, None), (0, None), (None, None)])
def test_the_early_warm_up_takes_vllms_block_size_as_its_profiling_run_finds_it(worker, monkeypatch, block, want):
    """The block size is read when the profiling run reaches the layer (vLLM settles it after building the model:
    the backend's preferred size, a hybrid model's grown block), not at construction; one vLLM would not keep as
    the kernels' block (not a multiple of 16) starts nothing."""
    from dcp_plugin.adapters.vllm import impl as impl_module

    calls = []
    monkeypatch.setattr(impl_module, "warm_up_early", lambda attention, **t: calls.append(t["key_cache"].shape[1]))
    monkeypatch.setattr(impl_module, "_warmed_early", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    impl = make_impl(monkeypatch, "reference")
    impl._compiled = True
    monkeypatch.setattr(worker.cache_config, "block_size", block)  # settled after the impl was built
    output = torch.zeros(3, H_Q, D)
    impl.forward(None, torch.randn(3, H_Q, D), torch.randn(3, H_KV, D), torch.randn(3, H_KV, D), torch.empty(0),
                 None, output)
    assert calls == ([] if want is None else [want])


def test_an_early_warm_up_that_fails_is_a_warning_and_the_profiling_run_goes_on(worker, monkeypatch, caplog):
    from dcp_plugin.adapters.vllm import impl as impl_module

    def broken(attention, **tensors):
        raise RuntimeError("no worker could start")

    monkeypatch.setattr(impl_module, "warm_up_early", broken)
    monkeypatch.setattr(impl_module, "_warmed_early", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    impl = make_impl(monkeypatch, "reference")
    impl._compiled = True
    output = torch.full((3, H_Q, D), float("nan"))
    with caplog.at_level("WARNING", logger="vllm.dcp_triton"):
        impl.forward(None, torch.randn(3, H_Q, D), torch.randn(3, H_KV, D), torch.randn(3, H_KV, D), torch.empty(0),
                     None, output)
    assert torch.equal(output, torch.zeros_like(output))
    assert "could not start in vLLM's profiling run (RuntimeError: no worker could start)" in caplog.text
