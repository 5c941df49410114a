"""Whether the kernels run compiled on a GPU or under the Triton interpreter on CPU tensors.

Decided once, when the first kernel module is imported and before any ``@triton.jit`` function is defined: every
module of ``dcp_plugin.kernels`` that imports triton imports this module first (the package's ``__init__`` imports
nothing until a name is asked for, so ``dcp_plugin.kernels.checks`` loads without triton). With no CUDA GPU present
``TRITON_INTERPRET=1`` is set, unless the variable is set already.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from triton import knobs  # noqa: E402 - only now: importing triton fixes whether its own helpers are interpreted

INTERPRET = bool(knobs.runtime.interpret)  # read as Triton reads it: 1, true, on, yes (any case)
