"""Triton kernels of DCP attention; ``dcp_plugin.kernels.reference`` holds torch versions with the same signatures.

With no CUDA GPU present, ``TRITON_INTERPRET=1`` is set here (before any kernel is defined) so the kernels run on
CPU tensors through the Triton interpreter. Set ``TRITON_INTERPRET`` yourself to override that choice.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The launchers, imported only now: the interpreter decision above must precede every @triton.jit definition.
from dcp_plugin.kernels.combine import combine_partials, merge_states, rescale_partial  # noqa: E402
from dcp_plugin.kernels.extend_attention import SUPPORTED_HEAD_DIMS, extend_attention  # noqa: E402
from dcp_plugin.kernels.paged_attention import paged_attention  # noqa: E402
from dcp_plugin.kernels.write_kv_cache import write_kv_cache  # noqa: E402

__all__ = [
    "INTERPRET",
    "SUPPORTED_HEAD_DIMS",
    "combine_partials",
    "extend_attention",
    "merge_states",
    "paged_attention",
    "rescale_partial",
    "write_kv_cache",
]
