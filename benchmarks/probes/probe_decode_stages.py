"""Where a small-batch decode's time goes: CUDA-graph replay time of ``prefix_attention``'s two stages (the split
KV pass and the merge of the splits) apart and together, for a few shapes, at the automatic split count and
others. One H200 run of this answers whether the merge or the split pass bounds batch-1 decode.

Writes ``benchmarks/results/decode_stages_h200.json`` (``rows``: one per shape and split count, with ``common.save``'s
``provenance``). No page quotes it, so it is not kept in the tree: the runs from before and after the one-step split
merge are in the git history (``git log --diff-filter=D -- benchmarks/results/decode_stages_h200.json``).

    python -m benchmarks.probes.probe_decode_stages
    bash scripts/device/run_h200.sh bench benchmarks/probes/probe_decode_stages.py   # on the H200, nothing carried
"""

from __future__ import annotations

import json

import torch

from benchmarks.common import graph_ms, save
from benchmarks.kernels.bench_kernels import HEAD_DIM, _prefix_setup
from dcp_plugin.kernels.prefix_attention import plan_prefix


def main() -> None:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    for batch, ctx, hq, hk in ((1, 8192, 32, 1), (1, 32768, 32, 1), (1, 8192, 32, 8), (8, 8192, 32, 1)):
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        for splits in (None, 1, 8, 16, 32):
            plan = plan_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, scale=HEAD_DIM ** -0.5, q_head_start=0,
                               q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=1,
                               num_splits=splits)
            scales = (q, q)
            dst = (plan.part_out, plan.part_lse) if plan.merge else (out, lse)
            row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, splits=plan.num_splits, auto=splits is None)
            row["stage1_us"] = 1e3 * graph_ms([lambda i=i: plan.stage1(q, kc, vc, tables[i], lens, qsl, *dst, *scales)
                                               for i in range(copies)])
            if plan.merge:
                row["merge_us"] = 1e3 * graph_ms([lambda: plan.merge(plan.part_out, plan.part_lse, out, lse)])
            row["both_us"] = 1e3 * graph_ms([lambda i=i: plan(q, kc, vc, tables[i], lens, qsl, out, lse)
                                             for i in range(copies)])
            row["gbs"] = kv_bytes / row["both_us"] / 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    save("decode_stages_h200", dict(rows=rows))


if __name__ == "__main__":
    main()
