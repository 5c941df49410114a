"""The one-shot calls' kept plans on a GPU: a plan holds its split scratch, so a call on another stream plans its
own, and each stream's calls match float64 attention."""

from __future__ import annotations

import importlib

import pytest
import torch

from dcp_plugin.kernels import _plan_cache, reference
from tests.helpers.kernel_checks import assert_matches, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
prefix_module = importlib.import_module("dcp_plugin.kernels.prefix_attention")
D, PAGE, HEADS = 128, 64, dict(q_head_start=0, q_per_kv=4, kv_head_start=0)


def test_each_stream_keeps_a_plan_of_its_own(monkeypatch):
    _plan_cache.clear()
    built = []
    plan = prefix_module.plan_prefix
    monkeypatch.setattr(prefix_module, "plan_prefix", lambda *a, **k: built.append(1) or plan(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.tensor([700, 3000], dtype=torch.int32, device="cuda")
    table = torch.arange(2 * 48, dtype=torch.int32, device="cuda").view(2, 48)
    kc, vc = (torch.randn(96, PAGE, 2, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    qsl = torch.arange(3, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream(), side):
        q = torch.randn(2, 8, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        out, lse = poisoned(q.shape, torch.bfloat16, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            prefix_module.prefix_attention(q, kc, vc, table, lens, qsl, scale=D ** -0.5, **HEADS, max_kv_len=3000,
                                           max_query_len=1, num_splits=4, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(stream)
        want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                        scale=D ** -0.5, **HEADS, max_kv_len=3000)
        assert_matches(out, want_out, torch.bfloat16, "out")
        assert_matches(lse, want_lse, torch.bfloat16, "lse")
    assert len(built) == 2, "one plan per stream, replayed by that stream's later call"
    _plan_cache.clear()


@pytest.mark.parametrize("kv_len", [1024, 300])
def test_a_small_one_shot_decode_launches_once(kv_len, monkeypatch):
    """A one-shot decode of few (token, head program)s merges its splits in the last split's program, where the
    serving plans keep the merge launch (``fewer_launches``): one launch, float64's answer, its counters zero again
    for the next call."""
    _plan_cache.clear()
    plans = []
    plan = prefix_module.plan_prefix
    monkeypatch.setattr(prefix_module, "plan_prefix", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    gen = torch.Generator(device="cuda").manual_seed(1)
    lens = torch.tensor([kv_len], dtype=torch.int32, device="cuda")
    table = torch.randperm(16, generator=gen, device="cuda").to(torch.int32).view(1, 16)
    kc, vc = (torch.randn(16, PAGE, 8, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    qsl = torch.arange(2, dtype=torch.int32, device="cuda")
    for _ in range(2):
        q = torch.randn(1, 32, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        out, lse = prefix_module.prefix_attention(q, kc, vc, table, lens, qsl, scale=D ** -0.5, **HEADS,
                                                  max_kv_len=kv_len, max_query_len=1,
                                                  out=poisoned(q.shape, torch.bfloat16, "cuda"),
                                                  lse=poisoned(q.shape[:2], torch.float32, "cuda"))
        want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                        scale=D ** -0.5, **HEADS, max_kv_len=kv_len)
        assert_matches(out, want_out, torch.bfloat16, "out")
        assert_matches(lse, want_lse, torch.bfloat16, "lse")
    assert len(plans) == 1, "the second call replays the kept plan"
    (kept,) = plans
    assert kept.num_splits > 1 and kept.merge is None and kept.stage1.constexprs["LAST_MERGES"], \
        f"{kept.num_splits} splits, merge launch {kept.merge is not None}"
    _plan_cache.clear()
