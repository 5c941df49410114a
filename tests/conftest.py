# Import the kernels package before any test module imports triton: it sets TRITON_INTERPRET=1 when no GPU is
# present, and triton's own jit helpers (tl.zeros, tl.cdiv...) only run under the interpreter when that variable is
# set before triton is first imported.
import dcp_plugin.kernels  # noqa: F401

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2 checkpoint, converted once (~40 s) into the shared cache ($DCP_TRITON_CACHE, else
    ~/.cache/dcp-triton) and reused by every later session."""
    from dcp_plugin.models.embedded import smollm2_checkpoint

    return smollm2_checkpoint(progress=False)
