"""Kernel benchmarks on one GPU, peers measured side by side in the same run.

Decode (``paged_attention``, one query token per request) in GB/s of KV read against the device copy bandwidth,
timed with ``triton.testing.do_bench`` (L2 flushed, median) and with CUDA-graph replay; current-chunk prefill
(``extend_attention``) in TFLOP/s against SDPA and compiled flex attention; ``merge_states`` in GB/s.
vLLM's Triton kernels (unified attention, split-KV decode, merge_attn_states) are measured too when ``vllm``
imports (on a machine without vLLM, unpack its wheel's Python files and compiled extensions beside this repository
and put them on PYTHONPATH, as benchmarks/run_h200.sh does).

    python benchmarks/bench_kernels.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cold_copies, copy_bandwidth_gbs, gpu_name, graph_ms, median_ms, save  # noqa: E402

from dcp_plugin.kernels import extend_attention, merge_states, paged_attention  # noqa: E402
from dcp_plugin.kernels import reference  # noqa: E402

DTYPE = torch.bfloat16
HEAD_DIM = 128
PAGE = 16


def _paged_setup(batch: int, ctx: int, hq: int, hk: int, gen: torch.Generator):
    """Decode inputs with enough disjoint KV sets (block tables over disjoint pages of one pool) that graph
    replays cycling through them run L2-cold: ``(kv_bytes, copies, q, key_cache, value_cache, tables, lens, qsl)``."""
    kv_bytes = batch * ctx * hk * HEAD_DIM * 2 * DTYPE.itemsize
    copies = cold_copies(kv_bytes)
    pages_per_req = math.ceil(ctx / PAGE)
    num_pages = pages_per_req * batch * copies
    kv = torch.randn(num_pages, PAGE, hk, 2 * HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    key_cache, value_cache = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]  # vLLM-style views of one buffer
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(copies, batch, pages_per_req)
    q = torch.randn(batch, hq, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return kv_bytes, copies, q, key_cache, value_cache, tables, lens, qsl


def bench_decode(shapes, copy_gbs: float, with_vllm: bool) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, ctx, hq, hk in shapes:
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _paged_setup(batch, ctx, hq, hk, gen)
        out = torch.empty_like(q)
        scale = HEAD_DIM ** -0.5

        def ours(i=0):
            paged_attention(q, kc, vc, tables[i], lens, qsl, scale=scale, q_head_start=0, q_per_kv=hq // hk,
                            kv_head_start=0, max_kv_len=ctx, max_query_len=1, out=out)

        # Correct first: a slice of the batch against the float64 reference.
        n = min(batch, 2)
        pages = tables[0, :n].flatten().long()  # only the checked requests' pages, in float64
        sub_table = torch.arange(pages.numel(), dtype=torch.int32, device="cuda").view(n, -1)
        ref, _ = reference.paged_attention(q[:n].double(), kc[pages].double(), vc[pages].double(), sub_table,
                                           lens[:n], qsl[: n + 1], scale=scale, q_head_start=0, q_per_kv=hq // hk,
                                           kv_head_start=0, max_kv_len=ctx)
        ours()
        err = ((out[:n].double() - ref).norm() / ref.norm()).item()
        row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, kv_bytes=kv_bytes, rel_err=err)
        row["ours_ms"] = median_ms(ours)
        row["ours_graph_ms"] = graph_ms([lambda i=i: ours(i) for i in range(copies)])
        if with_vllm:
            row.update(_vllm_decode(q, kc, vc, tables, lens, qsl, ctx, copies))
        for key in [k for k in row if k.endswith("_ms")]:
            row[key.replace("_ms", "_pct_copy")] = 100 * kv_bytes / row[key] / 1e6 / copy_gbs
        rows.append(row)
        print(f"decode b={batch:4d} ctx={ctx:6d} {hq}/{hk}: ours {row['ours_pct_copy']:5.1f}% "
              f"(graph {row['ours_graph_pct_copy']:5.1f}%)"
              + (f" | vllm unified {row.get('vllm_unified_graph_pct_copy', float('nan')):5.1f}% "
                 f"split-kv {row.get('vllm_decode_graph_pct_copy', float('nan')):5.1f}% (graph)" if with_vllm else "")
              + f" err {err:.1e}", flush=True)
        torch.cuda.empty_cache()
    return rows


def _vllm_decode(q, kc, vc, tables, lens, qsl, ctx, copies) -> dict:
    """vLLM's Triton unified attention (as its TRITON_ATTN backend launches it) and split-KV decode kernel."""
    import triton
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    batch, hq, d = q.shape
    hk = kc.shape[2]
    scale = d ** -0.5
    out = torch.empty_like(q)
    threshold = 128 // hk  # TRITON_ATTN: MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
    segs = 16
    segm_out = torch.empty(threshold, hq, segs, triton.next_power_of_2(d), dtype=torch.float32, device="cuda")
    segm_max = torch.empty(threshold, hq, segs, dtype=torch.float32, device="cuda")
    segm_sum = torch.empty_like(segm_max)

    def unified(i=0):
        unified_attention(q, kc, vc, out, qsl, 1, lens, ctx, scale, True, (-1, -1), tables[i], 0, None, None, None,
                          seq_threshold_3D=threshold, num_par_softmax_segments=segs, softmax_segm_output=segm_out,
                          softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, ctx // 512)), 2 * sms)  # TritonMLA's choice
    logits = torch.empty(batch, hq, splits, d + 1, dtype=torch.float32, device="cuda")
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")

    one = torch.ones((), dtype=torch.float32, device="cuda")  # its default scales are built per call, from the host

    def split_kv(i=0):
        decode_attention_fwd(q, kc, vc, out, lse, tables[i], lens, logits, splits, scale, page_size=PAGE,
                             k_scale=one, v_scale=one)

    res = {}
    for name, fn in (("vllm_unified", unified), ("vllm_decode", split_kv)):
        try:
            res[f"{name}_ms"] = median_ms(fn)
            res[f"{name}_graph_ms"] = graph_ms([lambda i=i, fn=fn: fn(i) for i in range(copies)])
        except Exception as err:  # a peer failing must not lose our numbers
            res[f"{name}_error"] = repr(err)[:300]
    return res


def sweep_decode(shapes, splits_list, configs) -> list[dict]:
    """Tuning data: graph-replay time of explicit split counts and launch configs (auto picks marked)."""
    from dcp_plugin.kernels.paged_attention import PagedConfig, pick_config

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for batch, ctx, hq, hk in shapes:
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _paged_setup(batch, ctx, hq, hk, gen)
        out = torch.empty_like(q)
        auto_cfg = pick_config(HEAD_DIM, decode=True)
        variants = [(s, None) for s in [None, *splits_list]]
        variants += [(None, PagedConfig(block_n=bn, block_m=auto_cfg.block_m, num_warps=w, num_stages=st))
                     for bn, w, st in configs]
        for splits, cfg in variants:
            def call(i, splits=splits, cfg=cfg):
                paged_attention(q, kc, vc, tables[i], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0,
                                q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=1,
                                num_splits=splits, out=out, config=cfg)
            try:
                ms = graph_ms([lambda i=i: call(i) for i in range(copies)])
            except Exception as err:
                rows.append(dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, splits=splits,
                                 config=None if cfg is None else vars(cfg) if hasattr(cfg, "__dict__") else repr(cfg),
                                 error=repr(err)[:200]))
                continue
            rows.append(dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, splits=splits,
                             config=None if cfg is None else [cfg.block_n, cfg.num_warps, cfg.num_stages],
                             graph_ms=ms, gbs=kv_bytes / ms / 1e6))
        best = max((r for r in rows[-len(variants):] if "gbs" in r), key=lambda r: r["gbs"], default=None)
        auto = rows[-len(variants)]
        print(f"sweep b={batch} ctx={ctx} {hq}/{hk}: auto {auto.get('gbs', 0):.0f} GB/s, best "
              f"{best and best['gbs']:.0f} GB/s at splits={best and best['splits']} config={best and best['config']}",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_prefill(seq_shapes, hq: int = 32, hk: int = 8) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for num_seqs, seq_len in seq_shapes:
        total = num_seqs * seq_len
        q = torch.randn(total, hq, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        k = torch.randn(total, hk, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        v = torch.randn(total, hk, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        scale = HEAD_DIM ** -0.5
        flops = 2 * 2 * num_seqs * seq_len * seq_len * hq * HEAD_DIM / 2  # QK^T and PV, causal half

        def ours():
            extend_attention(q, k, v, cu, seq_len, scale=scale, q_head_start=0, q_per_kv=hq // hk,
                             kv_head_start=0, out=out)

        qb = q.view(num_seqs, seq_len, hq, HEAD_DIM).transpose(1, 2)
        kb = k.view(num_seqs, seq_len, hk, HEAD_DIM).transpose(1, 2).repeat_interleave(hq // hk, 1)
        vb = v.view(num_seqs, seq_len, hk, HEAD_DIM).transpose(1, 2).repeat_interleave(hq // hk, 1)
        kg = k.view(num_seqs, seq_len, hk, HEAD_DIM).transpose(1, 2)
        vg = v.view(num_seqs, seq_len, hk, HEAD_DIM).transpose(1, 2)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq_len, seq_len, device="cuda")
        row = dict(num_seqs=num_seqs, seq_len=seq_len, q_heads=hq, kv_heads=hk, flops=flops)
        ours()
        sdpa_out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        row["rel_err_vs_sdpa"] = ((out.view(num_seqs, seq_len, hq, HEAD_DIM).transpose(1, 2).float()
                                   - sdpa_out.float()).norm() / sdpa_out.float().norm()).item()
        for name, fn in (("ours", ours),
                         ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)),
                         ("flex", lambda: flex(qb, kg, vg, block_mask=mask, enable_gqa=True))):
            try:
                row[f"{name}_ms"] = median_ms(fn)
                row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
            except Exception as err:
                row[f"{name}_error"] = repr(err)[:300]
        rows.append(row)
        print(f"prefill {num_seqs}x{seq_len}: ours {row.get('ours_tflops', 0):.0f} TFLOP/s, sdpa "
              f"{row.get('sdpa_tflops', 0):.0f}, flex {row.get('flex_tflops', 0):.0f} "
              f"(err vs sdpa {row['rel_err_vs_sdpa']:.1e})", flush=True)
    return rows


def bench_merge(copy_gbs: float, tokens: int = 8192, heads: int = 32, with_vllm: bool = False) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(2)
    oa = torch.randn(tokens, heads, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    ob = torch.randn_like(oa)
    la = torch.randn(tokens, heads, dtype=torch.float32, device="cuda", generator=gen)
    lb = torch.randn_like(la)
    out, lse = torch.empty_like(oa), torch.empty_like(la)
    nbytes = 3 * oa.numel() * oa.element_size() + 3 * la.numel() * 4
    row = dict(tokens=tokens, heads=heads, bytes=nbytes)
    row["ours_ms"] = median_ms(lambda: merge_states(oa, la, ob, lb, out=out, lse=lse))
    if with_vllm:
        try:
            from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

            la_t, lb_t, lo_t = la.t().contiguous(), lb.t().contiguous(), torch.empty_like(la.t().contiguous())
            row["vllm_ms"] = median_ms(lambda: merge_attn_states(out, oa, la_t, ob, lb_t, lo_t))
        except Exception as err:
            row["vllm_error"] = repr(err)[:300]
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_pct_copy")] = 100 * nbytes / row[key] / 1e6 / copy_gbs
    print(f"merge {tokens}x{heads}x{HEAD_DIM}: ours {row['ours_pct_copy']:.1f}% of copy"
          + (f", vllm {row.get('vllm_pct_copy', float('nan')):.1f}%" if with_vllm else ""), flush=True)
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("decode", []) if (r["q_heads"], r["kv_heads"]) == (32, 8)]
    labels = [f"b{r['batch']}\n{r['ctx'] // 1024}K" for r in rows]
    series = [("ours_graph_pct_copy", "dcp-triton"), ("vllm_unified_graph_pct_copy", "vLLM unified (TRITON_ATTN)"),
              ("vllm_decode_graph_pct_copy", "vLLM split-KV decode")]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(key, 0) for r in rows], width, label=name)
    ax.axhline(85, color="k", ls="--", lw=0.8)
    ax.set_xticks([x + width for x in range(len(rows))], labels)
    ax.set_ylabel("% of device copy bandwidth (graph replay)")
    ax.set_title(f"Decode, 32 Q / 8 KV heads, D=128, bf16, page 16 — {results['gpu']} "
                 f"(copy {results['copy_gbs']:.0f} GB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--sweep", action="store_true", help="also sweep split counts and launch configs")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep (tuning runs)")
    parser.add_argument("--sweep-shapes", default="1x32768x32x8,1x32768x32x1,8x32768x32x8,32x8192x32x8,128x8192x32x8",
                        help="batch x context x Q heads x KV heads, comma-separated")
    parser.add_argument("--name", default="kernels_h200", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401

        with_vllm = True
    except Exception:
        with_vllm = False
    args.sweep = args.sweep or args.sweep_only
    copy_gbs = copy_bandwidth_gbs()
    print(f"{gpu_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write); vllm peers: {with_vllm}", flush=True)
    decode_shapes = [(b, c, 32, 8) for b in (1, 8, 32, 128) for c in (1024, 8192, 32768)]
    decode_shapes += [(b, c, hq, hk) for hq, hk in ((32, 1), (40, 8)) for b in (1, 32) for c in (8192, 32768)]
    if args.quick:
        decode_shapes = [(1, 32768, 32, 8), (32, 8192, 32, 8), (128, 32768, 32, 8)]
    results = dict(gpu=gpu_name(), copy_gbs=copy_gbs, torch=torch.__version__, vllm_peers=with_vllm)
    sweep_shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.sweep_shapes.split(",")]
    sweep_configs = [(32, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 3), (32, 2, 4), (16, 4, 3)]
    sections = (("decode", lambda: bench_decode(decode_shapes, copy_gbs, with_vllm)),
                ("sweep", lambda: [] if not args.sweep else
                 sweep_decode(sweep_shapes, [1, 2, 4, 8, 16, 32, 64, 128], sweep_configs)),
                ("prefill", lambda: bench_prefill([(2, 4096), (4, 2048)])),
                ("merge", lambda: bench_merge(copy_gbs, with_vllm=with_vllm)))
    if args.sweep_only:
        sections = [s for s in sections if s[0] == "sweep"]
    for name, fn in sections:
        try:
            results[name] = fn()
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"], flush=True)
    path = save(args.name, results)
    try:
        plot(results, path.with_suffix(".png"))
    except Exception:
        print(traceback.format_exc(), flush=True)
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in results.items() if k in ("gpu", "copy_gbs")}))


if __name__ == "__main__":
    main()
