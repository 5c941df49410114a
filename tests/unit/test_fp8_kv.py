"""An fp8 KV cache (float8_e4m3fn / float8_e5m2 holding value / scale): the reference write quantizes and clamps as
torch does, the prefix pass equals float64 attention over the dequantized cache, and DCP over fp8 shards equals
attention over the same fp8 cache (both comm modes, N = 1, 2, 4), with the current chunk in the model dtype. The
Triton write kernel refuses fp8 under the interpreter, which rounds float32 to fp8 wrongly; the GPU tier compares
it bit for bit with the reference (tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcp_plugin import kernels
from dcp_plugin.kernels import reference
from dcp_plugin.kernels.prefix_attention import PrefixConfig
from dcp_plugin.testing import Case
from tests.helpers.fp8_checks import run_fp8_dcp
from tests.helpers.kernel_checks import assert_matches, poisoned

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = {torch.float8_e4m3fn: (0.02, 0.03), torch.float8_e5m2: (0.5, 0.25)}


def _scales(dtype):
    return tuple(torch.tensor([s], dtype=torch.float32) for s in SCALES[dtype])


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_the_reference_write_quantizes_like_torch_and_clamps(dtype):
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(6, 2, 64, generator=gen) * 3 for _ in range(2))
    k[0, 0, 0] = 1e6  # far past the format's range: clamped, never inf or NaN
    k_scale, v_scale = _scales(dtype)
    slots = torch.tensor([3, -1, 17, 0, 30, 5])
    kc, vc = (torch.zeros(4, 8, 2, 64, dtype=dtype) for _ in range(2))
    reference.write_kv_cache(k, v, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    limit = torch.finfo(dtype).max
    for cache, values, scale in ((kc, k, k_scale), (vc, v, v_scale)):
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want = (values[token] / scale).clamp(-limit, limit).to(dtype)
                assert torch.equal(cache[slot // 8, slot % 8].view(torch.uint8), want.view(torch.uint8))
    assert kc[0, 3, 0, 0].float() == limit and torch.isfinite(kc.float()).all()


def test_the_triton_write_refuses_fp8_under_the_interpreter():
    cache = torch.zeros(2, 8, 1, 64, dtype=FP8[0])
    with pytest.raises(ValueError, match="cannot be written by the Triton interpreter"):
        kernels.write_kv_cache(torch.randn(2, 1, 64), torch.randn(2, 1, 64), cache, cache, torch.tensor([0, 1]),
                               k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_an_fp8_cache_needs_its_scales_and_a_plain_cache_refuses_them():
    k = torch.randn(2, 1, 64)
    fp8, plain = torch.zeros(2, 8, 1, 64, dtype=FP8[0]), torch.zeros(2, 8, 1, 64)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_scale must be a one-element float32 tensor"):
        kernels.write_kv_cache(k, k, fp8, fp8, slots)
    with pytest.raises(ValueError, match="k_scale / v_scale are for an fp8 KV cache"):
        kernels.write_kv_cache(k, k, plain, plain, slots, k_scale=torch.ones(1), v_scale=torch.ones(1))


@pytest.mark.parametrize("tma", [False, True, "rows_ahead"], ids=["pointers", "descriptors", "descriptors-ahead"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_prefix_attention_reads_the_dequantized_cache(dtype, splits, tma):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 8, 64, generator=gen)
    k_scale, v_scale = _scales(dtype)
    cache = (torch.randn(12, 16, 2, 128, generator=gen) / torch.cat([k_scale.expand(64), v_scale.expand(64)])).to(dtype)
    kc, vc = cache[..., :64], cache[..., 64:]
    table = torch.randperm(12, generator=gen).to(torch.int32).view(3, 4)
    lens, qsl = torch.tensor([40, 0, 63], dtype=torch.int32), torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    out, lse = poisoned(q.shape, torch.float32), poisoned(q.shape[:2], torch.float32)
    heads = dict(scale=0.125, q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=63)
    config = PrefixConfig(block_n=16, block_m=32, num_warps=4, num_stages=1, tma=True,
                          rows_ahead=tma == "rows_ahead") if tma else None
    kernels.prefix_attention(q, kc, vc, table, lens, qsl, **heads, num_splits=splits, out=out, lse=lse,
                             k_scale=k_scale, v_scale=v_scale, config=config)
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table, lens, qsl, **heads)
    assert_matches(out, want_out, torch.float32, "fp8 paged out")
    assert_matches(lse, want_lse, torch.float32, "fp8 paged lse")


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_bf16_queries_over_an_fp8_cache_compute_in_fp16_without_overflow(dtype):
    """bf16 q over an fp8 cache runs the fp16 path: q is scaled by a power of two into fp16's range first, so a
    request whose q passes 65504 (fp16's largest value) still equals float64 attention; a NaN in q gives NaN out."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 8, 64, generator=gen)
    q[1] *= 2e5  # request 1: far past fp16's range
    q[3, 2, 5] = float("nan")  # request 3, KV group 0
    q = q.to(torch.bfloat16)
    k_scale, v_scale = _scales(dtype)
    cache = (torch.randn(12, 16, 2, 128, generator=gen) / torch.cat([k_scale.expand(64), v_scale.expand(64)])).to(dtype)
    kc, vc = cache[..., :64], cache[..., 64:]
    table = torch.randperm(12, generator=gen).to(torch.int32).view(4, 3)
    lens, qsl = torch.tensor([40, 47, 1, 30], dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    out, lse = poisoned(q.shape, torch.float32), poisoned(q.shape[:2], torch.float32)
    heads = dict(scale=0.125, q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=47, max_query_len=1)
    kernels.prefix_attention(q, kc, vc, table, lens, qsl, **heads, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    want_out, want_lse = reference.prefix_attention(q[:3].double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table[:3], lens[:3], qsl[:4],
                                                    **heads)
    assert_matches(out[:3], want_out, torch.bfloat16, "fp8 paged out, bf16 q")
    assert_matches(lse[:3], want_lse, torch.bfloat16, "fp8 paged lse, bf16 q")
    assert out[3].isnan().all(-1).tolist() == [h == 2 for h in range(8)], "the NaN must reach its head's row"


def _kernels(name: str):
    """The kernel namespace of a CPU run: the Triton kernels write fp8 only on a GPU, so the write is torch's."""
    if name == "reference":
        return reference
    return SimpleNamespace(**{n: getattr(kernels, n) for n in ("plan_chunk", "plan_prefix", "plan_merge",
                                                                "split_capacity")},
                           plan_write_kv=reference.plan_write_kv)


@pytest.mark.parametrize("name", ["reference", "triton"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_dcp_over_fp8_shards_equals_attention_over_the_fp8_cache(n, comm, name):
    dtype = FP8[0] if comm == "ag_rs" else FP8[1]
    requests = ((30, 1), (25, 1), (19, 4), (0, 6)) if name == "triton" else ((50, 1), (41, 1), (33, 7), (0, 9), (3, 2))
    case = Case(name="fp8", q_heads=8, kv_heads=2, requests=requests, comm=comm, head_dim=32, seed=21, kernel_impl=name,
                decode_steps=1)
    k_scale, v_scale = _scales(dtype)
    assert run_fp8_dcp(case, n, dtype, k_scale, v_scale, _kernels(name), label=f"fp8 {comm} {name}") == [2] * n
