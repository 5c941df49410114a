"""Which kernels ``plan_prefix`` and ``plan_chunk`` prepare. The prefix pass: the Gluon one (``gluon_prefix``, sm_90
with Triton 3.6) only for a prefill step's one-split prefix pass over 64-token pages of a head-size-64 or -128
fp16/bf16 cache that tensor descriptors can read, unless ``DCP_TRITON_GLUON=0``; the Gluon decode (``gluon_decode``)
for a decode over such a cache with more than 16 Q heads per KV group; the ``tl`` kernel for everything else, and
everywhere Gluon may not run (float64 checks: tests/gpu/test_gluon_prefix_gpu.py, test_gluon_decode_gpu.py). The
current chunk: the Gluon
one (``gluon_chunk``) for head size 64 or 128, fp16/bf16, K and V with their heads contiguous
(tests/gpu/test_gluon_chunk_gpu.py). Here the selection itself, on CPU, both ways."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import _gluon
from dcp_plugin.kernels._launch import num_sms
from dcp_plugin.kernels.chunk_attention import ChunkConfig, plan_chunk
from dcp_plugin.kernels.prefix_attention import plan_prefix


def _plan(*, q_lens=(40, 300), ctx=(100, 700), page=64, head_dim=128, dtype=torch.bfloat16, cache_dtype=None,
          max_query_len=300, num_splits=1, config=None, q_stride_d=1, heads=(8, 2), gluon_decode=None, launch=False):
    (num_q_heads, num_kv_heads), q_per_kv = heads, heads[0] // heads[1]
    tokens = sum(q_lens)
    q = torch.zeros(tokens, num_q_heads, head_dim * q_stride_d, dtype=dtype)[..., ::q_stride_d]
    pages = [-(-c // page) for c in ctx]
    buf = torch.zeros(sum(pages) + 1, page, num_kv_heads, 2 * head_dim, dtype=cache_dtype or dtype)
    table = torch.arange(sum(pages), dtype=torch.int32)
    block_table = torch.zeros(len(ctx), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = table[start:start + n]
        start += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    kc, vc = buf[..., :head_dim], buf[..., head_dim:]
    out = torch.zeros(tokens, num_q_heads, head_dim, dtype=dtype)
    lse = torch.zeros(tokens, num_q_heads)
    plan = plan_prefix(q, kc, vc, block_table, lens, qsl, out, lse, scale=0.1, q_head_start=0, q_per_kv=q_per_kv,
                       kv_head_start=0, max_kv_len=max(ctx), max_query_len=max_query_len, num_splits=num_splits,
                       config=config, gluon_decode=gluon_decode)
    return plan if launch else plan.stage1.kernel.__name__


def test_interpreter_and_cpu_never_take_gluon():
    assert not _gluon.gluon_enabled(torch.device("cpu"))
    assert _plan() == "prefix_attention_kernel"


@pytest.fixture
def hopper(monkeypatch):
    """What an sm_90 GPU with Triton 3.6 answers (the plan is built, never launched)."""
    monkeypatch.setattr(_gluon, "gluon_enabled", lambda device: True)


@pytest.mark.usefixtures("hopper")
def test_prefill_one_split_takes_gluon():
    assert _plan() == "gluon_prefix_kernel"
    assert _plan(dtype=torch.float16) == "gluon_prefix_kernel"
    assert _plan(max_query_len=9) == "gluon_prefix_kernel"  # just past the short-query variant
    assert _plan(head_dim=64) == "gluon_prefix_kernel"


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("change", [
    dict(max_query_len=1, q_lens=(1, 1)),  # decode
    dict(max_query_len=8),  # a speculative verify's short queries
    dict(max_query_len=None),  # unknown query lengths: the caller promised nothing
    dict(num_splits=2),  # split-KV: the tl kernel's partials and merge
    dict(page=16),  # pages the Gluon kernel does not take
    dict(page=128),
    dict(head_dim=256),
    dict(dtype=torch.float32),
    dict(cache_dtype=torch.float8_e4m3fn),
    dict(q_stride_d=2),  # q not unit-stride along D
], ids=["decode", "short", "unknown-len", "splits", "page16", "page128", "d256", "fp32", "fp8", "q-strided"])
def test_everything_else_takes_tl(change, monkeypatch):
    monkeypatch.setenv("DCP_TRITON_FP8_PREFILL", "tiles")  # the fp8 cache read in the pass (the default copies it)
    assert _plan(**change) == "prefix_attention_kernel"


DECODE = dict(max_query_len=1, q_lens=(1, 1))


@pytest.mark.usefixtures("hopper")
def test_decode_with_large_groups_takes_gluon():
    """More than ``GLUON_DECODE_MIN_KV_GROUP`` Q heads per KV group: ``gluon_decode`` as stage 1, over a KV group's
    heads in tiles of 64, with its split partials merged by the ``tl`` merge."""
    assert _gluon.GLUON_DECODE_MIN_KV_GROUP == 16
    assert _plan(**DECODE, heads=(32, 1)) == _plan(**DECODE, heads=(32, 1), head_dim=64) == "gluon_decode_kernel"
    assert _plan(**DECODE, heads=(34, 2), dtype=torch.float16) == "gluon_decode_kernel"
    plan = _plan(**DECODE, heads=(128, 1), num_splits=3, launch=True)
    items = (2 + 1) * 2 * 3  # 2 requests and the padding rows, 2 head tiles, 3 splits
    assert plan.stage1.scalars[4] == items
    assert plan.stage1.grid == (min(items, num_sms(0)), 1, 1), "a program per SM at most, each over items in turn"
    looping = _plan(**DECODE, heads=(128, 1), num_splits=3, gluon_decode=(1, 4, 5), launch=True)
    assert looping.stage1.grid == (5, 1, 1), "at most 5 programs"
    flat = _plan(**DECODE, heads=(128, 1), num_splits=3, gluon_decode=(1, 4, 0), launch=True)
    assert flat.stage1.grid == (items, 1, 1), "a program per item"
    assert plan.merge.kernel.__name__ == "split_merge_kernel"
    assert _plan(**DECODE, heads=(32, 1), num_splits=None, launch=True).merge is None, "1 split under the interpreter"


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("change", [
    dict(heads=(16, 1)),  # a KV group of 16: the tl kernel's descriptor tiles
    dict(heads=(8, 2)),
    dict(heads=(32, 1), page=16),
    dict(heads=(32, 1), page=128),
    dict(heads=(32, 1), head_dim=256),
    dict(heads=(32, 1), dtype=torch.float32),
    dict(heads=(32, 1), cache_dtype=torch.float8_e4m3fn),
    dict(heads=(32, 1), q_stride_d=2),
    dict(heads=(32, 1), config=None, max_query_len=2, q_lens=(2, 2)),  # not a decode
], ids=["group16", "group4", "page16", "page128", "d256", "fp32", "fp8", "q-strided", "two-rows"])
def test_other_decodes_take_tl(change):
    assert _plan(**{**DECODE, **change}) == "prefix_attention_kernel"


@pytest.mark.usefixtures("hopper")
def test_a_benchmark_can_ask_for_gluon_decode_at_any_group():
    assert _plan(**DECODE, heads=(8, 2), gluon_decode=(1, 4)) == "gluon_decode_kernel"
    assert _plan(**DECODE, heads=(8, 2), gluon_decode=(1, 4), launch=True).stage1.constexprs["PAGES"] == 1


@pytest.mark.usefixtures("hopper")
def test_a_benchmark_config_keeps_tl():
    from dcp_plugin.kernels.prefix_attention import PrefixConfig

    assert _plan(config=PrefixConfig(block_n=64, block_m=128, num_warps=4, num_stages=2)) == "prefix_attention_kernel"


def test_switch_reads_one_or_zero(monkeypatch):
    monkeypatch.delenv(_gluon.GLUON_ENV, raising=False)
    monkeypatch.setattr(_gluon, "gluon_supported", lambda device: True)  # an sm_90 GPU with Triton 3.6
    assert _gluon.gluon_enabled(torch.device("cuda", 0)), "on by default where supported"
    monkeypatch.setenv(_gluon.GLUON_ENV, "1")
    assert _gluon.gluon_enabled(torch.device("cuda", 0))
    monkeypatch.setenv(_gluon.GLUON_ENV, "0")
    assert not _gluon.gluon_enabled(torch.device("cuda", 0))
    monkeypatch.setenv(_gluon.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="DCP_TRITON_GLUON must be 1 .* or 0"):
        _gluon.gluon_enabled(torch.device("cuda", 0))


def test_cpu_is_never_supported(monkeypatch):
    monkeypatch.setenv(_gluon.GLUON_ENV, "1")
    assert not _gluon.gluon_supported(torch.device("cpu"))
    assert not _gluon.gluon_enabled(torch.device("cpu"))


def _chunk(*, head_dim=128, dtype=torch.bfloat16, kv_heads_apart=False, config=None):
    """The kernel ``plan_chunk`` prepares for a step of 8 local Q heads over 2 KV heads (vLLM-style views of one
    qkv buffer; ``kv_heads_apart``: K's heads not contiguous)."""
    tokens, hq, hk = 40, 8, 2
    qkv = torch.zeros(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], 1))
    if kv_heads_apart:
        k = torch.zeros(tokens, hk, 2 * head_dim, dtype=dtype)[..., :head_dim]
    out, lse = torch.zeros(tokens, hq, head_dim, dtype=dtype), torch.zeros(tokens, hq)
    qsl = torch.tensor([0, 15, 40], dtype=torch.int32)
    return plan_chunk(q, k, v, out, lse, qsl, 25, scale=0.1, q_head_start=0, q_per_kv=4, kv_head_start=0,
                      config=config).kernel.__name__


