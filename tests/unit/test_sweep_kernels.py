"""The tuning sweep's candidate parsing and grouping (``benchmarks/kernels/sweep_kernels.py``; the sweeps time on a
GPU only)."""

from __future__ import annotations

import json
import os

from benchmarks.kernels import sweep_kernels
from dcp_plugin.kernels.prefix_attention import PrefixConfig, pick_config


def test_a_prefix_candidate_names_every_field_it_gives():
    assert sweep_kernels.prefix_config(None) is None
    assert sweep_kernels.prefix_config((64, 256, 8, 2)) == PrefixConfig(block_n=64, block_m=256, num_warps=8,
                                                                         num_stages=2)
    assert sweep_kernels.prefix_config((64, 128, 4, 2, 1, 1, 2)) == PrefixConfig(
        block_n=64, block_m=128, num_warps=4, num_stages=2, tma=True, rows_ahead=True, fp8_widen=2)
    dot = sweep_kernels.prefix_config((64, 128, 4, 2, 1, 0, 1, 1))
    assert (dot.tma, dot.rows_ahead, dot.fp8_widen, dot.fp8_dot) == (True, False, 1, 1)


def test_fp8_prefix_rows_are_judged_against_their_own_cache_dtype():
    """The bf16 row of a shape is its own group's default: an fp8 candidate's gain is read against the fp8 default."""
    shape = [8, 2048, 32768, 32, 8]
    rows = [dict(shape=shape, fp8=False, config=None, tflops=500.0),
            dict(shape=shape, fp8=True, config=None, tflops=300.0),
            dict(shape=shape, fp8=True, config=[64, 128, 4, 2, 1, 1, 1], tflops=360.0)]
    groups = sweep_kernels.best(rows, "tflops", lambda r: [*r["shape"], r["fp8"]])
    fp8 = groups[json.dumps([*shape, True])]
    assert fp8["default"] == 300.0 and fp8["best"]["config"] == [64, 128, 4, 2, 1, 1, 1]
    assert groups[json.dumps([*shape, False])]["default"] == 500.0
    for consts in sweep_kernels.FP8_PREFIX_CONFIGS:  # each candidate passes the kernels' own validation
        config = sweep_kernels.prefix_config(consts)
        assert pick_config(128, decode=False, config=config) is config


def test_the_fp8_prefill_setting_holds_within_and_is_restored(monkeypatch):
    from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV, fp8_copy_asked

    monkeypatch.delenv(FP8_PREFILL_ENV, raising=False)
    with sweep_kernels.fp8_prefill_setting(sweep_kernels.FP8_COPY):
        assert fp8_copy_asked()
    assert FP8_PREFILL_ENV not in os.environ
    monkeypatch.setenv(FP8_PREFILL_ENV, "copy")
    with sweep_kernels.fp8_prefill_setting("tiles"):
        assert not fp8_copy_asked()
    assert fp8_copy_asked()
