"""Kernel benchmarks on one GPU, peers measured side by side in the same run (benchmarks/kernels/kernel_peers.py).

- decode: ``prefix_attention``, one query token per request, in % of the device copy bandwidth (KV bytes read),
  launch included (``triton.testing.do_bench``, L2 flushed, median) and under CUDA-graph replay (L2-cold copies),
  against FlashAttention-3 and vLLM's Triton unified and split-KV kernels (all over 16-token pages; dcp-triton
  also over the same memory as 64-token pages); ``decode_fp8``: the same over an fp8 cache, against bf16, over
  16- and 64-token pages (tuning sweeps: ``sweep_kernels.py``).
- prefix: the DCP prefix pass (many query rows against a long paged cache, non-causal) in TFLOP/s against FA3,
  with 16- and 64-token pages.
- prefill: causal current-chunk ``chunk_attention`` in TFLOP/s (CUDA-graph replay, so no one's host time counts)
  against FA3 and torch's SDPA, head size 128 and 64, 32 Q heads over 8 and 1 KV heads.
- merge: ``merge_states`` in % of copy bandwidth against vLLM's ``merge_attn_states``.

Every dcp-triton output is compared with float64 attention (prefill: with SDPA); a relative error above
ERROR_BOUND (or NaN) makes the run exit 1 after saving. Peers are measured when vLLM imports (on a machine without
vLLM, unpack its wheel's Python files and compiled extensions and put them on PYTHONPATH, as run_h200.sh does).

    python -m benchmarks.kernels.bench_kernels [--quick] [--only decode,prefix,...] [--name STEM]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

from benchmarks.common import (cold_copies, copy_bandwidth_gbs, gpu_name, gpu_tag, graph_ms, median_ms, repo_relative,
                               save)
from benchmarks.kernels import kernel_peers
from dcp_plugin.kernels import chunk_attention, merge_states, prefix_attention
from dcp_plugin.kernels import reference
from dcp_plugin.kernels.chunk_attention import plan_chunk
from dcp_plugin.kernels.prefix_attention import plan_prefix

DTYPE, HEAD_DIM, PAGE = torch.bfloat16, 128, 16
ERROR_BOUND = 1e-2  # relative (Frobenius) error of a bf16 output: ~2e-3 is rounding, a wrong answer is ~1


def _prefix_setup(batch: int, ctx: int, hq: int, hk: int, gen: torch.Generator, *, q_rows: int = 1,
                  page: int = PAGE, head_dim: int = HEAD_DIM):
    """Paged inputs with enough disjoint KV sets (block tables over disjoint pages of one pool) that graph
    replays cycling through them run L2-cold, in vLLM's FLASH_ATTN layout (K and V caches of ``[pages, page, Hk,
    D]``): ``(kv_bytes, copies, q, key_cache, value_cache, tables, lens, qsl)``; ``q_rows`` query rows per request."""
    kv_bytes = batch * ctx * hk * head_dim * 2 * DTYPE.itemsize
    copies = cold_copies(kv_bytes)
    pages_per_req = math.ceil(ctx / page)
    num_pages = pages_per_req * batch * copies
    key_cache, value_cache = torch.randn(2, num_pages, page, hk, head_dim, dtype=DTYPE, device="cuda", generator=gen)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(copies, batch, pages_per_req)
    q = torch.randn(batch * q_rows, hq, head_dim, dtype=DTYPE, device="cuda", generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, batch * q_rows + 1, q_rows, dtype=torch.int32, device="cuda")
    return kv_bytes, copies, q, key_cache, value_cache, tables, lens, qsl


def _as_pages(kc, vc, tables, page: int, gen: torch.Generator):
    """The same cache memory read as ``page``-token pages, with block tables over disjoint pages again (the contents
    are random either way): ``(key_cache, value_cache, tables)``."""
    copies, batch, per_req = tables.shape
    ratio = page // kc.shape[1]
    assert page % kc.shape[1] == 0 and per_req % ratio == 0, (page, kc.shape, per_req)
    num = kc.shape[0] // ratio
    kc, vc = (c[: num * ratio].view(num, page, *c.shape[2:]) for c in (kc, vc))
    perm = torch.randperm(num, device=kc.device, generator=gen).to(torch.int32)
    return kc, vc, perm.view(copies, batch, per_req // ratio)


def _prefix_error(out, q, kc, vc, tables, lens, qsl, *, rows: int, k_scale=None, v_scale=None,
                  q_limit: int = 1 << 30) -> float:
    """Relative error of ``out`` on the first ``rows`` requests (at most ``q_limit`` query rows) against float64
    attention over their pages (dequantized when the cache is fp8); NaN in ``out`` gives NaN."""
    n = min(lens.shape[0], rows)
    pages = tables[0, :n].flatten().long()  # only the checked requests' pages, in float64
    sub_table = torch.arange(pages.numel(), dtype=torch.int32, device="cuda").view(n, -1)
    kd, vd = (cache.view(torch.uint8)[pages].view(cache.dtype).double() * (1.0 if s is None else s.item())
              for cache, s in ((kc, k_scale), (vc, v_scale)))  # bytes gathered: fp8 tensors index poorly
    end = min(int(qsl[n]), q_limit)
    ref, _ = reference.prefix_attention(q[:end].double(), kd, vd, sub_table, lens[:n], qsl[: n + 1].clamp(max=end),
                                        scale=q.shape[-1] ** -0.5, q_head_start=0, q_per_kv=q.shape[1] // kc.shape[2],
                                        kv_head_start=0, max_kv_len=int(lens.max()))
    return ((out[:end].double() - ref).norm() / ref.norm()).item()


def _time_peers(row: dict, fns: dict, copies: int, *, graph: bool = True) -> None:
    """``row[name_ms]`` (launch included, L2 flushed) and ``row[name_graph_ms]`` (graph replay over the cold copies) for
    each ``name: fn(i)``; a peer that fails records its error instead. The first one's graph replay is timed once more
    first and dropped: a shape's first graph timing read up to 22% slow at four of 43 decode shapes
    (``probes/gluon_decode_probe.py``, ``kernels_h200_gluon_decode.json`` ``runs[3]``: one launch timed twice in a
    row)."""
    first = next(iter(fns.values()), None)
    if graph and first is not None:
        try:
            row["dropped_first_graph_ms"] = graph_ms([lambda i=i: first(i) for i in range(copies)])
        except Exception as err:  # the timing below records it
            row["dropped_first_error"] = repr(err)[:300]
    for name, fn in fns.items():
        try:
            row[f"{name}_ms"] = median_ms(fn)
            if graph:
                row[f"{name}_graph_ms"] = graph_ms([lambda i=i, fn=fn: fn(i) for i in range(copies)])
        except Exception as err:  # a peer failing must not lose our numbers
            row[f"{name}_error"] = repr(err)[:300]


def bench_decode(shapes, copy_gbs: float) -> list[dict]:
    """Decode over ``(batch, ctx, q_heads, kv_heads[, head_dim])`` (head size ``HEAD_DIM`` unless given)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes:
        batch, ctx, hq, hk, d = (*shape, HEAD_DIM)[:5]
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen, head_dim=d)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        kwargs = dict(scale=d ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx,
                      max_query_len=1)
        # "ours": as the DCP core runs it, planned once per step shape and launched by every layer of the step;
        # "ours_api": the public function, which checks its arguments and plans on every call; "ours_p64": the
        # same memory read as 64-token pages (the cache dcp-triton asks vLLM for).
        launch = plan_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, **kwargs)
        kc64, vc64, tables64 = _as_pages(kc, vc, tables, 64, gen)
        launch64 = plan_prefix(q, kc64, vc64, tables64[0], lens, qsl, out, lse, **kwargs)

        def ours(i=0):
            launch(q, kc, vc, tables[i], lens, qsl, out, lse)

        def ours_p64(i=0):
            launch64(q, kc64, vc64, tables64[i], lens, qsl, out, lse)

        row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, head_dim=d, kv_bytes=kv_bytes)
        for key, fn, caches in (("rel_err_p64", ours_p64, (kc64, vc64, tables64)), ("rel_err", ours, (kc, vc, tables))):
            out.fill_(float("nan"))
            fn()  # correct first: a slice of the batch against the float64 reference
            row[key] = _prefix_error(out, q, *caches, lens, qsl, rows=2)
        _time_peers(row, {"ours_api": lambda i=0: prefix_attention(q, kc, vc, tables[i], lens, qsl, out=out,
                                                                   lse=lse, **kwargs)}, copies, graph=False)
        peers = {"ours": ours, "ours_p64": ours_p64, **kernel_peers.vllm_triton_decode(q, kc, vc, tables, lens, qsl, ctx),
                 **kernel_peers.fa3_paged(q, kc, vc, tables, lens, qsl, max_query_len=1, max_kv_len=ctx,
                                          causal=True)}
        _time_peers(row, peers, copies)
        for key in [k for k in row if k.endswith("_ms")]:
            row[key.replace("_ms", "_pct_copy")] = 100 * kv_bytes / row[key] / 1e6 / copy_gbs
        rows.append(row)
        print(f"decode b={batch:4d} ctx={ctx:6d} {hq}/{hk} D{d}: % of copy, graph (launch included): "
              + " ".join(f"{name} {row.get(f'{name}_graph_pct_copy', float('nan')):5.1f}"
                         f" ({row.get(f'{name}_pct_copy', float('nan')):5.1f})" for name in peers)
              + f" err {row['rel_err']:.1e}", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_decode_fp8(shapes, copy_gbs: float) -> list[dict]:
    """Decode over an fp8 (e4m3) cache against the same shapes in bf16: GB/s of cache bytes read, and the time."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(4)
    for batch, ctx, hq, hk in shapes:
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen)
        k_scale = torch.full((1,), 0.5, dtype=torch.float32, device="cuda")
        v_scale = torch.full((1,), 0.25, dtype=torch.float32, device="cuda")
        kc8, vc8 = (kc / k_scale).to(torch.float8_e4m3fn), (vc / v_scale).to(torch.float8_e4m3fn)
        out = torch.empty_like(q)
        # The same memory as 64-token pages (what dcp-triton asks vLLM for on sm_90+): "fp8_p64" / "bf16_p64".
        state = gen.get_state()
        pages64 = {True: _as_pages(kc8, vc8, tables, 64, gen)}
        gen.set_state(state)  # the same block tables for the bf16 views
        pages64[False] = _as_pages(kc, vc, tables, 64, gen)

        def run(i=0, fp8=True, page64=False):
            k, v, t = pages64[fp8] if page64 else ((kc8, vc8, tables) if fp8 else (kc, vc, tables))
            prefix_attention(q, k, v, t[i], lens, qsl, scale=HEAD_DIM ** -0.5,
                             q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=1,
                             out=out, k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None)

        row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, fp8_bytes=kv_bytes // 2)
        for key, page64, (k, v, t) in (("rel_err_p64", True, pages64[True]), ("rel_err", False, (kc8, vc8, tables))):
            out.fill_(float("nan"))
            run(page64=page64)
            row[key] = _prefix_error(out, q, k, v, t, lens, qsl, rows=2, k_scale=k_scale, v_scale=v_scale)
        _time_peers(row, {"fp8": run, "bf16": lambda i=0: run(i, fp8=False),
                          "fp8_p64": lambda i=0: run(i, page64=True),
                          "bf16_p64": lambda i=0: run(i, fp8=False, page64=True)}, copies)
        row["fp8_graph_pct_copy"] = 100 * kv_bytes / 2 / row["fp8_graph_ms"] / 1e6 / copy_gbs
        rows.append(row)
        print(f"decode fp8 b={batch} ctx={ctx} {hq}/{hk}: {row['fp8_graph_ms'] * 1e3:.1f} us vs bf16 "
              f"{row['bf16_graph_ms'] * 1e3:.1f} us (graph), {row['fp8_graph_pct_copy']:.0f}% of copy, "
              f"err {row['rel_err']:.1e}; 64-token pages: {row.get('fp8_p64_graph_ms', float('nan')) * 1e3:.1f} vs "
              f"{row.get('bf16_p64_graph_ms', float('nan')) * 1e3:.1f} us, err {row['rel_err_p64']:.1e}", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_prefix(shapes, pages=(PAGE, 64)) -> list[dict]:
    """The DCP prefix pass: many query rows per request against its long paged cache, non-causal, in TFLOP/s, with
    16-token pages (vLLM's default) and 64-token ones (what dcp-triton asks vLLM for), both for every peer."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(5)
    for batch, q_rows, ctx, hq, hk in shapes:
        for page in pages:
            _, _, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen, q_rows=q_rows, page=page)
            tables = tables[:1]
            out = torch.empty_like(q)
            flops = 4 * batch * q_rows * ctx * hq * HEAD_DIM

            def ours(i=0):
                prefix_attention(q, kc, vc, tables[i], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0,
                                 q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=q_rows, out=out)

            out.fill_(float("nan"))
            ours()
            row = dict(batch=batch, q_rows=q_rows, ctx=ctx, q_heads=hq, kv_heads=hk, page=page, flops=flops,
                       rel_err=_prefix_error(out, q, kc, vc, tables, lens, qsl, rows=1, q_limit=256))
            peers = {"ours": ours, **kernel_peers.fa3_paged(q, kc, vc, tables, lens, qsl, max_query_len=q_rows,
                                                            max_kv_len=ctx, causal=False)}
            _time_peers(row, peers, 1, graph=False)
            for name in peers:
                if f"{name}_ms" in row:
                    row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
            rows.append(row)
            print(f"prefix {batch}x{q_rows} rows over {ctx} cached, {hq}/{hk}, pages of {page}: "
                  + " ".join(f"{name} {row.get(f'{name}_tflops', float('nan')):.0f}" for name in peers)
                  + f" TFLOP/s, err {row['rel_err']:.1e}", flush=True)
            kc = vc = None  # the caches go before the next page size's (the closures above hold them)
            torch.cuda.empty_cache()
    return rows


def bench_prefill(shapes) -> list[dict]:
    """Causal current-chunk ``chunk_attention`` over ``(num_seqs, seq_len, q_heads, kv_heads, head_dim)`` in
    TFLOP/s against FA3 and torch's SDPA (the error is against SDPA: bf16 both)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for num_seqs, seq_len, hq, hk, d in shapes:
        total = num_seqs * seq_len
        q = torch.randn(total, hq, d, dtype=DTYPE, device="cuda", generator=gen)
        k = torch.randn(total, hk, d, dtype=DTYPE, device="cuda", generator=gen)
        v = torch.randn(total, hk, d, dtype=DTYPE, device="cuda", generator=gen)
        cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
        out = torch.full_like(q, float("nan"))
        flops = 2 * 2 * num_seqs * seq_len * seq_len * hq * d / 2  # QK^T and PV, causal half

        lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        kwargs = dict(scale=d ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0)
        # "ours": planned once, as the DCP core launches it for every layer of a step; "ours_api": the public
        # function, which checks its arguments and plans on every call.
        launch = plan_chunk(q, k, v, out, lse, cu, seq_len, **kwargs)

        def ours(i=0):
            launch(q, k, v, out, lse, cu)

        def heads_first(t, n):
            return t.view(num_seqs, seq_len, n, d).transpose(1, 2)

        qb, kb, vb = heads_first(q, hq), heads_first(k, hk), heads_first(v, hk)
        row = dict(num_seqs=num_seqs, seq_len=seq_len, q_heads=hq, kv_heads=hk, head_dim=d, flops=flops)
        ours()
        sdpa = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        row["rel_err_vs_sdpa"] = ((heads_first(out, hq).float() - sdpa.float()).norm()
                                  / sdpa.float().norm()).item()
        _time_peers(row, {"ours_api": lambda i=0: chunk_attention(q, k, v, cu, seq_len, out=out, lse=lse,
                                                                  **kwargs)}, 1, graph=False)
        peers = {"ours": ours,
                 "sdpa": lambda i=0: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                                     enable_gqa=True),
                 **kernel_peers.fa3_prefill(q, k, v, cu, seq_len)}
        _time_peers(row, peers, 1)  # TFLOP/s from graph replay: no host time in anyone's number
        for name in peers:
            if f"{name}_graph_ms" in row:
                row[f"{name}_tflops"] = flops / row[f"{name}_graph_ms"] / 1e9
        rows.append(row)
        print(f"prefill {num_seqs}x{seq_len} {hq}/{hk} D{d}: " + " ".join(
            f"{name} {row.get(f'{name}_tflops', float('nan')):.0f}" for name in peers)
              + f" TFLOP/s (err vs sdpa {row['rel_err_vs_sdpa']:.1e})", flush=True)
        torch.cuda.empty_cache()
    return rows


PREFILL_SHAPES = [(n, s, hq, hk, d) for d in (128, 64) for hq, hk in ((32, 8), (32, 1))
                  for n, s in ((2, 4096), (4, 2048), (16, 1024), (1, 16384))]


def bench_merge(copy_gbs: float, tokens: int = 8192, heads: int = 32) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(2)
    oa = torch.randn(tokens, heads, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    ob = torch.randn_like(oa)
    la = torch.randn(tokens, heads, dtype=torch.float32, device="cuda", generator=gen)
    lb = torch.randn_like(la)
    out, lse = torch.empty_like(oa), torch.empty_like(la)
    nbytes = 3 * oa.numel() * oa.element_size() + 3 * la.numel() * 4
    row = dict(tokens=tokens, heads=heads, bytes=nbytes)
    peers = {"ours": lambda i=0: merge_states(oa, la, ob, lb, out=out, lse=lse),
             **kernel_peers.vllm_merge(out, oa, la, ob, lb)}
    _time_peers(row, peers, 1, graph=False)
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_pct_copy")] = 100 * nbytes / row[key] / 1e6 / copy_gbs
    print(f"merge {tokens}x{heads}x{HEAD_DIM}: % of copy " + " ".join(
        f"{name} {row.get(f'{name}_pct_copy', float('nan')):.1f}" for name in peers), flush=True)
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("decode", []) if (r["q_heads"], r["kv_heads"]) == (32, 8)]
    labels = [f"b{r['batch']}\n{r['ctx'] // 1024}K" for r in rows]
    series = [("ours_graph_pct_copy", "dcp-triton"), ("fa3_graph_pct_copy", "FlashAttention-3 (vLLM's build)"),
              ("vllm_unified_graph_pct_copy", "vLLM unified (TRITON_ATTN)"),
              ("vllm_decode_graph_pct_copy", "vLLM split-KV decode")]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(key, 0) for r in rows], width, label=name)
    ax.axhline(85, color="k", ls="--", lw=0.8)
    ax.set_xticks([x + 1.5 * width for x in range(len(rows))], labels)
    ax.set_ylabel("% of device copy bandwidth (graph replay)")
    ax.set_title(f"Decode, 32 Q / 8 KV heads, D=128, bf16, page 16 — {results['gpu']} "
                 f"(copy {results['copy_gbs']:.0f} GB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--only", help="comma-separated sections: decode, decode_fp8, prefix, prefill, merge, "
                        "decode_d256, prefill_d256 (default: all)")
    parser.add_argument("--name", help="results file stem under benchmarks/results/ (default kernels_<gpu>: h100, ...)")
    args = parser.parse_args()
    fa3 = kernel_peers.fa3() is not None
    copy_gbs = copy_bandwidth_gbs()
    print(f"{gpu_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write); FA3 peer: {fa3}", flush=True)
    decode_shapes = [(b, c, 32, 8) for b in (1, 8, 32, 128) for c in (1024, 8192, 32768)]
    decode_shapes += [(b, c, hq, hk) for hq, hk in ((32, 1), (40, 8)) for b in (1, 8, 32, 128) for c in (8192, 32768)]
    fp8_shapes = [(1, 32768, 32, 8), (8, 8192, 32, 8), (8, 32768, 32, 8), (32, 8192, 32, 1), (128, 8192, 32, 8)]
    prefix_shapes = [(2, 4096, 32768, 32, 8), (2, 4096, 32768, 32, 1), (1, 2048, 131072, 32, 8)]
    prefill_shapes = PREFILL_SHAPES
    # Qwen3-Next's / Qwen3.5's full-attention layers (16 Q / 2 KV heads of 256 at tp 1): the hybrid benchmarks' shape
    d256_decode = [(b, c, 16, 2, 256) for b in (16, 64) for c in (2048, 8192)]
    d256_prefill = [(n, s, 16, 2, 256) for n, s in ((16, 1024), (4, 4096))]
    if args.quick:
        decode_shapes = [(1, 32768, 32, 8), (32, 8192, 32, 1), (128, 32768, 32, 8)]
        fp8_shapes, prefix_shapes, prefill_shapes = fp8_shapes[:1], prefix_shapes[:1], prefill_shapes[:1]
        d256_decode, d256_prefill = d256_decode[:1], d256_prefill[:1]
    args.name = args.name or f"kernels_{gpu_tag()}"
    results = dict(gpu=gpu_name(), copy_gbs=copy_gbs, torch=torch.__version__, fa3_peer=fa3)
    sections = (("decode", lambda: bench_decode(decode_shapes, copy_gbs)),
                ("decode_fp8", lambda: bench_decode_fp8(fp8_shapes, copy_gbs)),
                ("prefix", lambda: bench_prefix(prefix_shapes)),
                ("prefill", lambda: bench_prefill(prefill_shapes)),
                ("merge", lambda: bench_merge(copy_gbs)),
                ("decode_d256", lambda: bench_decode(d256_decode, copy_gbs)),
                ("prefill_d256", lambda: bench_prefill(d256_prefill)))
    chosen = set(args.only.split(",")) if args.only else {name for name, _ in sections}
    for name, fn in sections:
        if name not in chosen:
            continue
        try:
            results[name] = fn()
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"], flush=True)
        save(args.name, results)  # each finished section, should the run be stopped
    path = save(args.name, results)
    try:
        if results.get("decode"):  # the plot is of the decode rows: none without them (--only prefix,prefill)
            plot(results, path.with_suffix(".png"))
    except Exception:
        print(traceback.format_exc(), flush=True)
    print(f"wrote {repo_relative(path)}")  # logs are committed: no machine's folders
    sys.exit(report_wrong(results))


def report_wrong(results: dict) -> int:
    """Print every row whose error passes ERROR_BOUND (or is NaN); 1 if there is one."""
    wrong = [(name, row) for name, rows in results.items() if isinstance(rows, list) for row in rows
             for key in ("rel_err", "rel_err_p64", "rel_err_vs_sdpa") if key in row and not row[key] <= ERROR_BOUND]  # NaN too
    for name, row in wrong:
        print(f"WRONG ({name}, error above {ERROR_BOUND}): {json.dumps(row)[:300]}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    main()
