"""dcp-triton: decode-context-parallel attention with Triton kernels.

Data path: host adapter (``dcp_plugin.adapters.vllm``) -> core (this package) -> kernels (``dcp_plugin.kernels``).
Importing this package never imports vLLM and never initialises CUDA; the public names below are imported on
first use, so ``import dcp_plugin`` (and the ``dcp-triton`` command's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# A source checkout keeps the kernels and the adapters beside this folder (``kernels/``, ``adapters/``), and the
# install maps them into it (``dcp_plugin.kernels``, ``dcp_plugin.adapters``). A process started in the checkout's
# root (``python -m vllm...``, ``python -m sglang...``) imports this folder ahead of any install: its subpackages are
# then found beside it, the checkout's code throughout, instead of none.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "kernels")) and all(
        os.path.isfile(os.path.join(_ROOT, name, "__init__.py")) for name in ("kernels", "adapters")):
    __path__.append(_ROOT)  # noqa: F821 - the package's own search path

# Public name -> the module that defines it.
_EXPORTS = {
    "DcpAttention": "dcp_plugin.attention",
    "DcpBatch": "dcp_plugin.batch",
    "DcpBatchBuffers": "dcp_plugin.batch",
    "DcpGroup": "dcp_plugin.group",
    "TorchDcpGroup": "dcp_plugin.group",
    "HeadLayout": "dcp_plugin.layout",
    "TokenLayout": "dcp_plugin.layout",
    "ParallelState": "dcp_plugin.parallel_state",
    "DcpWorkspace": "dcp_plugin.workspace",
}
__all__ = sorted([*_EXPORTS, "kernel_mode"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dcp_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def kernel_mode() -> str:
    """``"gpu"`` when Triton compiles for a GPU, ``"interpreter"`` when kernels run on CPU tensors."""
    from dcp_plugin import kernels

    return "interpreter" if kernels.INTERPRET else "gpu"
