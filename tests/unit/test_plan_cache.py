"""The one-shot calls' kept plans (``dcp_plugin.kernels._plan_cache``): ``prefix_attention`` and ``chunk_attention``
called again with tensors laid out as before replay the earlier plan on the new data (checked against float64
attention each time, outputs poisoned with NaN first), and plan again whenever anything planning reads differs."""

from __future__ import annotations

import importlib

import pytest
import torch

from dcp_plugin.kernels import _plan_cache, reference
from dcp_plugin.kernels._gluon import GLUON_ENV
from dcp_plugin.kernels._pdl import PDL_ENV
from dcp_plugin.kernels._prefix_config import FP8_DOT_ENV
from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV
from dcp_plugin.kernels._launch import every_variant
from tests.helpers.kernel_checks import assert_matches, poisoned

prefix_module = importlib.import_module("dcp_plugin.kernels.prefix_attention")  # the package exports the functions
chunk_module = importlib.import_module("dcp_plugin.kernels.chunk_attention")  # under the modules' names
HEADS = dict(q_head_start=0, q_per_kv=2, kv_head_start=0)
D, PAGE = 64, 16


def _count_calls(monkeypatch, names: dict) -> dict:
    """``{"prefix": name, "chunk": name}``: each module's function of that name counted per call."""
    calls = dict.fromkeys(names, 0)

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    for kind, module in (("prefix", prefix_module), ("chunk", chunk_module)):
        monkeypatch.setattr(module, names[kind], counted(kind, getattr(module, names[kind])))
    return calls


@pytest.fixture
def plans_built(monkeypatch):
    """How many plans the public calls build (each kept plan cleared first)."""
    _plan_cache.clear()
    yield _count_calls(monkeypatch, {"prefix": "plan_prefix", "chunk": "plan_chunk"})
    _plan_cache.clear()


