"""What each worker's attention layers run, asked by name over vLLM's ``collective_rpc``: a worker extension, so no
code travels pickled (vLLM sends a function only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

    llm = LLM(model=..., attention_backend="dcp-triton", worker_extension_cls=LAYER_REPORT)
    llm.collective_rpc("dcp_triton_layers")   # one dict per worker

Importing this module does not import vLLM.
"""

from __future__ import annotations

LAYER_REPORT = "dcp_plugin.adapters.vllm.report.LayerReport"


class LayerReport:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def dcp_triton_layers(self) -> dict:
        """This worker's rank and, per kind of attention layer its model runner built, ``[backend, impl class,
        kernel path, DCP size, layers]``."""
        counts: dict[tuple, int] = {}
        for layer in self.vllm_config.compilation_config.static_forward_context.values():
            backend, impl = getattr(layer, "attn_backend", None), getattr(layer, "impl", None)
            if backend is None or impl is None:
                continue
            key = (backend.get_name(), type(impl).__name__, str(getattr(impl, "kernel_path", "-")),
                   int(getattr(impl, "dcp_world_size", 1)))
            counts[key] = counts.get(key, 0) + 1
        return {"rank": int(self.rank), "layers": [[*key, n] for key, n in counts.items()]}
