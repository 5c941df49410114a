"""A decode's balanced splits (``_schedule.balanced_split``) under the Triton interpreter: each request takes its own
split count from its share of the step's work, checked against the float64 reference, with the split partials'
buffer poisoned so that a partial the merge should skip (a split a request does not take, the partials of a request
of one split, which stage 1 writes to the output itself) turns the output NaN."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels._launch import every_variant
from dcp_plugin.kernels.prefix_attention import INTERPRET_CONFIG, plan_prefix
from tests.helpers.kernel_checks import assert_matches, poisoned
from tests.unit.test_kernel_prefix_attention import Case, _heads, _inputs


def _plan(case: Case, slots: int, q, caches, tables, out, lse, split_elements: int = 1 << 16, **kwargs):
    key_cache, value_cache = caches
    block_table, kv_lens, query_start_loc = tables
    return plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse,
                       scale=case.head_dim ** -0.5, **_heads(case), max_kv_len=max(case.kv_lens), max_query_len=1,
                       split_buffer=poisoned((split_elements,), torch.float32), split_slots=slots, **kwargs)


LAST_MERGES = dataclasses.replace(INTERPRET_CONFIG, last_split_merges=True)


CASES = {
    # One long context among short and empty ones, padding rows after the last request.
    "gqa2-long-among-short-padded": (Case([1] * 5, [640, 32, 0, 64, 1], 4, 2, 2, pad_rows=3), 8),
    "gqa4-fp16-d128-many-slots": (Case([1] * 4, [1100, 7, 300, 33], 8, 2, 4, head_dim=128,
                                       dtype=torch.float16, layout="kv_last_dim"), 40),
    # A DCP rank's heads: the gathered Q heads 6-11 of 12 over stored KV heads 1-2.
    "dcp-12q3kv-rank1-hnd": (Case([1] * 3, [1, 630, 130], 6, 2, 4, q_head_start=6, kv_head_start=1,
                                  layout="hnd"), 6),
    "mqa8-one-request-all-slots": (Case([1], [2000], 8, 1, 8), 16),
    # Requests without a query row (a padded batch's) take no work row: counting their 700 tokens would give the
    # others 7 work rows, and with the 6 padding rows 13, past the grid's cdiv(8, 2) + 8 tokens = 12.
    "gqa2-requests-without-a-row": (Case([1, 0, 0, 1], [900, 700, 700, 45], 4, 2, 2, pad_rows=6), 8),
    # Every request in one split: stage 1 writes the outputs and the merge leaves them.
    "gqa2-equal-one-split-each": (Case([1] * 4, [640] * 4, 4, 2, 2, pad_rows=2), 8),
}


# Cases whose plan allows a request more than LAST_MERGE_SPLITS splits (gqa4: 35 tiles over 20 slots a head
# program; mqa8: 63 tiles over 16 slots): the last-split-merges config keeps the merge launch there.
MANY_SPLITS = {"gqa4-fp16-d128-many-slots", "mqa8-one-request-all-slots"}


@pytest.mark.parametrize("last_merges", [False, True], ids=["merge-launch", "last-split-merges"])
@pytest.mark.parametrize("name", list(CASES))
def test_balanced_decode_matches_reference(name, last_merges, monkeypatch):
    """Twice on the same buffers (a graph's replays): with ``last_split_merges`` the split counters must be zero
    again after each launch, or the second launch's last split never merges (its rows stay NaN). These small steps
    have fewer (token, head program)s than the GPU's bound asks for: lifted here."""
    monkeypatch.setattr(sys.modules[plan_prefix.__module__], "LAST_MERGE_PROGRAMS", 1)
    case, slots = CASES[name]
    q, key_cache, value_cache, *tables = _inputs(case, seed=5)
    sync = torch.zeros(q.shape[0] * q.shape[1], dtype=torch.int32)
    config = LAST_MERGES if last_merges else None
    want_out, want_lse = reference.prefix_attention(q.double(), key_cache.double(), value_cache.double(), *tables,
                                                    scale=case.head_dim ** -0.5, **_heads(case),
                                                    max_kv_len=max(case.kv_lens))
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    plan = _plan(case, slots, q, (key_cache, value_cache), tables, out, lse, config=config, split_sync=sync)
    assert plan.stage1.constexprs["BALANCED"] and plan.num_splits > 1, "the case does not reach the balanced path"
    merges = last_merges and name not in MANY_SPLITS
    assert plan.stage1.constexprs["LAST_MERGES"] == merges and (plan.merge is None) == merges
    for launch in range(2):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        plan(q, key_cache, value_cache, *tables, out, lse)
        assert_matches(out, want_out, case.dtype, f"{name} out, launch {launch}")
        assert_matches(lse, want_lse, case.dtype, f"{name} lse, launch {launch}")
        assert not sync.any(), "a split counter was left non-zero"


def test_last_split_merges_needs_a_counter_per_row_and_head_program(monkeypatch):
    """Counters for fewer than (tokens x head programs): the merge launch instead, never a counter out of bounds."""
    monkeypatch.setattr(sys.modules[plan_prefix.__module__], "LAST_MERGE_PROGRAMS", 1)
    case, slots = CASES["gqa2-long-among-short-padded"]
    q, key_cache, value_cache, *tables = _inputs(case, seed=5)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    short = torch.zeros(q.shape[0] * 2 - 1, dtype=torch.int32)  # 2 head programs
    plan = _plan(case, slots, q, (key_cache, value_cache), tables, out, lse, config=LAST_MERGES, split_sync=short)
    assert not plan.stage1.constexprs["LAST_MERGES"] and plan.merge is not None
    fits = _plan(case, slots, q, (key_cache, value_cache), tables, out, lse, config=LAST_MERGES,
                 split_sync=torch.zeros(q.shape[0] * 2, dtype=torch.int32))
    assert fits.stage1.constexprs["LAST_MERGES"] and fits.merge is None


def test_the_last_split_merges_only_few_splits_of_many_programs():
    """One program merging a (token, head program)'s splits one after the other is slower than a merge launch where
    a request takes many splits or the step has few (token, head program)s: the last split merges only where a
    request takes at most ``LAST_MERGE_SPLITS`` (by the plan's bound or on average over the slots) and the step
    has at least ``LAST_MERGE_PROGRAMS`` (token, head program)s. Plans only: nothing launches."""
    def plan(kv_lens, slots, **kwargs):
        case = Case([1] * len(kv_lens), kv_lens, 4, 2, 2)  # 2 head programs, 32-token tiles
        q, key_cache, value_cache, *tables = _inputs(case, seed=5)
        return _plan(case, slots, q, (key_cache, value_cache), tables, poisoned(q.shape, case.dtype),
                     poisoned(q.shape[:2], torch.float32), split_elements=1 << 21, config=LAST_MERGES, **kwargs)

    few = plan([256] * 32, 256)  # 64 programs; 8 tiles: at most 4 splits a request
    assert few.num_splits == 4 and few.stage1.constexprs["LAST_MERGES"] and few.merge is None
    assert not plan([256] * 31, 256).stage1.constexprs["LAST_MERGES"], "62 (token, head program)s"
    # A one-shot call's plan (fewer_launches) merges in the last split at any program count, within the split bound.
    one = plan([256], 256, fewer_launches=True)
    assert one.num_splits == 4 and one.stage1.constexprs["LAST_MERGES"] and one.merge is None
    assert plan([2000], 256, fewer_launches=True).merge is not None, "32 splits: the merge launch"
    # 2000 tokens: 63 tiles, up to 32 splits by the bound. The bound decides, not the average over the slots (4
    # here): one long context among short ones would take dozens of splits, merged one after the other.
    many = plan([2000] + [256] * 31, 256)
    assert many.num_splits == 32 and not many.stage1.constexprs["LAST_MERGES"] and many.merge is not None


@pytest.mark.parametrize("last_merges", [False, True], ids=["merge-launch", "last-split-merges"])
def test_balanced_decode_into_rank_major_outputs(last_merges, monkeypatch):
    monkeypatch.setattr(sys.modules[plan_prefix.__module__], "LAST_MERGE_PROGRAMS", 1)
    case = Case([1] * 4, [500, 0, 40, 9], 8, 2, 4, pad_rows=1)
    q, key_cache, value_cache, *tables = _inputs(case, seed=6)
    ranks, num_tokens = 2, q.shape[0]
    out = poisoned((ranks, num_tokens, 4, case.head_dim), torch.float32)
    lse = poisoned((ranks, num_tokens, 4), torch.float32)
    plan = _plan(case, 8, q, (key_cache, value_cache), tables, out, lse, config=LAST_MERGES if last_merges else None)
    assert plan.stage1.constexprs["BALANCED"] and plan.stage1.constexprs["LAST_MERGES"] == last_merges
    plan(q, key_cache, value_cache, *tables, out, lse)
    want_out, want_lse = reference.prefix_attention(q.double(), key_cache.double(), value_cache.double(), *tables,
                                                    scale=case.head_dim ** -0.5, **_heads(case), max_kv_len=500)
    assert_matches(out.transpose(0, 1).reshape(num_tokens, 8, -1), want_out, torch.float32, "rank-major out")
    assert_matches(lse.transpose(0, 1).reshape(num_tokens, 8), want_lse, torch.float32, "rank-major lse")


# Interpreter tiles of 32 tokens; 4 Q heads over 2 KV heads: 2 head programs. Slots 8 (small grid: 8 * 2 / 4 = 4).
# Contexts 640 / 32 / 0 / 64 / 1 are 20 / 1 / 0 / 2 / 1 tiles, 24 in all, work 24 x 2 = 48: a split's target is
# max(cdiv(48, 8), 2, min(cdiv(48, 4), 8)) = 8 tiles, so request 0 takes 20 / 8 = 2.5 -> 2 splits (halves round
# down), every other one (the empty one too, its split empty) one; at most min(64, cdiv(20, 2), cdiv(8, 2)) = 4 splits
# a request. Contexts 700 / 32 (22 / 1 tiles, work 46, target 8): 22 / 8 = 2.75 -> 3 splits.
# Four contexts of 640 tokens: work 160, target 20, one split each.
@pytest.mark.parametrize(("kv_lens", "splits_taken", "max_splits"), [
    ([640, 32, 0, 64, 1], [2, 1, 0, 1, 1], 4),
    ([700, 32], [3, 1], 4),
    ([640, 640, 640, 640], [1, 1, 1, 1], 4),
], ids=["long-among-short", "rounded-up", "equal"])
def test_each_request_takes_its_share_of_the_splits(kv_lens, splits_taken, max_splits):
    case = Case([1] * len(kv_lens), kv_lens, 4, 2, 2)
    q, key_cache, value_cache, *tables = _inputs(case, seed=7)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    plan = _plan(case, 8, q, (key_cache, value_cache), tables, out, lse)
    assert plan.num_splits == max_splits
    head_programs, rows = 2, 4 + q.shape[0]  # cdiv(slots, head programs) + tokens
    assert plan.stage1.grid == (rows * head_programs, 1, 1), "a program per (work row, head program), no more"
    plan.stage1(q, key_cache, value_cache, *tables, out, lse, None, None, plan.part_out, plan.part_lse,
                plan.split_counts, None)
    assert plan.split_counts.tolist() == [max(n, 1) for n in splits_taken], "each token's split count"
    for token, taken in enumerate(splits_taken):
        if taken > 1:  # partials of the splits it takes, nothing past them (still the poison); out left to the merge
            assert not torch.isnan(plan.part_lse[token, :, :taken]).any(), "a taken split's LSE was left unwritten"
            assert torch.isnan(plan.part_lse[token, :, taken:]).all(), "a split the request does not take was written"
            assert torch.isnan(out[token]).all()
        else:  # one split (or none): the final output, written by stage 1 alone
            assert not torch.isnan(out[token]).any() and not torch.isnan(lse[token]).any()
            assert torch.isinf(lse[token]).all() == (kv_lens[token] == 0)


def test_explicit_splits_the_opt_out_and_the_interpreter_default_keep_the_uniform_split():
    case = Case([1, 1], [300, 20], 4, 2, 2)
    q, key_cache, value_cache, *tables = _inputs(case, seed=8)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    explicit = plan_prefix(q, key_cache, value_cache, *tables, out, lse, scale=0.1, **_heads(case), max_kv_len=300,
                           max_query_len=1, num_splits=3, split_slots=8)
    assert not explicit.stage1.constexprs["BALANCED"] and explicit.num_splits == 3
    off = plan_prefix(q, key_cache, value_cache, *tables, out, lse, scale=0.1, **_heads(case), max_kv_len=300,
                      max_query_len=1, split_slots=0)
    assert not off.stage1.constexprs["BALANCED"]
    default = plan_prefix(q, key_cache, value_cache, *tables, out, lse, scale=0.1, **_heads(case), max_kv_len=300,
                          max_query_len=1)  # the interpreter: one split, as the uniform count gives there
    assert not default.stage1.constexprs["BALANCED"] and default.num_splits == 1


def test_tiny_contexts_take_the_balanced_kernel_in_one_split():
    """Contexts of at most two tiles: one split, no partials, but the same compiled kernel as every other decode
    (so serving never needs the uniform decode variant): its partial and count arguments are empty float32 / int32
    views of the split buffer, which nothing may write."""
    case = Case([1, 1, 1], [40, 0, 17], 4, 2, 2, pad_rows=2)
    q, key_cache, value_cache, *tables = _inputs(case, seed=9)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    scratch = poisoned((256,), torch.float32)
    plan = plan_prefix(q, key_cache, value_cache, *tables, out, lse, scale=case.head_dim ** -0.5, **_heads(case),
                       max_kv_len=40, max_query_len=1, split_buffer=scratch, split_slots=8)
    assert plan.stage1.constexprs["BALANCED"] and plan.num_splits == 1 and plan.merge is None
    plan(q, key_cache, value_cache, *tables, out, lse)
    assert torch.isnan(scratch).all(), "a one-split decode wrote into the split buffer"
    want_out, want_lse = reference.prefix_attention(q.double(), key_cache.double(), value_cache.double(), *tables,
                                                    scale=case.head_dim ** -0.5, **_heads(case), max_kv_len=40)
    assert_matches(out, want_out, case.dtype, "out")
    assert_matches(lse, want_lse, case.dtype, "lse")


def test_the_gpu_default_is_balanced(monkeypatch):
    monkeypatch.setattr(sys.modules[plan_prefix.__module__], "INTERPRET", False)  # the plan only: nothing launches
    case = Case([1, 1], [3000, 20], 4, 2, 2)
    q, key_cache, value_cache, *tables = _inputs(case, seed=8)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    plan = plan_prefix(q, key_cache, value_cache, *tables, out, lse, scale=0.1, **_heads(case), max_kv_len=3000,
                       max_query_len=1)
    assert plan.stage1.constexprs["BALANCED"] and plan.split_counts is not None


@pytest.mark.parametrize("last_merges", [False, True], ids=["merge-launch", "last-split-merges"])
def test_the_warm_up_runs_both_choices_of_the_last_split_merge(last_merges, monkeypatch):
    """The warm-up's steps are small (few (token, head program)s): inside ``every_variant()`` a balanced decode
    launches the other choice of ``LAST_MERGES`` first, so a serving step of either kind finds its kernel compiled;
    the answer and the counters are those of the plan's own choice."""
    monkeypatch.setattr(sys.modules[plan_prefix.__module__], "LAST_MERGE_PROGRAMS", 1 if last_merges else 10 ** 6)
    case, slots = CASES["gqa2-long-among-short-padded"]
    q, key_cache, value_cache, *tables = _inputs(case, seed=5)
    sync = torch.zeros(q.shape[0] * q.shape[1], dtype=torch.int32)
    out, lse = poisoned(q.shape, case.dtype), poisoned(q.shape[:2], torch.float32)
    with every_variant():
        plan = _plan(case, slots, q, (key_cache, value_cache), tables, out, lse, config=LAST_MERGES, split_sync=sync)
        assert plan.stage1.constexprs["LAST_MERGES"] == last_merges
        launch, extra = plan.stage1_other
        assert launch.constexprs["LAST_MERGES"] != last_merges
        calls = []
        plan.stage1_other = (lambda *args: calls.append(1) or launch(*args)), extra
        plan(q, key_cache, value_cache, *tables, out, lse)
    assert calls == [1], "the warm-up did not launch the other choice"
    plan(q, key_cache, value_cache, *tables, out, lse)
    assert calls == [1], "the other choice launched outside the warm-up"
    assert not sync.any(), "a split counter was left non-zero"
    want_out, want_lse = reference.prefix_attention(q.double(), key_cache.double(), value_cache.double(), *tables,
                                                    scale=case.head_dim ** -0.5, **_heads(case),
                                                    max_kv_len=max(case.kv_lens))
    assert_matches(out, want_out, case.dtype, "out")
    assert_matches(lse, want_lse, case.dtype, "lse")
    assert _plan(case, slots, q, (key_cache, value_cache), tables, out, lse, config=LAST_MERGES,
                 split_sync=sync).stage1_other is None, "outside the warm-up only the plan's own choice"
