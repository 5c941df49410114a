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


def causal_attention_f64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, *,
                         scale: float, q_per_kv: int, q_head_start: int = 0) -> torch.Tensor:
    """The one float64 oracle of causal attention, from first principles.

    ``q``: ``[T, H, D]``, the queries at sequence ``positions`` ``[T]`` of global Q heads ``q_head_start ..
    q_head_start + H - 1``; ``keys``/``values``: ``[L, KV, D]``, the whole sequence (every KV head). Query ``t``
    sees keys ``0 .. positions[t]``; global Q head ``g`` reads KV head ``g // q_per_kv``. Returns ``[T, H, D]``.
    """
    last = int(positions.max()) + 1
    visible = torch.arange(last, device=q.device)[None, :] <= positions.to(q.device)[:, None]  # [T, L]
    return attention_f64(q, keys, values, visible, scale=scale, q_per_kv=q_per_kv, q_head_start=q_head_start)


def attention_f64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, *, scale: float,
                  q_per_kv: int, q_head_start: int = 0) -> torch.Tensor:
    """Float64 attention of queries ``q`` ``[T, H, D]`` to the keys ``visible`` ``[T, L]`` shows each of them, among
    the sequence's first ``L`` (``keys``/``values`` ``[>= L, KV, D]``); heads as in ``causal_attention_f64``."""
    last = visible.shape[1]
    kv = torch.arange(q_head_start, q_head_start + q.shape[1], device=q.device) // q_per_kv
    k, v = keys[:last][:, kv].double(), values[:last][:, kv].double()  # [L, H, D]
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    probs = torch.softmax(scores.masked_fill(~visible.to(q.device), float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)


def shuffled_block_table(pages: list[int], *, generator: torch.Generator, width: int | None = None,
                         first_page: int = 0, fill: int | None = None, device=None) -> torch.Tensor:
    """An int32 block table ``[len(pages), width]`` (default width ``max(pages) + 1``) in which request ``b`` owns
    ``pages[b]`` distinct pages of ``first_page .. first_page + sum(pages) - 1``, in a random order (so page order
    and table order never agree by accident). Unused entries hold ``fill`` (default: the page after all of them,
    a spare the caller allocates and never reads)."""
    total = sum(pages)
    order = torch.randperm(total, generator=generator, device=device or generator.device).to(torch.int32) + first_page
    fill = first_page + total if fill is None else fill
    table = torch.full((len(pages), width or max(pages, default=0) + 1), fill, dtype=torch.int32, device=order.device)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start:start + count]
        start += count
    return table


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
