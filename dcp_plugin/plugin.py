"""vLLM general-plugin entry point (``vllm.general_plugins``: ``dcp_triton = dcp_plugin.plugin:register``)."""


def register() -> None:
    """Register the ``dcp-triton`` attention backend with vLLM. Safe to call any number of times, in any process.

    vLLM is imported here, lazily: importing ``dcp_plugin`` never imports it.
    """
    from dcp_plugin.adapters.vllm import registration

    registration.register()
