"""Speculative decoding under DCP: the draft configurations dcp-triton refuses at start-up, and why.

Verify steps need nothing here: the current-chunk / cached-prefix split is exact for any number of query tokens
(docs/design.md section 1). Draft models are another matter. vLLM decides the DCP size a draft's layers are built
at (``AttentionImplBase.__new__``) apart from the DCP size its KV cache is sharded over (the KV-cache group's
``dcp_sharded``), and may hand a draft layer the target's cache. Refused:

- vLLM 0.32/0.33, V2 model runner, ``method="draft_model"``: the draft is built from ``speculative_config``'s own
  parallel config, whose ``decode_context_parallel_size`` is 1, so its layers run at DCP 1; its cache is marked
  replicated only when the speculator's DCP size is 1, and the speculator reads the target's, so at a target DCP
  size above 1 the cache stays sharded.
- vLLM 0.26 builds the draft under a parallel config at DCP 1 but its layers take the DCP group's size: the sizes
  agree, but vLLM's DCP check of the heads never runs for the draft, so a draft whose KV heads the DCP group cannot
  share is refused by the head placement (``topology.head_layout``); ``draft_note`` says that the model is the draft.
- An MTP draft that reads the target's KV cache gets ``kv_sharing_target_layer_name`` after its impl was built
  (vLLM 0.26's Gemma 4 and Step 3.5 proposers), and the layer leaves the cache write to a backend that writes in
  forward, as dcp-triton does: the draft's K/V would overwrite the target's.

``check_kv_cache_group`` runs when vLLM makes a KV-cache group's metadata builder, after the model (and so every
layer's impl) is built and before any request: the first and the last case fail there, not on the first request.
"""

from __future__ import annotations

from dcp_plugin.layout import TokenLayout, check_same_position


def is_draft(vllm_config) -> bool:
    """Whether the model being built is ``speculative_config``'s draft model (vLLM builds it under a config whose
    ``model_config`` is the speculative config's ``draft_model_config``)."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec_config, "draft_model_config", None)
    return draft is not None and vllm_config.model_config is draft


def draft_note(vllm_config) -> str:
    """A sentence to append to a refusal when the layer belongs to a draft model, else ``""``."""
    if not is_draft(vllm_config):
        return ""
    return (" (this layer is speculative_config's draft model: vLLM shards its KV cache over the target's "
            "decode_context_parallel_size without checking the draft's heads; use a draft whose KV heads fit that "
            "DCP size, or decode_context_parallel_size=1)")


# Why a KV-cache group and its layer disagree, and what to do: the hint of every such refusal (builder and impl).
KV_SHARDING_HINT = (
    ": dcp-triton attends a KV cache only with the DCP group that shards it. vLLM builds a draft model at "
    "speculative_config's own decode_context_parallel_size (1) and may still shard its cache over the target's (the "
    "V2 model runner does, for method='draft_model'): serve it with decode_context_parallel_size=1, or with a runner "
    "that builds the draft at the target's DCP size (VLLM_USE_V2_MODEL_RUNNER=0)"
)


def check_kv_cache_group(tokens: TokenLayout, layer_names, vllm_config) -> None:
    """Refuse a KV-cache group whose DCP sharding differs from the DCP size its dcp-triton layers were built at.

    The layers are looked up in vLLM's ``static_forward_context`` (every attention layer of the worker, the draft's
    included); a name that is not there, or whose impl has no dcp-triton topology, is skipped.
    """
    compilation = getattr(vllm_config, "compilation_config", None)
    context = getattr(compilation, "static_forward_context", None) or {}
    for name in layer_names:
        layer = context.get(name)
        topology = getattr(getattr(layer, "impl", None), "topology", None)
        if topology is None:
            continue
        check_same_position(topology.heads, tokens, hint=f" (KV-cache group of layer {name}){KV_SHARDING_HINT}")
        target = getattr(layer, "kv_sharing_target_layer_name", None)
        if target is not None:  # set after the impl was built, so support.check_layer never saw it
            raise ValueError(
                f"layer {name}: kv_sharing_target_layer_name={target!r} (a draft reading the target's KV cache, as "
                "vLLM's Gemma 4 and Step 3.5 MTP proposers set up after building the model): dcp-triton writes each "
                "layer's K/V in forward and would overwrite the target's cache with the draft's; supported: drafts "
                "with their own KV cache (speculative_config method 'ngram', 'draft_model', 'eagle', 'eagle3')"
            )
