"""What every kernel test shares: one tolerance table, NaN-poisoned outputs, comparison with float64 references."""

from __future__ import annotations

import torch

# |actual - expected| <= atol + rtol * |expected|, by the lowest-precision dtype a kernel reads or writes.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),  # fp16 rounding of P before P @ V and of the stored output
    torch.bfloat16: (1.6e-2, 1.6e-2),  # same, with bf16's 8-bit mantissa
}


def poisoned(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


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
