"""merge_states, merge_partials, rescale_partial under the Triton interpreter vs the float64 torch reference."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import kernels as triton_kernels
from dcp_plugin.kernels import reference
from dcp_plugin.kernels.merge import merge_partials, merge_states, rescale_partial
from tests.helpers.kernel_checks import assert_matches, poisoned

T, H, D = 6, 3, 80  # H and D not powers of two: the kernel masks both


def _partials(num_parts: int, dtype: torch.dtype, *, seed: int = 0):
    """Random partials with the edges planted: empty partials (-inf) whose O is NaN, a +inf LSE (also empty, FA2's
    convention), and an all-empty row (token 0). NaN LSEs are not empty: ``test_a_nan_lse_makes_its_row_nan``.
    LSEs sit near +-100 as a real model's do (long contexts, large logits), mixed per row and head: exp of them
    overflows or flushes to zero in float32 unless the merge subtracts the row's maximum first."""
    gen = torch.Generator().manual_seed(seed)
    parts_out = torch.randn(num_parts, T, H, D, generator=gen).to(dtype)
    offsets = torch.tensor([100.0, -100.0, 60.0, -80.0, 0.0, 95.0])[torch.arange(T * H) % 6].view(T, H)
    parts_lse = torch.randn(num_parts, T, H, generator=gen) * 4 + offsets
    parts_lse[:, 0] = float("-inf")
    parts_out[:, 0] = float("nan")
    parts_lse[0, 1, 0], parts_out[0, 1, 0] = float("-inf"), float("nan")
    parts_lse[-1, 2, 1], parts_out[-1, 2, 1] = float("inf"), float("nan")
    return parts_out, parts_lse


def _ref64(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 5])
def test_merge_partials(num_parts, dtype):
    parts_out, parts_lse = _partials(num_parts, dtype)
    out, lse = poisoned((T, H, D), dtype), poisoned((T, H), torch.float32)
    assert merge_partials(parts_out, parts_lse, out=out, lse=lse) == (out, lse)
    want_out, want_lse = reference.merge_partials(parts_out.double(), parts_lse.double())
    assert_matches(out, want_out, dtype, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all(), "all-empty row must be (0, -inf)"


@pytest.mark.parametrize("with_extra", [False, True], ids=["packed", "packed+extra"])
def test_merge_packed_all_to_all_buffer(with_extra):
    parts_out, parts_lse = _partials(3, torch.float32, seed=1)
    buf = torch.cat([parts_out, parts_lse.unsqueeze(-1)], dim=-1)  # [N, T, H, D + 1], as received
    extra_out, extra_lse = (None, None)
    if with_extra:
        extra_out = torch.randn(T, H, D, dtype=torch.float16)
        extra_lse = torch.randn(T, H) * 4
        extra_lse[4, 0], extra_out[4, 0] = float("-inf"), float("nan")
    out = poisoned((T, H, D), torch.float16)
    _, lse = merge_partials(buf[..., :D], buf[..., D], out=out, extra_out=extra_out, extra_lse=extra_lse)
    want_out, want_lse = reference.merge_partials(parts_out.double(), parts_lse.double(),
                                                  extra_out=_ref64(extra_out), extra_lse=_ref64(extra_lse))
    assert_matches(out, want_out, torch.float16, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")


def test_merge_default_outputs_and_extra_only_nonempty():
    parts_out, parts_lse = _partials(2, torch.float16, seed=2)
    parts_lse[:] = float("-inf")  # every rank's prefix empty: the result is the extra partial alone
    extra_out, extra_lse = torch.randn(T, H, D, dtype=torch.float32), torch.randn(T, H)
    out, lse = merge_partials(parts_out, parts_lse, extra_out=extra_out, extra_lse=extra_lse)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert_matches(out, extra_out.double(), torch.float16, "out")
    assert_matches(lse, extra_lse.double(), torch.float32, "lse")


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float16), (torch.float16, torch.float16),
                                    (torch.float32, torch.float32)], ids=["fp32+fp16", "fp16+fp16", "fp32+fp32"])
def test_merge_states(dtypes):
    parts_out, (lse_a, lse_b) = _partials(2, torch.float32, seed=3)
    out_a = parts_out[0].to(dtypes[0]).transpose(0, 1).contiguous().transpose(0, 1)  # head-major strides
    out_b = parts_out[1].to(dtypes[1])
    lse_b = lse_b.t().contiguous().t()
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtypes[1]
    want_out, want_lse = reference.merge_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    assert_matches(out, want_out, dtypes[1], "out")
    assert_matches(lse, want_lse, torch.float32, "lse")


def test_merge_states_into_strided_outputs():
    (out_a, lse_a), (out_b, lse_b) = _partials(1, torch.float16, seed=6), _partials(1, torch.float16, seed=7)
    out_buf, lse_buf = poisoned((T, H, D + 8), torch.float32), poisoned((H, T), torch.float32)
    merge_states(out_a[0], lse_a[0], out_b[0], lse_b[0], out=out_buf[..., 8:], lse=lse_buf.t())
    want_out, want_lse = reference.merge_states(out_a[0].double(), lse_a[0].double(), out_b[0].double(),
                                                lse_b[0].double())
    assert_matches(out_buf[..., 8:], want_out, torch.float16, "out")
    assert_matches(lse_buf.t(), want_lse, torch.float32, "lse")
    assert torch.isnan(out_buf[..., :8]).all(), "wrote outside the out view"


