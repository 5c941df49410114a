"""chunk_attention and the merge kernels compiled for the GPU, at real sizes and in bf16, vs float64 references."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.merge import merge_partials, merge_states, rescale_partial
from dcp_plugin.kernels.chunk_attention import chunk_attention
from dcp_plugin.kernels._gluon import GLUON_ENV
from tests.helpers.kernel_checks import assert_matches, kernel_switches, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_chunk_attention(head_dim, dtype, monkeypatch):
    for gluon in kernel_switches(head_dim, dtype):  # the tl and the Gluon current chunk where both serve
        if gluon is not None:
            monkeypatch.setenv(GLUON_ENV, gluon)
        _check_chunk(head_dim, dtype)


def _check_chunk(head_dim, dtype, lengths=(1, 700, 0, 333, 1500), chunk_mask=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, longest = sum(lengths), max(lengths)
    # Local Q heads 8..15 of a 32 Q / 2 KV model; k holds both KV heads.
    q = torch.randn(t, 8, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(t, 2, head_dim, device="cuda").to(dtype) for _ in range(2))
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    heads = dict(q_head_start=8, q_per_kv=16, kv_head_start=0)
    chunk_attention(q, k, v, cu, longest, scale=head_dim**-0.5, out=out, lse=lse, chunk_mask=chunk_mask, **heads)
    want_out, want_lse = reference.chunk_attention(q.double(), k.double(), v.double(), cu, longest,
                                                   scale=head_dim**-0.5, chunk_mask=chunk_mask, **heads)
    assert_matches(out, want_out, dtype, "out")
    assert_matches(lse, want_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_chunk_attention_under_draft_trees(head_dim, dtype):
    """Verify steps whose drafts form trees (the chunk's mask): 64 requests of up to 16 drafts, and one 300-row
    request whose mask spans several key blocks (a row seeing keys of a later block only), vs float64."""
    from tests.unit.test_kernel_chunk_attention import tree_masks

    lengths = [16] * 40 + [5, 11, 1] * 8 + [300]
    size = max(lengths)
    gen = torch.Generator().manual_seed(head_dim)
    mask = tree_masks(len(lengths) - 1, 16, generator=gen)
    mask = torch.cat([torch.nn.functional.pad(mask, (0, size - 16, 0, size - 16)),
                      torch.rand(1, size, size, generator=gen) < 0.05]).cuda()
    mask[-1].fill_diagonal_(True)
    mask[-1, 299, :250] = False
    _check_chunk(head_dim, dtype, lengths, chunk_mask=mask)


@pytest.mark.parametrize("num_parts", [2, 3, 8])
def test_merge_partials_bf16_packed_with_extra(num_parts):
    t, h, d = 3000, 5, 128
    parts = torch.randn(num_parts, t, h, d + 1, device="cuda")
    parts[..., d] *= 4
    parts[0, ::7, :, d] = float("-inf")
    parts[0, ::7, :, :d] = float("nan")
    extra_out, extra_lse = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16), torch.randn(t, h, device="cuda")
    out, lse = poisoned((t, h, d), torch.bfloat16, "cuda"), poisoned((t, h), torch.float32, "cuda")
    merge_partials(parts[..., :d], parts[..., d], out=out, lse=lse, extra_out=extra_out, extra_lse=extra_lse)
    want_out, want_lse = reference.merge_partials(parts[..., :d].double(), parts[..., d].double(),
                                                  extra_out=extra_out.double(), extra_lse=extra_lse.double())
    assert_matches(out, want_out, torch.bfloat16, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")


def test_merge_states_and_rescale_bf16():
    t, h, d = 4096, 32, 128
    out_a, out_b = torch.randn(t, h, d, device="cuda"), torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    lse_a, lse_b = torch.randn(t, h, device="cuda") * 4, torch.randn(t, h, device="cuda") * 4
    lse_a[::5] = float("-inf")
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.merge_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    assert_matches(out, want_out, torch.bfloat16, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")
    lse_all = torch.stack([lse_a, lse_b])
    scaled, lse = rescale_partial(out_b, lse_all, 1)
    want_scaled, want_lse = reference.rescale_partial(out_b.double(), lse_all.double(), 1)
    assert_matches(scaled, want_scaled, torch.bfloat16, "scaled")
    assert_matches(lse, want_lse, torch.float32, "lse")
