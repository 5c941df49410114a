"""The public kernel functions called one at a time, as a user of the kernel library calls them, against FA3's.

Per case (``CASES``: 1 x 1K decode over 64-token pages and 1 x 1K causal prefill, 32 Q / 8 KV heads, head size 128,
bf16), each function is called ``--calls`` times back to back after a warm-up, no CUDA graph:

  call_us   wall time per call with one synchronisation after the last call: what a loop of calls costs
  host_us   time to issue one call (the loop without its final synchronisation; the GPU work of a short call hides
            behind it, so this is the host's share when it exceeds the GPU's)
  gpu_us    the same call replayed from a CUDA graph: the GPU's share
  syncs     synchronising operations one call makes (warnings naming a synchronisation while
            ``torch.cuda.set_sync_debug_mode`` warns, torch's notice about the mode itself left out; their text in
            ``sync_messages``); where the first of them happens
            (``sync_site``: the innermost frames of the call, raised as an error once; [] where nothing raised)

dcp-triton's call, repeated with tensors laid out alike as the loops repeat it, replays the plan its first call kept
(``dcp_plugin.kernels._plan_cache``): its time holds the kept plan's lookup and the replay (the argument checks run
at a layout's first call only). It is split into its phases, each timed alone the same way: the argument checks
(``checked_outputs`` for the decode: what a first call adds), the plan (``plan_prefix`` / ``plan_chunk``: launch
constants, grid, scratch) and the prepared launch's replay (what the DCP core pays per layer inside vLLM and SGLang), and that replay once more through Triton's
own dispatch (``replay_dispatch``: a prepared launch on a Triton release outside the fast launch's, which replays the
compiled kernel directly; the summary's ``fallback_host_ratio`` is its host time over the fast replay's). FA3 is
vLLM's build (``vllm.vllm_flash_attn``, ``fa_version=3``), else SGLang's (``sgl_kernel.flash_attn``), called with no
precomputed scheduler metadata, as a one-shot user calls it (the row's ``source`` says which). The summary's
``oneshot_call_ratio_max`` is dcp-triton's ``call_us`` over FA3's, worst case.
``--profile`` adds, for dcp-triton's call and each phase, the functions that take its host time (cProfile over one
loop of calls: ``top_functions``, the ``PROFILE_TOP`` first by own time, microseconds per call).

    python -m benchmarks.kernels.bench_oneshot                # a GPU with vLLM's FA3 (run_h200.sh bench after unpack)
                                                              # or SGLang's (run_h200_sglang.sh bench after install)
    python -m benchmarks.kernels.bench_oneshot --dry-run      # anywhere: the cases
Results: ``benchmarks/results/kernels_oneshot_<gpu>.json`` (``common.save``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

from benchmarks import common

CASES = {
    "decode-1x1k": dict(kind="decode", reqs=1, context=1024, q_heads=32, kv_heads=8, head_dim=128, page=64),
    "prefill-1x1k": dict(kind="prefill", reqs=1, context=1024, q_heads=32, kv_heads=8, head_dim=128, page=64),
}
WARMUP_CALLS = 20
PROFILE_TOP = 15


def inputs(case: dict, device: str = "cuda", dtype=None):
    """The case's tensors (bf16 unless ``dtype``): decode, one query row per request over ``context`` cached tokens
    in pages of ``page``; prefill, ``context`` new rows per request (the current chunk)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    bf16, reqs, hq, hk, d = dtype or torch.bfloat16, case["reqs"], case["q_heads"], case["kv_heads"], case["head_dim"]
    if case["kind"] == "decode":
        pages = -(-case["context"] // case["page"])
        kc, vc = (torch.randn(reqs * pages, case["page"], hk, d, device=device, dtype=bf16, generator=g)
                  for _ in range(2))
        return dict(q=torch.randn(reqs, hq, d, device=device, dtype=bf16, generator=g), key_cache=kc, value_cache=vc,
                    block_table=torch.arange(reqs * pages, device=device, dtype=torch.int32).view(reqs, pages),
                    kv_lens=torch.full((reqs,), case["context"], device=device, dtype=torch.int32),
                    query_start_loc=torch.arange(reqs + 1, device=device, dtype=torch.int32))
    rows = reqs * case["context"]
    q, k, v = (torch.randn(rows, h, d, device=device, dtype=bf16, generator=g) for h in (hq, hk, hk))
    return dict(q=q, k=k, v=v, query_start_loc=torch.arange(0, rows + 1, case["context"], device=device,
                                                            dtype=torch.int32))


def through_dispatch(launch, *args) -> None:
    """``launch(*args)`` as on a Triton outside the fast launch's releases: through Triton's dispatch (a launch that
    never replayed directly keeps dispatching while ``FAST_LAUNCH`` is off)."""
    from dcp_plugin.kernels import _launch

    fast, _launch.FAST_LAUNCH = _launch.FAST_LAUNCH, False
    try:
        launch(*args)
    finally:
        _launch.FAST_LAUNCH = fast


def ours(case: dict, t: dict) -> dict:
    """dcp-triton's public call and its phases, each ``fn()``; ``"planned"``: the ``(out, lse)`` the prepared launches
    (``"replay"``, ``"replay_dispatch"``) write."""
    from dcp_plugin.kernels import chunk_attention, prefix_attention, plan_chunk, plan_prefix
    from dcp_plugin.kernels.prefix_attention import checked_outputs

    heads = dict(q_head_start=0, q_per_kv=case["q_heads"] // case["kv_heads"], kv_head_start=0)
    scale = case["head_dim"] ** -0.5
    if case["kind"] == "decode":
        paged = (t["q"], t["key_cache"], t["value_cache"], t["block_table"], t["kv_lens"], t["query_start_loc"])
        hints = dict(max_kv_len=case["context"], max_query_len=1)
        out, lse = checked_outputs(*paged, scale=scale, **heads, **hints, num_splits=None, out=None, lse=None,
                                   k_scale=None, v_scale=None)
        launch = plan_prefix(*paged, out, lse, scale=scale, **heads, **hints)
        dispatched = plan_prefix(*paged, out, lse, scale=scale, **heads, **hints)
        return {"call": lambda: prefix_attention(*paged, scale=scale, **heads, **hints),
                "checks": lambda: checked_outputs(*paged, scale=scale, **heads, **hints, num_splits=None, out=None,
                                                  lse=None, k_scale=None, v_scale=None),
                "plan": lambda: plan_prefix(*paged, out, lse, scale=scale, **heads, **hints),
                "replay": lambda: launch(*paged, out, lse, None, None),
                "replay_dispatch": lambda: through_dispatch(dispatched, *paged, out, lse, None, None),
                "planned": (out, lse)}
    q, k, v, qsl, n = t["q"], t["k"], t["v"], t["query_start_loc"], case["context"]
    out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=__import__("torch").float32)
    launch = plan_chunk(q, k, v, out, lse, qsl, n, scale=scale, **heads)
    dispatched = plan_chunk(q, k, v, out, lse, qsl, n, scale=scale, **heads)
    return {"call": lambda: chunk_attention(q, k, v, qsl, n, scale=scale, **heads),
            "plan": lambda: plan_chunk(q, k, v, out, lse, qsl, n, scale=scale, **heads),
            "replay": lambda: launch(q, k, v, out, lse, qsl),
            "replay_dispatch": lambda: through_dispatch(dispatched, q, k, v, out, lse, qsl), "planned": (out, lse)}


def fa3_call(case: dict, t: dict):
    """``(source, call)``: FA3's function as a one-shot user calls it (no scheduler metadata computed ahead), from
    vLLM's build (``vllm.vllm_flash_attn``) or else SGLang's (``sgl_kernel.flash_attn``, the same FA3); None
    without either."""
    scale, n = case["head_dim"] ** -0.5, case["context"]
    decode = case["kind"] == "decode"
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except Exception:  # noqa: BLE001 - no vLLM FA3 build here: SGLang's, if any
        return sglang_fa3_call(case, t)
    if not is_fa_version_supported(3):
        return None
    if decode:
        lens, qsl = t["kv_lens"], t["query_start_loc"]
        return "vllm.vllm_flash_attn", lambda: flash_attn_varlen_func(
            t["q"], t["key_cache"], t["value_cache"], max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=n, seqused_k=lens,
            softmax_scale=scale, causal=True, block_table=t["block_table"], return_softmax_lse=True, fa_version=3)
    qsl = t["query_start_loc"]
    return "vllm.vllm_flash_attn", lambda: flash_attn_varlen_func(
        t["q"], t["k"], t["v"], max_seqlen_q=n, cu_seqlens_q=qsl, max_seqlen_k=n, cu_seqlens_k=qsl,
        softmax_scale=scale, causal=True, return_softmax_lse=True, fa_version=3)


def sglang_fa3_call(case: dict, t: dict):
    """SGLang's FA3 (``sgl_kernel.flash_attn``) called as SGLang's ``fa3`` backend calls it, or None without it."""
    try:
        from sgl_kernel.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache, is_fa3_supported
    except Exception:  # noqa: BLE001 - no SGLang FA3 build here: the peer is absent, not an error
        return None
    if not is_fa3_supported():
        return None
    scale, n = case["head_dim"] ** -0.5, case["context"]
    if case["kind"] == "decode":
        return "sgl_kernel.flash_attn", lambda: flash_attn_with_kvcache(
            t["q"], t["key_cache"], t["value_cache"], cache_seqlens=t["kv_lens"], page_table=t["block_table"],
            cu_seqlens_q=t["query_start_loc"], max_seqlen_q=1, softmax_scale=scale, causal=True,
            return_softmax_lse=True)
    qsl = t["query_start_loc"]
    return "sgl_kernel.flash_attn", lambda: flash_attn_varlen_func(
        t["q"], t["k"], t["v"], cu_seqlens_q=qsl, cu_seqlens_k=qsl, max_seqlen_q=n, max_seqlen_k=n,
        softmax_scale=scale, causal=True, return_softmax_lse=True)


def timed(fn, calls: int, *, profile: bool = False) -> dict:
    """``call_us``, ``host_us`` (medians of 5 loops of ``calls``), ``gpu_us`` (one call in a CUDA graph, replayed),
    ``syncs`` (synchronising operations of one call), their warnings (``sync_messages``) and ``sync_site`` (where the
    first happens: [] where torch's sync-debug mode raised nothing, so the warning was not its); with ``profile``
    the call's top functions by host time (``top_functions``)."""
    import torch

    for _ in range(WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    loops, issue = [], []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        issue.append((time.perf_counter() - began) / calls)
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - began) / calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    messages = sync_warnings(f"{w.category.__name__}: {w.message}" for w in caught)
    result = dict(call_us=statistics.median(loops) * 1e6, host_us=statistics.median(issue) * 1e6,
                  syncs=len(messages))
    if messages:  # what was counted: torch's sync-debug warning, or another naming a synchronisation
        result["sync_messages"] = sorted(set(messages))
        result["sync_site"] = sync_site(fn)
    if profile:
        result["top_functions"] = top_functions(fn, calls)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        result["gpu_us"] = common.replay_ms(graph, 1) * 1e3
    except Exception as error:  # noqa: BLE001 - a call that cannot be captured still has its wall times
        result["gpu_us"] = None
        result["graph_error"] = f"{type(error).__name__}: {error}"[:200]
    return result


# What torch says once per process the first time its sync-debug mode is set: a notice, not a synchronisation.
SYNC_MODE_NOTICE = "synchronization debug mode is a prototype feature"


def sync_warnings(messages) -> list[str]:
    """The warnings (``Category: text``) that name a synchronisation, torch's notice about the mode itself left out."""
    return [m[:200] for m in messages if "synchroniz" in m.lower() and SYNC_MODE_NOTICE not in m.lower()]


def sync_site(fn) -> list[str]:
    """The innermost frames (``file:line function``) of ``fn``'s first synchronising operation, or [] if none."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)
        return [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in frames[-6:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return []


def top_functions(fn, calls: int) -> list[dict]:
    """cProfile over ``calls`` calls of ``fn``: the ``PROFILE_TOP`` functions by own time, microseconds per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (prim calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:PROFILE_TOP]
    return [dict(function=f"{'/'.join(Path(file).parts[-2:])}:{line} {name}", own_us=round(own / calls * 1e6, 2),
                 cum_us=round(cum / calls * 1e6, 2), calls=round(n / calls, 2))
            for (file, line, name), (_, n, own, cum, _) in rows]


def summarise(rows: dict[str, dict]) -> dict:
    """Per case dcp-triton's ``call_us`` over FA3's; the worst is ``oneshot_call_ratio_max`` (None without FA3). Per
    case the prepared launch's host time through Triton's dispatch over the fast replay's (``fallback_host_ratio``)."""
    ratios = {name: round(row["dcp-triton"]["call_us"] / row["fa3"]["call_us"], 2) for name, row in rows.items()
              if "call_us" in (row.get("fa3") or {})}
    fallback = {name: round(phases["replay_dispatch"]["host_us"] / phases["replay"]["host_us"], 2)
                for name, row in rows.items() if "replay_dispatch" in (phases := row.get("dcp-triton phases") or {})}
    return dict(call_ratio=ratios, oneshot_call_ratio_max=max(ratios.values()) if ratios else None,
                fallback_host_ratio=fallback)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop (default 200)")
    parser.add_argument("--only", default=",".join(CASES), help=f"cases, comma-separated (of {', '.join(CASES)})")
    parser.add_argument("--dry-run", action="store_true", help="print the cases; time nothing")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each dcp-triton phase's host time (cProfile; top functions)")
    args = parser.parse_args()
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CASES]
    if unknown or args.calls < 1:
        parser.error(f"--only {unknown[0]!r}: no such case; cases: {', '.join(CASES)}" if unknown
                     else f"--calls must be >= 1, got {args.calls}")
    if args.dry_run:
        print(json.dumps({name: CASES[name] for name in chosen}, indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_oneshot.py times GPU calls: no CUDA GPU here (--dry-run prints the cases)")
    rows = {}
    for name in chosen:
        case, tensors = CASES[name], inputs(CASES[name])
        row = {"dcp-triton": timed(ours(case, tensors)["call"], args.calls, profile=args.profile),
               "dcp-triton phases": {phase: timed(fn, args.calls, profile=args.profile)
                                     for phase, fn in ours(case, tensors).items() if phase not in ("call", "planned")}}
        peer = fa3_call(case, tensors)
        try:
            row["fa3"] = None if peer is None else dict(timed(peer[1], args.calls), source=peer[0])
        except Exception as error:  # noqa: BLE001 - a peer that fails is reported, dcp-triton's rows kept
            row["fa3"] = dict(source=peer[0], error=f"{type(error).__name__}: {error}"[:300])
        rows[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    summary = dict(summarise(rows), gpu=common.gpu_name())
    path = common.save(f"kernels_oneshot_{common.gpu_tag()}", dict(summary=summary, cases={n: CASES[n] for n in rows},
                                                                    rows=rows, calls=args.calls))
    print(json.dumps(summary, indent=1))
    print(f"wrote {common.repo_relative(path)}")


if __name__ == "__main__":
    main()
