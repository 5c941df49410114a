"""The CPU-checkable parts of benchmarks/kernels/bench_oneshot.py: its cases' inputs and dcp-triton's call and
phases (here under Triton's interpreter, float32) against the torch reference kernels, and the summary's ratio."""

from __future__ import annotations


import torch

from benchmarks.kernels import bench_oneshot as bench
from dcp_plugin.kernels import reference
from tests.helpers.kernel_checks import assert_matches

SMALL = dict(reqs=2, context=40, q_heads=4, kv_heads=1, head_dim=64, page=16)


def test_the_call_and_the_prepared_launch_give_the_reference_kernels_answer():
    """Both kinds: the one-shot call returns what the torch reference kernel computes from the same inputs, and the
    phases' prepared launch (``replay``) writes the same into the outputs it was planned with."""
    for kind in ("decode", "prefill"):
        case = dict(SMALL, kind=kind)
        t = bench.inputs(case, device="cpu", dtype=torch.float32)
        fns = bench.ours(case, t)
        assert set(fns) == {"call", "plan", "replay", "replay_dispatch", "planned"} | (
            {"checks"} if kind == "decode" else set())
        heads = dict(scale=case["head_dim"] ** -0.5, q_head_start=0, q_per_kv=case["q_heads"] // case["kv_heads"],
                     kv_head_start=0)
        if kind == "decode":
            want = reference.prefix_attention(t["q"], t["key_cache"], t["value_cache"], t["block_table"],
                                              t["kv_lens"], t["query_start_loc"], max_kv_len=case["context"],
                                              max_query_len=1, **heads)
        else:
            want = reference.chunk_attention(t["q"], t["k"], t["v"], t["query_start_loc"], case["context"], **heads)
        got = fns["call"]()
        planned = fns["planned"]
        for replay in ("replay", "replay_dispatch"):
            for tensor in planned:
                tensor.fill_(float("nan"))
            fns[replay]()
            for name, ours, prepared, ref in zip(("out", "lse"), got, planned, want):
                assert_matches(ours, ref.double(), torch.float32, f"{kind} {name}")
                assert torch.equal(prepared, ours), f"{kind} {name}: {replay} wrote something else"


def test_the_summary_takes_the_worst_case_against_fa3():
    rows = {"decode": {"dcp-triton": {"call_us": 30.0}, "fa3": {"call_us": 20.0}},
            "prefill": {"dcp-triton": {"call_us": 50.0}, "fa3": {"call_us": 40.0}},
            "other": {"dcp-triton": {"call_us": 9.0}, "fa3": None},
            "failed": {"dcp-triton": {"call_us": 9.0}, "fa3": {"source": "x", "error": "RuntimeError: no"}}}
    rows["decode"]["dcp-triton phases"] = {"replay": {"host_us": 4.0}, "replay_dispatch": {"host_us": 10.0}}
    assert bench.summarise(rows) == {"call_ratio": {"decode": 1.5, "prefill": 1.25}, "oneshot_call_ratio_max": 1.5,
                                     "fallback_host_ratio": {"decode": 2.5}}
    assert bench.summarise({"x": {"dcp-triton": {"call_us": 1.0}, "fa3": None}})["oneshot_call_ratio_max"] is None


def test_the_dispatch_replay_leaves_the_fast_launch_as_it_was():
    from dcp_plugin.kernels import _launch

    calls = []
    before = _launch.FAST_LAUNCH
    bench.through_dispatch(lambda *args: calls.append((_launch.FAST_LAUNCH, args)), 1, 2)
    assert calls == [(False, (1, 2))] and _launch.FAST_LAUNCH is before


def _busy(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_the_profile_names_the_function_that_takes_the_time():
    """``--profile``'s table: per call, the function that does the work comes first with its call count; a
    function called twice a call counts 2."""
    top = bench.top_functions(lambda: (_busy(20000), _busy(10)), calls=5)
    first = next(row for row in top if row["function"].endswith(" _busy"))
    assert top[0] is first and first["calls"] == 2 and first["own_us"] > 0
    assert first["cum_us"] >= first["own_us"]
    assert first["function"].startswith("unit/test_bench_oneshot.py:")


def test_torchs_notice_about_its_sync_debug_mode_is_not_counted_as_a_synchronisation():
    """torch warns once per process that its sync-debug mode is a prototype; at 556b8f3 that notice was the decode's
    one counted "synchronisation" (the first case timed). A warning torch gives for a synchronising call counts."""
    notice = ("UserWarning: Synchronization debug mode is a prototype feature and does not yet detect all "
              "synchronizing operations (Triggered internally at Module.cpp:1003.)")
    sync = "UserWarning: called a synchronizing CUDA operation (Triggered internally at Module.cpp:1000.)"
    assert bench.sync_warnings([notice, "UserWarning: something else"]) == []
    assert bench.sync_warnings([notice, sync]) == [sync]

