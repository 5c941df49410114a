"""Make ``--attention-backend dcp-triton`` select the DCP-Triton backend in every SGLang process.

SGLang's ``--attention-backend`` (and ``--prefill-attention-backend`` / ``--decode-attention-backend``) take
``choices=`` from one list that plugins may extend (``add_attention_backend_choices``), and the model runner looks
the chosen name up in ``ATTENTION_BACKENDS`` (``register_attention_backend``). Argparse matches names exactly, so
each spelling is its own choice. A speculative run's draft backends come from SGLang's ``DraftBackendFactory``,
which ``draft.register_draft_backends`` teaches the names.
"""

from __future__ import annotations

BACKEND_NAME = "dcp-triton"
ALIASES = ("dcp_triton", "DCP_TRITON")
NAMES = (BACKEND_NAME, *ALIASES)


def register() -> None:
    """Add the names to SGLang's choices and register the factory under each (re-entrant). Imports SGLang."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from dcp_plugin.adapters.sglang.draft import register_draft_backends

    missing = [name for name in NAMES if name not in ATTENTION_BACKEND_CHOICES]
    if missing:
        add_attention_backend_choices(missing)
    for name in NAMES:
        if ATTENTION_BACKENDS.get(name) is not create_backend:
            register_attention_backend(name)(create_backend)
    register_draft_backends(NAMES)


def create_backend(model_runner):
    """The factory SGLang calls with a model runner (target or draft) when ``dcp-triton`` is selected."""
    from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

    return DcpTritonAttnBackend(model_runner)