@pytest.mark.parametrize("num_ranks", [1, 3, 5])
def test_rescale_partial_sums_to_the_merge(num_ranks):
    parts_out, parts_lse = _partials(num_ranks, torch.float16, seed=8)
    total = torch.zeros(T, H, D, dtype=torch.float64)
    for rank in range(num_ranks):
        scaled, lse = poisoned((T, H, D), torch.float32), poisoned((T, H), torch.float32)
        rescale_partial(parts_out[rank], parts_lse, rank, out=scaled, lse=lse)
        want_scaled, want_lse = reference.rescale_partial(parts_out[rank].double(), parts_lse.double(), rank)
        assert_matches(scaled, want_scaled, torch.float16, f"scaled[{rank}]")
        assert_matches(lse, want_lse, torch.float32, f"lse[{rank}]")
        total += scaled.double()
    assert_matches(total, reference.merge_partials(parts_out.double(), parts_lse.double())[0], torch.float16, "sum")


def test_rescale_partial_default_output_is_float32():
    parts_out, parts_lse = _partials(2, torch.float16, seed=9)
    scaled, lse = rescale_partial(parts_out[1], parts_lse, 1)
    assert scaled.dtype == torch.float32 and lse.dtype == torch.float32
    assert_matches(scaled, reference.rescale_partial(parts_out[1].double(), parts_lse.double(), 1)[0],
                   torch.float16, "scaled")


@pytest.mark.parametrize("op", ["partials", "partials+extra", "states", "rescale"])
@pytest.mark.parametrize("ops", ["triton", "reference"])
def test_a_nan_lse_makes_its_row_nan(op, ops):
    """A NaN LSE comes from a NaN input: its (token, head) turns NaN in out and lse, as unsharded attention would,
    instead of being dropped as empty (a finite wrong answer); every other row is still exact."""
    parts_out, parts_lse = _partials(3, torch.float32, seed=10)
    want_out, want_lse = reference.merge_partials(parts_out.double(), parts_lse.double())
    parts_lse[1, 3, 2] = float("nan")
    kernels = reference if ops == "reference" else triton_kernels
    out, lse = poisoned((T, H, D), torch.float32), poisoned((T, H), torch.float32)
    if op == "partials":
        kernels.merge_partials(parts_out, parts_lse, out=out, lse=lse)
    elif op == "partials+extra":  # the NaN in the extra partial (the current chunk) instead
        extra_out, extra_lse = parts_out[1].clone(), parts_lse[1].clone()
        kernels.merge_partials(parts_out[[0, 2]], parts_lse[[0, 2]], extra_out=extra_out, extra_lse=extra_lse,
                               out=out, lse=lse)
    elif op == "states":
        extra_out, extra_lse = reference.merge_partials(parts_out[[0, 2]], parts_lse[[0, 2]])
        kernels.merge_states(extra_out, extra_lse, parts_out[1], parts_lse[1], out=out, lse=lse)
    else:  # ag_rs: each rank's scaled share, summed as the reduce-scatter would
        total = torch.zeros(T, H, D)
        for rank in range(3):
            scaled, lse = poisoned((T, H, D), torch.float32), poisoned((T, H), torch.float32)
            kernels.rescale_partial(parts_out[rank], parts_lse, rank, out=scaled, lse=lse)
            total += scaled
        out = total
    nan = torch.zeros(T, H, dtype=torch.bool)
    nan[3, 2] = True
    assert torch.isnan(out[3, 2]).all() and torch.isnan(lse[3, 2]), (out[3, 2, :4], lse[3, 2])
    assert_matches(out[~nan], want_out[~nan], torch.float32, "the other rows' out")
    assert_matches(lse[~nan], want_lse[~nan], torch.float32, "the other rows' lse")


O3, L2 = torch.randn(T, H, D), torch.randn(T, H)


@pytest.mark.parametrize("call, match", [
    (lambda: merge_states(O3, L2, O3[:, :2], L2), "out_b must have shape"),
    (lambda: merge_states(O3, L2.half(), O3, L2), "lse_a has dtype"),
    (lambda: merge_states(O3, L2[:4], O3, L2), "lse_a must have shape"),
    (lambda: merge_states(O3, L2, O3, L2, out=torch.empty(T, H, D + 1)), "out must have shape"),
    (lambda: merge_states(O3, L2, O3, L2, lse=torch.empty(T, H, dtype=torch.float64)), "lse has dtype"),
    (lambda: merge_partials(O3[None], L2[None].double()), "parts_lse has dtype"),
    (lambda: merge_partials(O3[None], L2[None, :, :2]), "parts_lse must have shape"),
    (lambda: merge_partials(O3[None], L2[None], extra_out=O3), "extra_out and extra_lse"),
    (lambda: merge_partials(O3[None], L2[None], extra_out=O3[:, :, :4], extra_lse=L2), "extra_out must have"),
    (lambda: merge_partials(O3[None][:0], L2[None][:0]), "at least one partial"),
    (lambda: rescale_partial(O3, L2[None], 1), "rank must be an int in \\[0, 1\\)"),
    (lambda: rescale_partial(O3, L2[None], -1), "rank must be"),
    (lambda: rescale_partial(O3, L2[None, :5], 0), "lse_all must have shape"),
    (lambda: rescale_partial(O3.long(), L2[None], 0), "part_out has dtype"),
], ids=["merge_shape", "merge_lse_dtype", "merge_lse_shape", "merge_out_shape", "merge_out_lse_dtype",
        "partials_lse_dtype", "partials_lse_shape", "partials_extra_pair", "partials_extra_shape", "partials_empty_n",
        "rescale_rank_high", "rescale_rank_negative", "rescale_lse_shape", "rescale_dtype"])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
