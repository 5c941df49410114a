"""The merge of a request's KV splits (``split_kv``): both GPU variants (narrow: up to 8 splits a program step merged
one after the other, 4 heads a program; wide: 64 splits a step summed as one tensor, one head) against a float64
merge, any split count, empty splits, a NaN split, masked heads and dims, a rank-major output; which variant a split
count picks; and the warm-up running both."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import _launch, split_kv
from dcp_plugin.kernels.split_kv import NARROW_SPLITS, PrefixLaunch, merge_tiling, plan_split_merge
from tests.helpers.kernel_checks import assert_matches, poisoned


def merged_f64(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, S, D]`` / ``[T, H, S]`` partials -> ``[T, H, D]`` / ``[T, H]``: softmax weights of the LSEs; a
    (token, head) with every split empty is (0, -inf)."""
    lse = torch.logsumexp(part_lse.double(), dim=-1)
    weights = torch.exp(part_lse.double() - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * part_out.double()).sum(2), lse


def partials(tokens: int, heads: int, splits: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    part_out = torch.randn(tokens, heads, splits, head_dim, generator=gen)
    part_lse = torch.randn(tokens, heads, splits, generator=gen) * 4
    part_lse[0, 0, 1::3] = float("-inf")  # empty splits (a request shorter than the split count): O is 0
    part_out[0, 0, 1::3] = 0.0
    part_lse[-1, -1] = float("-inf")  # a (token, head) whose every split is empty
    part_out[-1, -1] = 0.0
    return part_out, part_lse


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])
@pytest.mark.parametrize("splits", [2, 5, 8, 9, 19, 70])  # 70: past the wide variant's 64 a step
def test_both_variants_merge_any_split_count_like_float64(narrow, splits):
    tokens, heads, head_dim = 3, 5, 80  # 5 heads: the narrow variant's second program holds one; 80 of 128 dims
    part_out, part_lse = partials(tokens, heads, splits, head_dim, seed=splits)
    out, lse = poisoned((tokens, heads, head_dim), torch.float32), poisoned((tokens, heads), torch.float32)
    plan_split_merge(part_out, part_lse, out, lse, narrow=narrow)(part_out, part_lse, out, lse, None)
    want_out, want_lse = merged_f64(part_out, part_lse)
    assert_matches(out, want_out, torch.float32, f"merged out, {splits} splits")
    assert_matches(lse, want_lse, torch.float32, f"merged lse, {splits} splits")
    assert torch.equal(out[-1, -1], torch.zeros(head_dim)) and lse[-1, -1] == float("-inf")


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])
def test_counted_merge_reads_each_tokens_own_splits_and_leaves_one_split_tokens(narrow):
    """A balanced decode's merge: token t merges its first counts[t] splits (the rest poison, never read); a token
    of one split already holds its output (stage 1 wrote it), which the merge must leave as it is."""
    tokens, heads, splits, head_dim = 4, 5, 70, 64
    part_out, part_lse = partials(tokens, heads, splits, head_dim, seed=11)
    counts = torch.tensor([3, 1, 70, 9], dtype=torch.int32)
    for t, n in enumerate(counts.tolist()):
        part_out[t, :, n:], part_lse[t, :, n:] = float("nan"), float("nan")
    out, lse = poisoned((tokens, heads, head_dim), torch.float32), poisoned((tokens, heads), torch.float32)
    out[1], lse[1] = 7.0, 3.0  # the one-split token's final output
    plan_split_merge(part_out, part_lse, out, lse, narrow=narrow, counted=True)(part_out, part_lse, out, lse, counts)
    for t, n in enumerate(counts.tolist()):
        if n == 1:
            assert (out[t] == 7.0).all() and (lse[t] == 3.0).all(), "the merge rewrote a one-split token"
            continue
        want_out, want_lse = merged_f64(part_out[t:t + 1, :, :n], part_lse[t:t + 1, :, :n])
        assert_matches(out[t:t + 1], want_out, torch.float32, f"token {t}, {n} splits: out")
        assert_matches(lse[t:t + 1], want_lse, torch.float32, f"token {t}, {n} splits: lse")


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])
def test_a_nan_split_makes_its_token_and_head_nan_and_no_other(narrow):
    part_out, part_lse = partials(2, 5, 6, 64, seed=3)
    part_lse[1, 2, 4] = float("nan")  # one split of token 1, head 2 (the narrow variant's second program holds it)
    out, lse = poisoned((2, 5, 64), torch.float32), poisoned((2, 5), torch.float32)
    plan_split_merge(part_out, part_lse, out, lse, narrow=narrow)(part_out, part_lse, out, lse, None)
    assert torch.isnan(out[1, 2]).all() and torch.isnan(lse[1, 2])
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 2] = False
    want_out, want_lse = merged_f64(part_out, part_lse)
    assert_matches(out[keep], want_out[keep], torch.float32, "the other (token, head)s' out")
    assert_matches(lse[keep], want_lse[keep], torch.float32, "the other (token, head)s' lse")


