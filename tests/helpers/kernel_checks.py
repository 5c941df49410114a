"""What every kernel test shares: NaN-poisoned outputs, comparison with float64 references (by ``dcp_plugin.testing``'s
tolerances), the kernel switches a GPU test runs under."""

from __future__ import annotations

import torch

from dcp_plugin.testing import TOLERANCES


def poisoned(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def nan_past_context(caches, block_table: torch.Tensor, lens, page: int) -> None:
    """Fill the rows of each request's last page past its ``lens[b]`` cached tokens with NaN in every cache of
    ``caches`` (``[blocks, page, ...]``): rows a kernel must never let reach an output."""
    for b, n in enumerate(lens):
        if n % page:
            for cache in caches:
                cache[block_table[b, n // page], n % page:] = float("nan")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """Compare a kernel output with a float64 reference: NaN never passes, infinities must match exactly."""
    atol, rtol = TOLERANCES[dtype]
    got = actual.detach().to("cpu", torch.float64)
    want = expected.detach().to("cpu", torch.float64)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    assert not torch.isnan(want).any(), f"{name}: the reference itself holds NaN"
    nan = torch.isnan(got)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN (unwritten or computed), first at {nan.nonzero()[0].tolist()}"
    inf_mismatch = (torch.isinf(got) != torch.isinf(want)) | (torch.isinf(want) & (got != want))
    assert not inf_mismatch.any(), f"{name}: infinities differ at {inf_mismatch.nonzero()[:4].tolist()}"
    finite = torch.isfinite(want)
    err = (got - want).abs().where(finite, 0.0)
    bad = err > atol + rtol * want.abs().where(finite, 0.0)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{bad.numel()} elements off by up to {err.max().item():.3g} "
        f"(atol {atol}, rtol {rtol}); first at {bad.nonzero()[0].tolist()}"
    )


def kernel_switches(head_dim: int, dtype: torch.dtype) -> tuple:
    """The ``DCP_TRITON_GLUON`` values a kernel test checks under: "0" and "1" where the Gluon kernels serve this head
    size and dtype on this GPU (so the ``tl`` kernels they replace there keep their checks), else None (the
    environment's own)."""
    from dcp_plugin.kernels._gluon import GLUON_HEAD_DIMS, gluon_supported

    if (head_dim in GLUON_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16) and torch.cuda.is_available()
            and gluon_supported(torch.device("cuda"))):
        return ("0", "1")
    return (None,)


def gluon_kernels() -> tuple:
    """The Gluon kernels that serve on this GPU with this environment (by default on sm_90 with Triton
    3.6), for tests that count compiled variants: empty elsewhere."""
    from dcp_plugin.kernels._gluon import gluon_enabled

    if not torch.cuda.is_available() or not gluon_enabled(torch.device("cuda")):
        return ()
    from dcp_plugin.kernels.gluon_chunk import gluon_chunk_kernel
    from dcp_plugin.kernels.gluon_decode import gluon_decode_kernel
    from dcp_plugin.kernels.gluon_prefix import gluon_prefix_kernel

    return gluon_chunk_kernel, gluon_prefix_kernel, gluon_decode_kernel
