"""SGLang adapter: ``--attention-backend dcp-triton`` (registration, attention backend, per-step metadata).

SGLang loads the entry point ``[project.entry-points."sglang.srt.plugins"] dcp_triton`` (this package's
``register``) in every process it starts, the scheduler and its TP workers included, before it parses arguments
or builds a model runner. ``register`` adds ``dcp-triton`` (and ``dcp_triton``, ``DCP_TRITON``) to SGLang's
attention-backend choices and registers the backend's factory. On an SGLang outside the supported versions
(``compat``) it logs one warning and registers nothing; a registration that fails on a supported one logs one
error naming the SGLang version (SGLang itself would only log a plugin's traceback and go on).

Importing this package does not import SGLang; ``register`` does, lazily.
"""

import logging

# Under SGLang's logger, so its handlers and level apply.
logger = logging.getLogger("sglang.dcp_triton")


def register() -> None:
    """Register the ``dcp-triton`` attention backend with SGLang. Safe to call any number of times, in any process;
    never raises (SGLang would log the traceback and start without the backend)."""
    from dcp_plugin.adapters.sglang import compat

    reason = compat.unsupported_sglang_reason()
    if reason is not None:
        logger.warning("dcp-triton: %s; so the dcp-triton attention backend is not registered "
                       "(--attention-backend dcp-triton is unknown to this SGLang)", reason)
        return
    from dcp_plugin.adapters.sglang import registration

    try:
        registration.register()
    except Exception as err:  # noqa: BLE001 - said in one line; SGLang would bury it in a traceback
        logger.error("dcp-triton: registering the attention backend with sglang==%s failed (%s: %s), so "
                     "--attention-backend dcp-triton is unavailable; supported: %s", compat.installed_sglang(),
                     type(err).__name__, err, compat.supported_sglang_text())
