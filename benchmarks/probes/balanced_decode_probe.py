"""The ``tl`` decode kernel's balanced splits (each request its own split count, ``_schedule.balanced_split``)
against the uniform split count it replaced (one count for every request, ``pick_num_splits`` for the longest),
beside FA3, in one process on one GPU, CUDA-graph replay over L2-cold copies, 16-token pages.

Batches of unequal contexts (a serving engine's: short decodes beside a few long ones), and equal ones to show what
the change costs where nothing was unbalanced; each with the split count planned for the batch's longest context and
for a 40K-token bound (vLLM's full decode graphs plan for the block table's capacity). Every output is checked
against float64 attention first (exit 1 past bench_kernels.ERROR_BOUND or on NaN).

    python -m benchmarks.probes.balanced_decode_probe [--name kernels_h200_balanced_decode]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.common import gpu_name, graph_ms, save
from benchmarks.kernels import kernel_peers
from benchmarks.kernels.bench_kernels import ERROR_BOUND, _prefix_error, _prefix_setup
from dcp_plugin.kernels.prefix_attention import plan_prefix, split_capacity
from dcp_plugin.kernels.split_kv import auto_splits

GRAPH_BOUND = 40960  # a 40K-token model's block table: what a captured decode graph plans for


def _lens(kind: str, gen) -> list[int]:
    """Context lengths of one batch: ``batch:lo-hi`` parts joined by ``+``, ``batch`` contexts from ``lo .. hi``."""
    lens = []
    for part in kind.split("+"):
        batch, span = part.split(":")
        lo, hi = (int(x) for x in span.split("-"))
        lens += torch.randint(lo, hi + 1, (int(batch),), generator=gen).tolist()
    return lens


BATCHES = [  # (name, lengths spec, Q heads, KV heads)
    ("vllm-mixed-40", "32:512-768+8:2048-8192", 32, 8),
    ("vllm-mixed-48", "32:512-768+16:2048-8192", 32, 8),
    ("one-long-of-64", "63:1024-1024+1:32768-32768", 32, 8),
    ("ramp-128", "128:1024-8192", 32, 8),
    ("mqa16-mixed-40", "32:512-768+8:2048-8192", 16, 1),
    ("equal-1x8K", "1:8192-8192", 32, 8),
    ("equal-8x1K", "8:1024-1024", 32, 8),
    ("equal-8x32K", "8:32768-32768", 32, 8),
    ("equal-32x8K", "32:8192-8192", 32, 8),
    ("equal-128x1K", "128:1024-1024", 32, 8),
    ("equal-128x8K", "128:8192-8192", 32, 8),
    ("equal-256x640", "256:640-640", 32, 8),
]


def time_batch(name: str, spec: str, hq: int, hk: int, gen) -> dict:
    lens_list = _lens(spec, torch.Generator().manual_seed(sum(map(ord, name))))
    batch, longest = len(lens_list), max(lens_list)
    kv_bytes, copies, q, kc, vc, tables, _, qsl = _prefix_setup(batch, longest, hq, hk, gen)
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    kv_bytes = kv_bytes * sum(lens_list) // (batch * longest)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    scratch = torch.empty(split_capacity(q.shape[-1], q.device), dtype=torch.float32, device="cuda")
    row = dict(batch=name, q_heads=hq, kv_heads=hk, requests=batch, longest=longest, kv_bytes=kv_bytes)
    fns = {}
    for bound_name, bound in (("", longest), ("_graph_bound", max(longest, GRAPH_BOUND))):
        kw = dict(scale=q.shape[-1] ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=bound,
                  max_query_len=1, split_buffer=scratch)
        balanced = plan_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, **kw)  # the default on a GPU
        consts = balanced.stage1.constexprs
        head_programs = hk * -(-(hq // hk) // consts["BLOCK_H"])
        uniform_splits = auto_splits(q, programs=batch * head_programs, max_kv_len=bound, block_n=consts["BLOCK_N"],
                                     split_buffer=scratch)
        uniform = plan_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, num_splits=uniform_splits, **kw)
        row[f"splits{bound_name}"] = dict(balanced=balanced.num_splits, uniform=uniform_splits,
                                          balanced_on=bool(consts.get("BALANCED")))
        for kernel, plan in (("balanced", balanced), ("uniform", uniform)):
            out.fill_(float("nan"))
            plan(q, kc, vc, tables[0], lens, qsl, out, lse)
            row[f"{kernel}{bound_name}_rel_err"] = _prefix_error(out, q, kc, vc, tables, lens, qsl, rows=batch)
            fns[f"{kernel}{bound_name}"] = [lambda i=i, p=plan: p(q, kc, vc, tables[i], lens, qsl, out, lse)
                                            for i in range(copies)]
    for peer, fn in kernel_peers.fa3_paged(q, kc, vc, tables, lens, qsl, max_query_len=1, max_kv_len=longest,
                                           causal=True).items():
        fns[peer] = [lambda i=i, fn=fn: fn(i) for i in range(copies)]
    row["dropped_first_graph_ms"] = graph_ms(next(iter(fns.values())))  # a shape's first timing reads slow
    for key, calls in fns.items():
        row[f"{key}_graph_ms"] = graph_ms(calls)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="kernels_h200_balanced_decode")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_done = []
    result = dict(gpu=gpu_name(), fa3_peer=kernel_peers.fa3() is not None, rows=rows_done)
    for name, spec, hq, hk in BATCHES:
        rows_done.append(time_batch(name, spec, hq, hk, gen))
        save(args.name, result)
        torch.cuda.empty_cache()
    wrong = [r["batch"] for r in rows_done for k, v in r.items() if k.endswith("rel_err") and not v <= ERROR_BOUND]
    print(f"wrong: {wrong}" if wrong else "every output within the bound", flush=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
