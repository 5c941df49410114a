# Decide the kernels' mode before any test module imports triton: it sets TRITON_INTERPRET=1 when no GPU is present,
# and triton's own jit helpers (tl.zeros, tl.cdiv...) only run under the interpreter when that variable is set before
# triton is first imported. (Importing the package alone decides nothing: its names load on first use.)
from dcp_plugin.kernels import INTERPRET  # noqa: F401

import pytest

# `make test` hands whole modules to its workers in collection order. The sm_90 compile is one test of ~150 s (a
# quarter of the tier's work): collected first, it runs beside the other modules; collected where its name falls,
# it started halfway and one worker ran it alone at the end.
FIRST = ("tests/unit/test_kernels_compile_for_hopper.py",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2 checkpoint, converted once (~40 s) into the shared cache ($DCP_TRITON_CACHE, else
    ~/.cache/dcp-triton) and reused by every later session."""
    from dcp_plugin.models.embedded import smollm2_checkpoint

    return smollm2_checkpoint(progress=False)
