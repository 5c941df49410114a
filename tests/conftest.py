# Import the kernels package before any test module imports triton: it sets TRITON_INTERPRET=1 when no GPU is
# present, and triton's own jit helpers (tl.zeros, tl.cdiv...) only run under the interpreter when that variable is
# set before triton is first imported.
import dcp_plugin.kernels  # noqa: F401
