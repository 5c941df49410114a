"""dcp-triton: decode-context-parallel attention with Triton kernels.

Data path: host adapter (``dcp_plugin.adapters.vllm``) -> core (this package) -> kernels (``dcp_plugin.kernels``).
Importing this package never imports vLLM and never initialises CUDA.
"""

from dcp_plugin.attention import DcpAttention
from dcp_plugin.batch import DcpBatch, DcpBatchWorkspace
from dcp_plugin.group import DcpGroup, TorchDcpGroup
from dcp_plugin.layout import HeadLayout, TokenLayout
from dcp_plugin.parallel_state import ParallelState
from dcp_plugin.workspace import DcpWorkspace

__all__ = [
    "DcpAttention",
    "DcpBatch",
    "DcpBatchWorkspace",
    "DcpGroup",
    "DcpWorkspace",
    "HeadLayout",
    "ParallelState",
    "TokenLayout",
    "TorchDcpGroup",
    "kernel_mode",
]
__version__ = "0.1.0"


def kernel_mode() -> str:
    """``"gpu"`` when Triton compiles for a GPU, ``"interpreter"`` when kernels run on CPU tensors."""
    from dcp_plugin import kernels

    return "interpreter" if kernels.INTERPRET else "gpu"
