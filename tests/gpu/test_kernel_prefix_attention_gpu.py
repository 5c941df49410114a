"""prefix_attention and write_kv_cache compiled for the GPU: real sizes, bf16, automatic splits, int64 offsets, CUDA
graph capture; vs float64 references."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.prefix_attention import prefix_attention
from dcp_plugin.kernels.write_kv_cache import write_kv_cache
from dcp_plugin.kernels._gluon import GLUON_ENV
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches, kernel_switches, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _prefix_inputs(q_lens, ctx_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, extra_blocks=0, seed=0):
    """Random Q and K/V caches (vLLM-style views of one ``[..., 2 * D]`` buffer) with shuffled pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(pages) + extra_blocks
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device="cuda", generator=gen).to(dtype)
    buf = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, device="cuda", generator=gen).to(dtype)
    table = shuffled_block_table(pages, generator=gen, first_page=extra_blocks, fill=0)  # the highest pages
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return q, buf[..., :head_dim], buf[..., head_dim:], table, lens, qsl


def _check(q, kc, vc, table, lens, qsl, *, heads, max_query_len, num_splits=None, dtype):
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    max_ctx = int(lens.max())
    prefix_attention(q, kc, vc, table, lens, qsl, scale=q.shape[-1] ** -0.5, **heads, max_kv_len=max_ctx,
                     max_query_len=max_query_len, num_splits=num_splits, out=out, lse=lse)
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                    scale=q.shape[-1] ** -0.5, **heads, max_kv_len=max_ctx)
    assert_matches(out, want_out, dtype, "out")
    assert_matches(lse, want_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_prefix_attention(mode, head_dim, dtype):
    # Gathered Q heads 8..23 of a 32 Q / 2 KV model (16 per KV head), cache holding both KV heads.
    q_lens = [1] * 6 if mode == "decode" else [1, 37, 1, 200, 5, 1]
    ctx = [0, 1, 4097, 63, 1000, 2500]
    args = _prefix_inputs(q_lens, ctx, num_q_heads=16, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    heads = dict(q_head_start=8, q_per_kv=16, kv_head_start=0)
    _check(*args, heads=heads, max_query_len=1 if mode == "decode" else None, dtype=dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 64])
@pytest.mark.parametrize("block_size", [16, 32, 64, 1])
def test_big_groups_and_splits(block_size, num_splits):
    # 48 Q / 2 KV (group of 24: the tile-crossing case of vLLM/SGLang's grouped kernels), MQA-like decode batch.
    args = _prefix_inputs([1] * 5, [3000, 1, 0, 777, 64], num_q_heads=48, num_kv_heads=2, head_dim=128,
                          block_size=block_size, dtype=torch.bfloat16)
    _check(*args, heads=dict(q_head_start=0, q_per_kv=24, kv_head_start=0), max_query_len=1, num_splits=num_splits,
           dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_tiles_through_tensor_descriptors(mode, block_size, head_dim, dtype, monkeypatch):
    """Pages of 64 tokens or more: on sm_90+ the prefix rows, and decode rows of up to 16 Q heads per KV head, read
    whole tiles of one page through tensor descriptors (the prefix pass with the rows read ahead), with the `tl`
    kernels and, where they serve, the Gluon prefix pass. The rows of each last page past its context hold NaN: they
    must add nothing."""
    for gluon in kernel_switches(head_dim, dtype):
        if gluon is not None:
            monkeypatch.setenv(GLUON_ENV, gluon)
        _check_descriptor_tiles(mode, block_size, head_dim, dtype)


def _check_descriptor_tiles(mode, block_size, head_dim, dtype):
    from dcp_plugin.kernels.prefix_attention import DESCRIPTOR_DECODE_CONFIGS, GPU_CONFIGS, plan_prefix

    ctx = [0, 1, 4097, 63, 1000, 2500]
    q_lens = [1] * 6 if mode == "decode" else [1, 37, 1, 200, 5, 300]
    max_query_len = 1 if mode == "decode" else None
    q, kc, vc, table, lens, qsl = _prefix_inputs(q_lens, ctx, num_q_heads=16, num_kv_heads=2, head_dim=head_dim,
                                                 block_size=block_size, dtype=dtype)
    for b, c in enumerate(ctx):
        if c % block_size:
            kc[table[b, c // block_size], c % block_size:] = float("nan")
            vc[table[b, c // block_size], c % block_size:] = float("nan")
    heads = dict(q_head_start=8, q_per_kv=16, kv_head_start=0)
    tma_table = DESCRIPTOR_DECODE_CONFIGS if mode == "decode" else {d: GPU_CONFIGS[d, False] for d in (64, 128)}
    if torch.cuda.get_device_capability()[0] >= 9 and head_dim in tma_table and tma_table[head_dim].tma:
        launch = plan_prefix(q, kc, vc, table, lens, qsl, torch.empty_like(q), torch.empty(q.shape[:2], device="cuda"),
                             scale=0.1, **heads, max_kv_len=max(ctx), max_query_len=max_query_len)
        assert launch.stage1.constexprs["USE_TMA"]
        # the prefix pass reads the descriptor rows a chunk ahead: 4,097 tokens in one split are two chunks of tiles
        assert launch.stage1.constexprs["ROWS_AHEAD"] == (mode != "decode")
    for num_splits in (None, 1, 3):
        _check(q, kc, vc, table, lens, qsl, heads=heads, max_query_len=max_query_len, num_splits=num_splits,
               dtype=dtype)


@pytest.mark.parametrize("block_size", [16, 64])
def test_int64_offsets(block_size):
    # K/V views of one buffer whose page offsets pass 2**31 elements.
    head_dim = 128
    extra = (2**31) // (block_size * 2 * head_dim) + 8
    args = _prefix_inputs([1, 3], [100, 40], num_q_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=block_size,
                          dtype=torch.float16, extra_blocks=extra)
    assert args[3].max().item() * args[1].stride(0) > 2**31
    _check(*args, heads=dict(q_head_start=0, q_per_kv=4, kv_head_start=0), max_query_len=3, dtype=torch.float16)


def test_cuda_graph_replay():
    args = _prefix_inputs([1] * 8, [5000, 17, 0, 300, 4096, 1, 64, 2000], num_q_heads=8, num_kv_heads=1, head_dim=128,
                          block_size=16, dtype=torch.bfloat16)
    q, kc, vc, table, lens, qsl = args
    heads = dict(q_head_start=0, q_per_kv=8, kv_head_start=0)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    call = lambda: prefix_attention(q, kc, vc, table, lens, qsl, scale=0.1, **heads, max_kv_len=5000,  # noqa: E731
                                    max_query_len=1, out=out, lse=lse)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([4000, 0, 9, 300, 4096, 2, 100, 5000], device="cuda"))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                    scale=0.1, **heads, max_kv_len=5000)
    assert_matches(out, want_out, torch.bfloat16, "out")
    assert_matches(lse, want_lse, torch.bfloat16, "lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_write_kv_cache_high_slots(dtype):
    # vLLM-style views of one [num_blocks, block_size, H, 2 * D] buffer; slots whose offsets pass 2**31 elements.
    num_heads, head_dim, block_size = 8, 128, 16
    num_blocks = (2**31) // (block_size * num_heads * 2 * head_dim) + 4
    buf = torch.zeros(num_blocks, block_size, num_heads, 2 * head_dim, dtype=dtype, device="cuda")
    kc, vc = buf[..., :head_dim], buf[..., head_dim:]
    k, v = (torch.randn(300, num_heads, head_dim, device="cuda").to(dtype) for _ in range(2))
    total = num_blocks * block_size
    slots = torch.randperm(total - 64, device="cuda")[:256]  # distinct from the last 64 (a slot written twice
    slots[:64] = torch.arange(total - 64, total, device="cuda")  # would hold only its second row)
    slots[64::5] = -1
    write_kv_cache(k, v, kc, vc, slots)
    mine = slots >= 0
    kept = slots[mine]
    assert torch.equal(kc[kept // block_size, kept % block_size], k[:256][mine])
    assert torch.equal(vc[kept // block_size, kept % block_size], v[:256][mine])
    assert int((kc != 0).any(-1).any(-1).sum()) == int(mine.sum())  # nothing written for slot -1 or padding rows
