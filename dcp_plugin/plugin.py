"""vLLM general-plugin entry point (``vllm.general_plugins``: ``dcp_triton = dcp_plugin.plugin:register``)."""

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
        registration.register()
    except Exception:
        logger.exception("dcp-triton: registering the attention backend failed, so it is not registered")
