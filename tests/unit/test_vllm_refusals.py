"""Startup refusals: each unsupported setting stops vLLM before any step runs (while it builds its engine config,
the model or the KV cache), with an error that names the option.

Refusals tested elsewhere: head sizes, encoder-only attention and the other layer options through the impl
(``tests/unit/test_vllm_registration.py``, ``LAYER_REFUSALS``), the selector's wording
(``test_selector_validation_names_what_is_supported`` there), an interleave that does not divide the block size
in the metadata builder (``tests/unit/test_vllm_builder.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import (  # noqa: E402
    chunked_local_attention, cross_attention, encoder_only_attention,
)
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from tests.helpers.vllm_checks import single_process_vllm_groups, write_llama_config  # noqa: E402

CHUNK = 64


def engine_config(tmp_path, config_overrides=None, **engine_args):
    """vLLM's engine config for a tiny Llama (1 KV head, so DCP = 2 fits tp = 2) with dcp-triton selected."""
    model = write_llama_config(tmp_path / "tiny", num_key_value_heads=1, **(config_overrides or {}))
    return EngineArgs(model=str(model), dtype="float32", skip_tokenizer_init=True, attention_backend="dcp-triton",
                      **engine_args).create_engine_config()


def select_dcp_triton(monkeypatch, module) -> None:
    """What vLLM's CUDA selector returns in ``module`` for ``--attention-backend dcp-triton`` (the CPU platform
    would return ``CPU_ATTN``, which registration routes to dcp-triton in an engine's processes)."""
    monkeypatch.setattr(module, "get_attn_backend", lambda *args, **kwargs: DcpTritonBackend)


def test_chunked_local_attention_is_refused_when_the_model_is_built(tmp_path, monkeypatch):
    """Llama 4's ``attention_chunk_size``: vLLM wraps dcp-triton's metadata builder in one whose first step fails
    on dcp-triton's frozen metadata, so building the layer (vLLM's ``ChunkedLocalAttention``) refuses it."""
    wrapped = chunked_local_attention.create_chunked_local_attention_backend(DcpTritonBackend, CHUNK)
    assert issubclass(wrapped.get_builder_cls(), DcpTritonMetadataBuilder)  # what the first step would build with
    config = engine_config(tmp_path, {"attention_chunk_size": CHUNK})
    assert config.model_config.attention_chunk_size == CHUNK
    select_dcp_triton(monkeypatch, chunked_local_attention)
    monkeypatch.setenv("DCP_TRITON_KERNELS", "reference")
    prefix = "model.layers.0.self_attn.attn"
    expected = (rf"attention_chunk_size={CHUNK}: chunked local attention is not supported; supported: "
                r"full-context decoder attention")
    # A worker's process groups, so that nothing but the refusal can stop the layer's construction.
    with set_current_vllm_config(config), single_process_vllm_groups(tmp_path), \
            pytest.raises(ValueError, match=expected):
        chunked_local_attention.ChunkedLocalAttention(4, 64, 0.125, attention_chunk_size=CHUNK, num_kv_heads=1,
                                                      prefix=prefix)
    assert prefix not in config.compilation_config.static_forward_context  # the model runner never sees the layer


@pytest.mark.parametrize(("module", "layer", "attn_type"), [
    (encoder_only_attention, "EncoderOnlyAttention", "encoder_only"),
    (cross_attention, "CrossAttention", "encoder_decoder"),
])
def test_encoder_and_cross_attention_layers_are_refused(tmp_path, monkeypatch, module, layer, attn_type):
    """vLLM's own encoder-only and cross-attention layer classes, built on dcp-triton, refuse at construction."""
    select_dcp_triton(monkeypatch, module)
    with set_current_vllm_config(engine_config(tmp_path)), \
            pytest.raises(ValueError, match=rf"attn_type='{attn_type}': only decoder self-attention"):
        getattr(module, layer)(4, 64, 0.125, num_kv_heads=1, prefix=f"model.layers.0.{layer}")


def test_mla_is_refused_by_the_backend_selector():
    """An MLA layer asks the selector with ``use_mla=True``; vLLM's CUDA platform raises with these reasons."""
    selector = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                                       use_mla=True)
    # The call vLLM's CUDA platform makes for a selected backend (platforms/cuda.py, get_attn_backend_cls).
    reasons = DcpTritonBackend.validate_configuration(device_capability=None, **selector._asdict())
    assert "MLA not supported" in reasons  # vLLM's own reason
    assert any("use_mla=True: multi-head latent attention" in r and "supported: " in r for r in reasons), reasons


def test_tp_not_divisible_by_dcp_is_refused_by_vllms_config(tmp_path):
    """vLLM's ``ParallelConfig`` refuses it while the engine config is built, naming both sizes, so dcp-triton's
    own topology check (``ParallelState``) is never reached."""
    with pytest.raises(ValueError, match=r"tp_size=3 must be divisible by dcp_size=2"):
        engine_config(tmp_path, tensor_parallel_size=3, decode_context_parallel_size=2)


def test_interleave_not_dividing_the_block_is_refused_by_vllm_before_the_kv_cache(tmp_path):
    """At DCP > 1 vLLM's engine core checks ``cp_kv_cache_interleave_size`` against the final block size before it
    allocates KV caches (``VllmConfig.validate_block_size``, an assertion naming the option)."""
    config = engine_config(tmp_path, tensor_parallel_size=2, decode_context_parallel_size=2,
                           cp_kv_cache_interleave_size=3, block_size=16)
    with pytest.raises(AssertionError, match=r"Block_size\(16\) .*divisible by cp_kv_cache_interleave_size \(3\)"):
        config.validate_block_size()