@pytest.mark.parametrize("heads", [8, 6], ids=["4-per-rank", "3-per-rank"])  # 3: a 4-head program crosses ranks
@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])
def test_both_variants_write_a_rank_major_output(narrow, heads):
    tokens, ranks, head_dim = 2, 2, 64
    part_out, part_lse = partials(tokens, heads, 3, head_dim, seed=1)
    out = poisoned((ranks, tokens, heads // ranks, head_dim), torch.float16)
    lse = poisoned((ranks, tokens, heads // ranks), torch.float32)
    plan_split_merge(part_out, part_lse, out, lse, narrow=narrow)(part_out, part_lse, out, lse, None)
    want_out, want_lse = merged_f64(part_out, part_lse)
    plain = out.permute(1, 0, 2, 3).reshape(tokens, heads, head_dim)  # global head h at [h // (H / R), t, h % ...]
    assert_matches(plain, want_out, torch.float16, "rank-major out")
    assert_matches(lse.permute(1, 0, 2).reshape(tokens, heads), want_lse, torch.float32, "rank-major lse")


def test_a_gpu_merges_up_to_8_splits_narrow_and_more_wide(monkeypatch):
    monkeypatch.setattr(split_kv, "INTERPRET", False)
    assert [merge_tiling(s, 32)[1] for s in (2, NARROW_SPLITS, NARROW_SPLITS + 1, 64)] == [8, 8, 64, 64]
    assert merge_tiling(2, 32) == (4, 8, True) and merge_tiling(2, 2) == (2, 8, True)  # never more heads than exist
    assert merge_tiling(40, 32) == (1, 64, False)
    monkeypatch.setattr(split_kv, "INTERPRET", True)
    assert merge_tiling(2, 6) == (8, 8, False)  # the interpreter: every head of a token in one program


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *tensors) -> None:
        self.calls.append(self.name)


def test_the_other_merge_variant_runs_only_inside_every_variant():
    calls: list = []
    plan = PrefixLaunch(Recorder("stage1", calls), Recorder("merge", calls), None, None, 2,
                        merge_other=Recorder("other", calls))
    args = (None,) * 8
    plan(*args)
    assert calls == ["stage1", "merge"]
    calls.clear()
    with _launch.every_variant():
        assert _launch.every_variant_wanted()
        plan(*args)
    assert calls == ["stage1", "other", "merge"]  # the real merge runs last: its output is the one kept
    assert not _launch.every_variant_wanted()


def test_the_warm_up_runs_its_steps_inside_every_variant(monkeypatch):
    from dcp_plugin import warmup

    seen = []
    monkeypatch.setattr(warmup, "_run_steps", lambda *a, **k: seen.append(_launch.every_variant_wanted()) or 1)
    monkeypatch.setattr(warmup, "DcpBatchBuffers", lambda *a: None)
    monkeypatch.setattr(warmup, "steps_for", lambda attention, trees, **_: warmup.STEPS)
    t = torch.zeros(2, 2, 4)
    warmup.warm_up(None, query=t, key=t, value=t, key_cache=t, value_cache=t, output=t)
    assert seen == [True]


def test_the_warm_up_line_counts_triton_builds_and_cache_hits(monkeypatch):
    import types

    import triton

    from dcp_plugin import warmup

    outer = []

    def outer_listener(**kw):
        outer.append(kw["cache_hit"])

    monkeypatch.setattr(triton.knobs.compilation, "listener", outer_listener)

    def fake_warm_up(attention, **tensors):  # what Triton's compiler tells its listener: two builds, one cache hit
        for hit, micros in ((False, 2_000_000), (True, 0), (False, 500_000)):
            triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={},
                                              times=types.SimpleNamespace(total=micros), cache_hit=hit)
        return 10

    monkeypatch.setattr(warmup, "warm_up", fake_warm_up)
    line = warmup.timed_warm_up(None, dcp_size=2, query=torch.zeros(1, dtype=torch.float16))
    assert line.startswith("dcp-triton: compiled the kernels of 10 step kinds before serving in ")
    assert line.endswith("(dcp_size=2, torch.float16; 2 kernel variants built in 2.5 s, 1 from Triton's cache)")
    assert outer == [False, True, False]  # a listener already set still hears every compile
    assert triton.knobs.compilation.listener is outer_listener  # and is back in place afterwards
