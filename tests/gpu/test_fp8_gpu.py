"""An fp8 KV cache on the GPU: the Triton write stores exactly the reference's bytes (quantize, clamp), and paged
attention over an fp8 cache (bf16/fp16 queries, automatic and forced splits, NaN in the rows past each context)
equals float64 attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.prefix_attention import prefix_attention
from dcp_plugin.kernels.write_kv_cache import write_kv_cache
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches, nan_past_context, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = (0.037, 0.011)  # not powers of two: the write's division rounds


def _scales():
    return tuple(torch.tensor([s], dtype=torch.float32, device="cuda") for s in SCALES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", list(FP8))
def test_the_triton_write_stores_the_reference_bytes(fp8, dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    cache_dtype = FP8[fp8]
    k, v = (torch.randn(300, 8, 128, device="cuda", generator=gen).to(dtype) * 4 for _ in range(2))
    k[7, 1, 5], v[9, 0, 0] = 1e4, -1e4  # past the range at these scales: clamped to the format's max
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:300]
    slots[::5] = -1  # another rank's tokens
    k_scale, v_scale = _scales()
    got = [torch.zeros(64, 16, 8, 256, dtype=cache_dtype, device="cuda") for _ in range(2)]
    want = [torch.zeros_like(g) for g in got]
    write_kv_cache(k, v, got[0][..., :128], got[0][..., 128:], slots, k_scale=k_scale, v_scale=v_scale)
    reference.write_kv_cache(k, v, want[0][..., :128], want[0][..., 128:], slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.isfinite(got[0].float()).all()


@pytest.mark.parametrize("mode", ["decode", "mixed"])
@pytest.mark.parametrize("block_size", [16, 64])  # 64: tiles through tensor descriptors (sm_90+)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8", list(FP8))
def test_prefix_attention_over_an_fp8_cache(fp8, dtype, head_dim, num_splits, block_size, mode):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q_lens, ctx = [1, 1, 1 if mode == "decode" else 9, 1, 1], [4097, 0, 300, 1, 2000]
    pages = [-(-c // block_size) for c in ctx]
    k_scale, v_scale = _scales()
    q = torch.randn(sum(q_lens), 16, head_dim, device="cuda", generator=gen).to(dtype)
    raw = torch.randn(sum(pages) + 3, block_size, 2, 2 * head_dim, device="cuda", generator=gen)
    scale_row = torch.cat([k_scale.expand(head_dim), v_scale.expand(head_dim)])
    buf = (raw * 0.1 / scale_row).to(FP8[fp8])
    kc, vc = buf[..., :head_dim], buf[..., head_dim:]
    table = shuffled_block_table(pages, generator=gen, first_page=3, fill=0)
    nan_past_context((kc, vc), table, ctx, block_size)  # a last page's rows past the context: they must add exactly nothing
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    heads = dict(scale=head_dim**-0.5, q_head_start=0, q_per_kv=8, kv_head_start=0, max_kv_len=max(ctx))
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    prefix_attention(q, kc, vc, table, lens, qsl, **heads, num_splits=num_splits, out=out, lse=lse, k_scale=k_scale,
                     v_scale=v_scale, max_query_len=1 if mode == "decode" else None)
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table, lens, qsl, **heads)
    assert_matches(out, want_out, dtype, f"fp8 {fp8} paged out")
    assert_matches(lse, want_lse, dtype, f"fp8 {fp8} paged lse")


@pytest.mark.parametrize("fp8", list(FP8))
def test_bf16_queries_past_fp16_range_over_an_fp8_cache(fp8):
    """bf16 q over an fp8 cache computes in fp16 after scaling q by a power of two into range: a request whose q
    passes fp16's 65504 equals float64 attention, and a NaN in q reaches its head's output, not another group's."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ctx = [300, 777, 1, 64]
    pages = [-(-c // 16) for c in ctx]
    k_scale, v_scale = _scales()
    q = torch.randn(len(ctx), 16, 128, device="cuda", generator=gen)
    q[1] *= 3e5
    q[3, 9, 17] = float("nan")  # KV group 1 (q_per_kv 8)
    q = q.to(torch.bfloat16)
    raw = torch.randn(sum(pages) + 3, 16, 2, 256, device="cuda", generator=gen)
    buf = (raw * 0.1 / torch.cat([k_scale.expand(128), v_scale.expand(128)])).to(FP8[fp8])
    kc, vc = buf[..., :128], buf[..., 128:]
    table = shuffled_block_table(pages, generator=gen, first_page=3, fill=0)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32, device="cuda")
    heads = dict(scale=128**-0.5, q_head_start=0, q_per_kv=8, kv_head_start=0, max_kv_len=max(ctx), max_query_len=1)
    out, lse = poisoned(q.shape, torch.bfloat16, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    prefix_attention(q, kc, vc, table, lens, qsl, **heads, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    want_out, want_lse = reference.prefix_attention(q[:3].double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table[:3], lens[:3], qsl[:4],
                                                    **heads)
    assert_matches(out[:3], want_out, torch.bfloat16, f"fp8 {fp8} out, q past fp16's range")
    assert_matches(lse[:3], want_lse, torch.bfloat16, f"fp8 {fp8} lse, q past fp16's range")
    assert out[3, 9].isnan().all(), "a NaN in q must reach its head's output"
    assert torch.isfinite(out[3, :8]).all(), "the other KV group's heads must not see it"


@pytest.mark.parametrize("mode", ["decode", "mixed", "prefill"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dot", [1, 2])
def test_fp8_products_over_an_e4m3_cache(dot, dtype, block_size, mode, monkeypatch):
    """``DCP_TRITON_FP8_DOT``: the prefix pass's Q x K in fp8, with q's values normal e4m3 values (which the kernel's
    power-of-two scaling and rounding to e4m3 keep exactly), equals float64 attention to the model dtype's bounds,
    P x V in 16 bits (``dot`` 1); with P in e4m3 too (``dot`` 2) the output's RMS error stays within 3% of its RMS
    (FA3's fp8 products are of that order), the LSE (from unrounded P) within the dtype's bounds, and nothing is NaN.
    Decode keeps its 16-bit products."""
    monkeypatch.setenv("DCP_TRITON_FP8_DOT", str(dot))
    gen = torch.Generator(device="cuda").manual_seed(5)
    q_lens = {"decode": [1, 1, 1, 1], "mixed": [1, 9, 1, 3], "prefill": [300, 64, 1, 129]}[mode]
    ctx = [4097, 300, 0, 2000]
    pages = [max(1, -(-c // block_size)) for c in ctx]
    k_scale, v_scale = _scales()
    q = torch.randn(sum(q_lens), 16, 128, device="cuda", generator=gen)
    q = torch.where(q.abs() < 2**-6, 0.0, q).to(torch.float8_e4m3fn).to(dtype)  # normal e4m3 values (or zero)
    raw = torch.randn(sum(pages) + 3, block_size, 2, 256, device="cuda", generator=gen)
    buf = (raw * 0.1 / torch.cat([k_scale.expand(128), v_scale.expand(128)])).to(torch.float8_e4m3fn)
    kc, vc = buf[..., :128], buf[..., 128:]
    table = shuffled_block_table(pages, generator=gen, first_page=3, fill=0)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    heads = dict(scale=128**-0.5, q_head_start=0, q_per_kv=8, kv_head_start=0, max_kv_len=max(ctx))
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    prefix_attention(q, kc, vc, table, lens, qsl, **heads, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale,
                     max_query_len=max(q_lens))
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table, lens, qsl, **heads)
    assert_matches(lse, want_lse, dtype, f"fp8 products {dot} lse")
    if dot == 1 or mode == "decode":
        assert_matches(out, want_out, dtype, "fp8 Q x K out")
        return
    assert not out.isnan().any()
    err = (out.double() - want_out).pow(2).mean().sqrt()
    assert err <= 0.03 * want_out.pow(2).mean().sqrt(), (float(err), float(want_out.pow(2).mean().sqrt()))
