"""vLLM adapter: ``--attention-backend dcp-triton`` (registration, backend, metadata builder, impl).

Importing this package does not import vLLM; its modules do (``registration.register()`` is the entry point's
target, through ``dcp_plugin.plugin.register``). Supported vLLM versions and every shim: ``compat``.
"""