def test_chunk_interpreter_takes_tl():
    assert _chunk() == "chunk_attention_kernel"


@pytest.mark.usefixtures("hopper")
def test_chunk_takes_gluon_on_hopper():
    assert _chunk() == _chunk(dtype=torch.float16) == _chunk(head_dim=64) == "gluon_chunk_kernel"


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("change", [dict(head_dim=256), dict(dtype=torch.float32), dict(kv_heads_apart=True),
                                    dict(config=ChunkConfig(block_m=64, block_n=64, num_warps=4, num_stages=2))],
                         ids=["d256", "fp32", "kv-heads-apart", "config"])
def test_chunk_everything_else_takes_tl(change):
    assert _chunk(**change) == "chunk_attention_kernel"


@pytest.mark.parametrize("variable, bad, message", [
    (_gluon.GLUON_ENV, "on", "DCP_TRITON_GLUON must be 1 .* or 0 .* got 'on'"),
    ("DCP_TRITON_FP8_DOT", "3", "DCP_TRITON_FP8_DOT must be 0 .*, 1 .* or 2 .* got '3'"),
    ("DCP_TRITON_FP8_PREFILL", "fast", "DCP_TRITON_FP8_PREFILL must be tiles .* or copy .* got 'fast'")])
def test_a_bad_switch_is_refused_when_the_engine_starts(variable, bad, message, monkeypatch):
    from dcp_plugin.kernel_choice import choose_kernel_impl

    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=message):
        choose_kernel_impl(engine="vLLM")


