"""``DCP_TRITON_FP8_PREFILL=copy``: a prefill step's prefix pass over an fp8 cache reads a 16-bit copy of its pages
(``dcp_plugin.kernels.fp8_prefill``). The copy holds ``value * scale`` rounded once to q's dtype, zero past each
request's cached tokens; the pass over it equals float64 attention over the dequantized cache, in the kernels and in
DCP at N = 1, 2; decode and short-query steps, and steps whose copy would be too large, read the fp8 cache directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcp_plugin import kernels
from dcp_plugin.kernels import _plan_cache, fp8_prefill, reference
from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV, CopiedPrefix
from dcp_plugin.testing import Case
from tests.helpers.fp8_checks import run_fp8_dcp
from tests.helpers.kernel_checks import assert_matches, poisoned

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = {torch.float8_e4m3fn: (0.02, 0.03), torch.float8_e5m2: (0.5, 0.25)}
HEADS = dict(scale=0.25, q_head_start=0, q_per_kv=2, kv_head_start=0)


@pytest.fixture(autouse=True)
def _copy(monkeypatch):
    monkeypatch.setenv(FP8_PREFILL_ENV, "copy")
    _plan_cache.clear()
    yield
    _plan_cache.clear()


def _inputs(dtype, *, page: int, lens: list[int], rows: list[int], q_dtype=torch.float32, seed: int = 0):
    """q, an fp8 cache in pages of ``page`` (shuffled; the rows past each request's tokens hold NaN), its table, the
    lengths, query_start_loc and the scales."""
    gen = torch.Generator().manual_seed(seed)
    k_scale, v_scale = (torch.tensor([s], dtype=torch.float32) for s in SCALES[dtype])
    per_req = max(-(-n // page) for n in lens) + 1
    blocks = len(lens) * per_req
    kc = (torch.randn(blocks, page, 2, 32, generator=gen) / k_scale).to(dtype)
    vc = (torch.randn(blocks, page, 2, 32, generator=gen) / v_scale).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(len(lens), per_req)
    for b, n in enumerate(lens):  # what a kernel must never read
        for j in range(n, per_req * page):
            for cache in (kc, vc):
                cache[table[b, j // page], j % page] = float("nan")
    qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 4, 32, generator=gen).to(q_dtype)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), qsl, k_scale, v_scale


def _run(q, kc, vc, table, lens, qsl, k_scale, v_scale, **hints):
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], torch.float32)
    plan = kernels.plan_prefix(q, kc, vc, table, lens, qsl, out, lse, **HEADS, max_kv_len=int(lens.max()), **hints)
    plan(q, kc, vc, table, lens, qsl, out, lse, k_scale, v_scale)
    return plan, out, lse


def _reference(q, kc, vc, table, lens, qsl, k_scale, v_scale):
    return reference.prefix_attention(q.double(), kc.double() * k_scale.double(), vc.double() * v_scale.double(),
                                      table, lens, qsl, **HEADS, max_kv_len=int(lens.max()))


@pytest.mark.parametrize("page", [16, 64, 48], ids=["page16", "page64", "page48"])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_a_prefill_over_an_fp8_cache_reads_its_16_bit_copy_and_equals_float64(dtype, page):
    args = _inputs(dtype, page=page, lens=[150, 0, 64], rows=[70, 64, 66])
    plan, out, lse = _run(*args, max_query_len=70)
    assert isinstance(plan, CopiedPrefix), "the step must take the copy"
    want_out, want_lse = _reference(*args)
    assert_matches(out, want_out, torch.float32, f"copied fp8 prefix out, page {page}")
    assert_matches(lse, want_lse, torch.float32, f"copied fp8 prefix lse, page {page}")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_copy_holds_value_times_scale_rounded_once_and_zero_past_the_context(q_dtype):
    dtype = torch.float8_e4m3fn
    q, kc, vc, table, lens, qsl, k_scale, v_scale = _inputs(dtype, page=16, lens=[150, 0, 64], rows=[70, 64, 66],
                                                            q_dtype=q_dtype, seed=1)
    plan, out, _ = _run(q, kc, vc, table, lens, qsl, k_scale, v_scale, max_query_len=70)
    assert isinstance(plan, CopiedPrefix) and plan.k_copy.dtype == q_dtype
    pages = plan.table.shape[1]
    assert pages % 2 == 0 and pages * fp8_prefill.COPY_PAGE >= 150  # two pages a key tile, every token held
    for copy, cache, scale in ((plan.k_copy, kc, k_scale), (plan.v_copy, vc, v_scale)):
        for b, n in enumerate(lens.tolist()):
            held = copy[plan.table[b].long()].flatten(0, 1)  # the request's tokens, in order
            want = torch.stack([cache[table[b, j // 16], j % 16] for j in range(n)]).float() * scale if n else None
            if n:
                assert torch.equal(held[:n], want.to(q_dtype)), f"request {b}: value x scale, rounded once"
            if n % fp8_prefill.COPY_PAGE:  # the rest of its last page: zeros, never the cache's NaN
                assert torch.equal(held[n:-(-n // 64) * 64], torch.zeros_like(held[n:-(-n // 64) * 64]))
    want_out, _ = _reference(q, kc, vc, table, lens, qsl, k_scale, v_scale)
    assert_matches(out, want_out, q_dtype, "copied fp8 prefix out, fp16 q" if q_dtype == torch.float16 else "fp32 q")


@pytest.mark.parametrize("why", ["decode", "short rows", "too large", "tiles"])
def test_decode_short_queries_large_copies_and_tiles_read_the_fp8_cache(why, monkeypatch):
    lens, rows, hints = [150, 40, 64], [70, 64, 66], dict(max_query_len=70)
    if why == "decode":
        rows, hints = [1, 1, 1], dict(max_query_len=1)
    elif why == "short rows":
        rows = [70, 8, 8]  # 86 rows over three requests: fewer than COPY_MIN_ROWS each on average
    elif why == "too large":
        monkeypatch.setattr(fp8_prefill, "COPY_MAX_BYTES", 4 * 64 * 2 * 32 * 4 * 2 - 1)  # one byte short of 4 pages
    else:
        monkeypatch.setenv(FP8_PREFILL_ENV, "tiles")
    args = _inputs(torch.float8_e5m2, page=16, lens=lens, rows=rows, seed=2)
    plan, out, lse = _run(*args, **hints)
    assert not isinstance(plan, CopiedPrefix), why
    want_out, want_lse = _reference(*args)
    assert_matches(out, want_out, torch.float32, f"direct fp8 prefix out ({why})")
    assert_matches(lse, want_lse, torch.float32, f"direct fp8 prefix lse ({why})")


def test_the_copy_is_the_default(monkeypatch):
    monkeypatch.delenv(FP8_PREFILL_ENV)
    monkeypatch.delenv("DCP_TRITON_FP8_DOT", raising=False)
    args = _inputs(torch.float8_e5m2, page=16, lens=[150, 40, 64], rows=[70, 64, 66], seed=2)
    plan, out, _ = _run(*args, max_query_len=70)
    assert isinstance(plan, CopiedPrefix) and kernels.fp8_copy_asked()
    assert_matches(out, _reference(*args)[0], torch.float32, "fp8 prefix out, unset")


@pytest.mark.parametrize("prefill, dot, copies", [("", "1", False), ("", "2", False), ("", "0", True),
                                                  ("copy", "2", True), ("tiles", "0", False)])
def test_fp8_products_keep_the_tiles_unless_the_copy_is_named(prefill, dot, copies, monkeypatch):
    """The fp8 products (``DCP_TRITON_FP8_DOT``) read the fp8 tiles: asked for, they need no second variable."""
    monkeypatch.setenv(FP8_PREFILL_ENV, prefill)
    monkeypatch.setenv("DCP_TRITON_FP8_DOT", dot)
    assert kernels.fp8_copy_asked() is copies
    monkeypatch.setenv(FP8_PREFILL_ENV, "widen")
    with pytest.raises(ValueError, match="DCP_TRITON_FP8_PREFILL must be tiles .* or copy .*, got 'widen'"):
        kernels.fp8_copy_asked()


def test_a_copy_without_memory_reads_the_fp8_cache_and_says_so_once(monkeypatch, caplog):
    tries: list[int] = []

    def no_memory(count, key):
        tries.append(count)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(fp8_prefill, "_COPIES", fp8_prefill.GrownBuffers(no_memory))
    monkeypatch.setattr(fp8_prefill, "_no_memory", [])
    args = _inputs(torch.float8_e5m2, page=16, lens=[150, 40, 64], rows=[70, 64, 66], seed=4)
    with caplog.at_level("WARNING", logger="dcp_plugin"):
        for _ in range(2):
            _plan_cache.clear()
            plan, out, lse = _run(*args, max_query_len=70)
            assert not isinstance(plan, CopiedPrefix)
            want_out, want_lse = _reference(*args)
            assert_matches(out, want_out, torch.float32, "fp8 prefix out, no memory for the copy")
            assert_matches(lse, want_lse, torch.float32, "fp8 prefix lse, no memory for the copy")
    assert len(caplog.records) == 1 and "no GPU memory for the 16-bit copy" in caplog.records[0].getMessage()
    assert len(tries) == 1  # a copy as large is not tried again: each failure costs the allocator a synchronisation


def test_the_copy_fits_exactly_at_the_bound(monkeypatch):
    monkeypatch.setattr(fp8_prefill, "COPY_MAX_BYTES", 4 * 64 * 2 * 32 * 4 * 2)  # K and V, 3 requests x 2 pages
    args = _inputs(torch.float8_e5m2, page=16, lens=[64, 40, 64], rows=[70, 64, 66], seed=3)
    plan, _, _ = _run(*args, max_query_len=70)
    assert not isinstance(plan, CopiedPrefix)  # 3 requests x 2 pages x 64 x 2 heads x 32 x fp32 x (K, V) > bound
    monkeypatch.setattr(fp8_prefill, "COPY_MAX_BYTES", 6 * 64 * 2 * 32 * 4 * 2)
    plan, _, _ = _run(*args, max_query_len=70)
    assert isinstance(plan, CopiedPrefix)


def test_a_bad_setting_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(FP8_PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match=r"DCP_TRITON_FP8_PREFILL must be tiles \(.*\) or copy \(.*got 'fast'"):
        kernels.fp8_copy_asked()


def test_the_one_shot_call_keeps_a_plan_per_setting(monkeypatch):
    args = _inputs(torch.float8_e4m3fn, page=16, lens=[100, 30], rows=[64, 64], seed=4)
    q, kc, vc, table, lens, qsl, k_scale, v_scale = args
    want_out, _ = _reference(*args)
    for setting in ("copy", "tiles", "copy"):
        monkeypatch.setenv(FP8_PREFILL_ENV, setting)
        out, _ = kernels.prefix_attention(q, kc, vc, table, lens, qsl, **HEADS, max_kv_len=100, max_query_len=64,
                                          k_scale=k_scale, v_scale=v_scale)
        assert_matches(out, want_out, torch.float32, f"one-shot fp8 prefix ({setting})")
    kinds = {type(plan).__name__ for plan in _plan_cache._plans.values()}
    assert kinds == {"CopiedPrefix", "PrefixLaunch"}  # a plan per setting, none replayed under the other


@pytest.mark.parametrize("n", [1, 2])
def test_dcp_prefill_over_fp8_shards_through_the_copy_equals_float64(n, monkeypatch):
    calls = []
    original = CopiedPrefix.__call__
    monkeypatch.setattr(CopiedPrefix, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    case = Case(name="fp8-copy", q_heads=4, kv_heads=2, requests=((150, 70), (0, 64), (90, 66)), head_dim=16,
                seed=23, kernel_impl="triton")
    k_scale, v_scale = (torch.tensor([s], dtype=torch.float32) for s in SCALES[torch.float8_e4m3fn])
    # The Triton kernels, but the cache write torch's: the interpreter rounds float32 to fp8 wrongly.
    ops = SimpleNamespace(**{name: getattr(kernels, name) for name in ("plan_chunk", "plan_prefix", "plan_merge",
                                                                       "split_capacity")},
                          plan_write_kv=reference.plan_write_kv)
    assert run_fp8_dcp(case, n, torch.float8_e4m3fn, k_scale, v_scale, ops, label="fp8 copy") == [1] * n
    assert calls, "the prefill step's prefix pass must have read the copy"