def _paged(seed: int, *, dtype=torch.float32, kv_lens=(5, 40), q_view: str = "plain"):
    """One decode row per request over ``kv_lens`` cached tokens in shuffled pages of ``PAGE``; 4 Q / 2 KV heads."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in kv_lens]
    order = torch.randperm(sum(pages), generator=gen)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start:start + n]
        start += n
    kc, vc = (torch.randn(sum(pages), PAGE, 2, D, generator=gen).to(dtype) for _ in range(2))
    rows = torch.randn(len(kv_lens) * 4 * D + 1, generator=gen).to(dtype)
    if q_view == "shifted":  # the same shape and strides one element off a 16-byte boundary
        q = rows[1:].view(len(kv_lens), 4, D)
    elif q_view == "strided":  # a slice of wider rows, as after a fused projection
        q = torch.randn(len(kv_lens), 6, D, generator=gen).to(dtype)[:, 2:]
    else:
        q = rows[:-1].view(len(kv_lens), 4, D)
    return (q, kc, vc, table, torch.tensor(kv_lens, dtype=torch.int32),
            torch.arange(len(kv_lens) + 1, dtype=torch.int32))


def _decode(tensors, *, max_kv_len: int = 40, num_splits=None):
    q = tensors[0]
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], torch.float32)
    prefix_module.prefix_attention(*tensors, scale=D ** -0.5, **HEADS, max_kv_len=max_kv_len, max_query_len=1,
                                   num_splits=num_splits, out=out, lse=lse)
    want_out, want_lse = reference.prefix_attention(tensors[0].double(), tensors[1].double(), tensors[2].double(),
                                                    *tensors[3:], scale=D ** -0.5, **HEADS, max_kv_len=max_kv_len)
    assert_matches(out, want_out, q.dtype, "out")
    assert_matches(lse, want_lse, q.dtype, "lse")


def test_a_call_laid_out_as_before_replays_the_plan_on_its_own_data(plans_built):
    for splits in (None, 2):  # one split (the CPU's choice), and split partials merged into each call's outputs
        for seed in range(3):
            _decode(_paged(seed), num_splits=splits)
    assert plans_built["prefix"] == 2


def test_anything_planning_reads_plans_again(plans_built, monkeypatch):
    _decode(_paged(0))
    variations = [
        lambda: _decode(_paged(1), max_kv_len=48),  # a host argument
        lambda: _decode(_paged(1), num_splits=2),
        lambda: _decode(_paged(1, kv_lens=(5, 40, 17))),  # a shape
        lambda: _decode(_paged(1, q_view="strided")),  # strides
        lambda: _decode(_paged(1, q_view="shifted")),  # alignment
        lambda: _decode(_paged(1, dtype=torch.float16)),  # dtype
    ]
    for built, vary in enumerate(variations, start=2):
        vary()
        assert plans_built["prefix"] == built
    monkeypatch.setenv(GLUON_ENV, "0")  # a switch planning reads at each call
    _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 2
    monkeypatch.setenv(FP8_DOT_ENV, "2")  # another one
    _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 3
    monkeypatch.setenv(FP8_PREFILL_ENV, "copy")  # and the last two
    _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 4
    monkeypatch.setenv(PDL_ENV, "0")
    _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 5
    monkeypatch.delenv(FP8_PREFILL_ENV)  # back to a setting seen before: its plan, kept
    monkeypatch.delenv(PDL_ENV)
    _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 5
    with every_variant():  # the warm-up's extra variants
        _decode(_paged(2))
    assert plans_built["prefix"] == len(variations) + 6


def test_only_the_latest_plans_are_kept(plans_built):
    lengths = [(3, n) for n in range(1, _plan_cache.KEPT + 2)]  # KEPT + 1 layouts (kv_lens shapes alike: max differs)
    for max_kv_len in range(1, _plan_cache.KEPT + 2):
        _decode(_paged(0, kv_lens=lengths[max_kv_len - 1]), max_kv_len=max_kv_len + 2)
    assert plans_built["prefix"] == _plan_cache.KEPT + 1
    _decode(_paged(1, kv_lens=lengths[-1]), max_kv_len=_plan_cache.KEPT + 3)  # the latest: kept
    assert plans_built["prefix"] == _plan_cache.KEPT + 1
    _decode(_paged(1, kv_lens=lengths[0]), max_kv_len=3)  # the first: dropped, planned again
    assert plans_built["prefix"] == _plan_cache.KEPT + 2


def _chunk(seed: int, mask=None):
    gen = torch.Generator().manual_seed(seed)
    lens = (3, 5)
    q, k, v = (torch.randn(sum(lens), h, D, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], torch.float32)
    chunk_module.chunk_attention(q, k, v, cu, max(lens), scale=D ** -0.5, **HEADS, out=out, lse=lse, chunk_mask=mask)
    want_out, want_lse = reference.chunk_attention(q.double(), k.double(), v.double(), cu, max(lens), scale=D ** -0.5,
                                                   **HEADS, chunk_mask=mask)
    assert_matches(out, want_out, torch.float32, "out")
    assert_matches(lse, want_lse, torch.float32, "lse")


def test_the_current_chunk_replays_its_plan_but_a_chunk_mask_plans_afresh(plans_built):
    for seed in range(3):
        _chunk(seed)
    assert plans_built["chunk"] == 1
    causal = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    tree = causal.clone()
    tree[:, 2, 1] = False  # a branch: row 2 does not see row 1
    for mask in (causal, tree):  # one layout, two masks: each call reads its own
        _chunk(3, mask)
    assert plans_built["chunk"] == 3


def test_a_kept_plan_skips_the_checks_its_layout_passed_and_a_bad_argument_is_still_refused(plans_built, monkeypatch):
    """The checks read layouts and host arguments only: a call laid out as one that passed them replays its plan
    without them. A host argument equal to a kept one but of another type (False for 0), or not a tensor where one
    belongs, is checked, and refused in one line."""
    checked = _count_calls(monkeypatch, {"prefix": "checked_outputs", "chunk": "_checked_outputs"})
    for seed in range(3):
        _decode(_paged(seed))
        _chunk(seed)
    assert checked == {"prefix": 1, "chunk": 1} and plans_built == {"prefix": 1, "chunk": 1}
    tensors = _paged(4)
    for out in (None, None):  # outputs made by the call: checked once, then made on the kept plan's path
        got, got_lse = prefix_module.prefix_attention(*tensors, scale=D ** -0.5, **HEADS, max_kv_len=40,
                                                      max_query_len=1, out=out)
        want, want_lse = reference.prefix_attention(*(t.double() for t in tensors[:3]), *tensors[3:], scale=D ** -0.5,
                                                    **HEADS, max_kv_len=40)
        assert_matches(got, want, torch.float32, "out")
        assert_matches(got_lse, want_lse, torch.float32, "lse")
    assert checked["prefix"] == 2
    with pytest.raises(ValueError, match="kv_head_start must be an int >= 0, got False"):
        prefix_module.prefix_attention(*_paged(5), scale=D ** -0.5, q_head_start=0, q_per_kv=2, kv_head_start=False,
                                       max_kv_len=40, max_query_len=1)
    q, kc, vc, table, lens, cu = _paged(5)
    with pytest.raises(ValueError, match="kv_lens must be a torch.Tensor, got list"):
        prefix_module.prefix_attention(q, kc, vc, table, lens.tolist(), cu, scale=D ** -0.5, **HEADS, max_kv_len=40,
                                       max_query_len=1)
    q, k, v = (torch.randn(8, h, D) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="scale must be a positive float, got True"):
        chunk_module.chunk_attention(q, k, v, torch.tensor([0, 3, 8], dtype=torch.int32), 5, scale=True, **HEADS)


def test_one_shot_calls_plan_for_fewer_launches(monkeypatch):
    """``prefix_attention`` plans with ``fewer_launches`` (a small decode's last split merges: one launch, not two),
    which the serving plans leave off."""
    module = prefix_module
    _plan_cache.clear()
    seen = []
    plan = module.plan_prefix
    monkeypatch.setattr(module, "plan_prefix", lambda *a, **k: seen.append(k.get("fewer_launches")) or plan(*a, **k))
    q, kc, vc = torch.randn(1, 4, 16), torch.randn(2, 16, 1, 16), torch.randn(2, 16, 1, 16)
    module.prefix_attention(q, kc, vc, torch.tensor([[1, 0]]), torch.tensor([20]), torch.tensor([0, 1]),
                            scale=0.25, q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=20, max_query_len=1)
    assert seen == [True]
    _plan_cache.clear()