def test_three_stages_need_the_producer_fix():
    """Three stages with each consumer's V copies would ask for 256 KiB of shared memory: refused when planned, with
    what works, not at compile or launch."""
    from dcp_plugin.kernels import gluon_chunk, gluon_prefix

    q, k = torch.zeros(300, 8, 128, dtype=torch.bfloat16), torch.zeros(300, 2, 128, dtype=torch.bfloat16)
    out, lse, qsl = torch.zeros_like(q), torch.zeros(300, 8), torch.tensor([0, 100, 300], dtype=torch.int32)
    heads = dict(scale=0.1, q_head_start=0, q_per_kv=4, kv_head_start=0)
    with pytest.raises(ValueError, match="stages=3 needs producer_fix=True"):
        gluon_chunk.plan_gluon_chunk(q, k, k, out, lse, qsl, **heads, stages=3, producer_fix=False)
    assert gluon_chunk.plan_gluon_chunk(q, k, k, out, lse, qsl, **heads, stages=3, producer_fix=True).constexprs[
        "STAGES"] == 3
    cache, table, lens = torch.zeros(20, 64, 2, 128, dtype=torch.bfloat16), torch.zeros(2, 10, dtype=torch.int32), \
        torch.tensor([100, 600], dtype=torch.int32)
    with pytest.raises(ValueError, match="stages=3 needs producer_fix=True"):
        gluon_prefix.plan_gluon_prefix(q, cache, cache, table, lens, qsl, out, lse, **heads, stages=3,
                                       producer_fix=False)


def test_head_columns_place_each_kv_head_in_one_descriptor():
    """``gluon_decode`` reads every KV head through one descriptor over the cache's token rows: the columns its heads
    span in vLLM's layout, in K and V cut from one buffer, and in a head-major layout (a head's rows further down,
    column 0); a head whose D elements would cross a token row is refused (the ``tl`` kernel serves it)."""
    nhd = torch.zeros(5, 64, 8, 128)
    assert _gluon.head_columns(nhd) == 8 * 128
    buf = torch.zeros(5, 64, 8, 2 * 128)
    assert _gluon.head_columns(buf[..., :128]) == _gluon.head_columns(buf[..., 128:]) == 7 * 256 + 128
    hnd = torch.zeros(5, 8, 64, 128).transpose(1, 2)  # [blocks, page, heads, D] view of head-major storage
    assert hnd.stride(1) == 128 and _gluon.head_columns(hnd) == 128
    crossing = torch.zeros(5 * 64 * 8 * 128 + 64).as_strided((5, 64, 8, 128), (64 * 8 * 128, 8 * 128, 136, 1))
    assert _gluon.head_columns(crossing) == 0
