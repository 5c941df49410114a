"""Per-rank DCP attention time on one GPU: DCP = 1, 2, 4, 8 simulated as one rank of an N-rank group.

One rank of a DCP group holds 1/N of every request's context and attends with the group's N x Hq gathered Q heads. This
script times that rank's whole ``DcpAttention.forward`` (cache write, current chunk, prefix over the local shard, LSE
merge across ranks, merge with the current chunk) for decode steps, with a stand-in group whose collectives are local
copies of the right shapes: the numbers are local work only and exclude interconnect time (issue 7 measures real NCCL).
Timed by CUDA-graph replay (median). Writes benchmarks/results/dcp_sim_<name>.json and a PNG.

    python -m benchmarks.dcp.bench_dcp_sim [--quick]
"""

from __future__ import annotations

import argparse
import math
import traceback
from pathlib import Path

import torch

from benchmarks.common import RESULTS, gpu_name, graph_ms, save
import dcp_plugin as dp
from dcp_plugin.testing import ShapeOnlyGroup  # (collectives as local copies of the right shapes)

DTYPE = torch.bfloat16
HEAD_DIM = 128
PAGE = 16
# Per rank: 8 local Q heads and 1 stored KV head, the shape of any GQA model whose TP duplicates KV heads 8x
# (64 Q / 1 KV at TP 8 here); DCP up to 8 then removes that duplication.
TOTAL_Q_HEADS, TOTAL_KV_HEADS, TP = 64, 1, 8


def time_rank(n: int, batch: int, ctx: int, comm: str, gen: torch.Generator) -> float:
    parallel = dp.ParallelState.from_tp(tp_rank=0, tp_size=TP, dcp_size=n)
    heads = dp.HeadLayout.create(total_q_heads=TOTAL_Q_HEADS, total_kv_heads=TOTAL_KV_HEADS, parallel=parallel,
                                 kv_replication="tp")
    tokens = dp.TokenLayout(dcp_size=n, dcp_rank=0, interleave=1, block_size=PAGE)
    local_pages = math.ceil((tokens.max_local_len(ctx) + 1) / PAGE)
    kv = torch.randn(batch * local_pages, PAGE, heads.num_kv_heads, 2 * HEAD_DIM, dtype=DTYPE, device="cuda",
                     generator=gen)
    key_cache, value_cache = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    table = torch.randperm(batch * local_pages, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    owned = tokens.owner(ctx) == 0
    pos = torch.full((batch,), ctx, device="cuda")
    slots = table[torch.arange(batch, device="cuda"), tokens.local_index(pos) // PAGE].long() * PAGE + \
        tokens.local_index(pos) % PAGE
    slot_mapping = slots if owned else torch.full_like(slots, -1)
    step = dp.DcpBatch.build(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slot_mapping,
                             tokens=tokens, max_query_len=1, max_seq_len=ctx + 1, max_context_len=ctx)
    group = ShapeOnlyGroup(n, 0) if n > 1 else None
    attn = dp.DcpAttention(heads=heads, tokens=tokens, group=group, scale=HEAD_DIM ** -0.5, comm=comm)
    q = torch.randn(batch, heads.num_q_heads, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    k = torch.randn(batch, heads.num_kv_heads, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    return graph_ms([lambda: attn.forward(q, k, v, key_cache, value_cache, step, out=out)])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["ctx"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), sharey=True)
    for ax, ctx in zip(axes, ctxs):
        for b in batches:
            pts = sorted((r["dcp"], r["speedup"]) for r in rows if r["ctx"] == ctx and r["batch"] == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {b}")
        ax.plot([1, 8], [1, 8], "k--", lw=0.8, label="ideal N")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"context {ctx // 1024}K")
        ax.set_xlabel("DCP size N")
    axes[0].set_ylabel("DCP=1 time / per-rank time")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Per-rank DCP attention speedup (local work, {gpu_name()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--comm", default="ag_rs", choices=("ag_rs", "a2a"))
    parser.add_argument("--name", default="dcp_sim_h200")
    args = parser.parse_args()
    ctxs = (8192, 32768, 131072)
    batches = (1, 8, 32, 64)
    if args.quick:
        ctxs, batches = (32768,), (1, 32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ctx in ctxs:
        for batch in batches:
            base = None
            for n in (1, 2, 4, 8):
                try:
                    ms = time_rank(n, batch, ctx, args.comm, gen)
                except Exception:
                    print(traceback.format_exc(), flush=True)
                    continue
                base = ms if n == 1 else base
                row = dict(ctx=ctx, batch=batch, dcp=n, ms=ms, speedup=base / ms if base else None,
                           target_met=None if n == 1 or base is None else ms <= 1.1 * base / n)
                rows.append(row)
                print(f"ctx {ctx:6d} batch {batch:3d} dcp {n}: {ms * 1e3:8.1f} us  speedup "
                      f"{row['speedup'] or 0:5.2f}x  <=1.1/N: {row['target_met']}", flush=True)
                torch.cuda.empty_cache()
    save(args.name, dict(gpu=gpu_name(), comm=args.comm, model=dict(q_heads=TOTAL_Q_HEADS, kv_heads=TOTAL_KV_HEADS,
                                                                     tp=TP, head_dim=HEAD_DIM), rows=rows))
    try:
        plot([r for r in rows if r["speedup"]], RESULTS / f"{args.name}.png")
    except Exception:
        print(traceback.format_exc(), flush=True)


if __name__ == "__main__":
    main()
