"""Host cost of DCP attention on one GPU: per layer, per launch, allocations, bytes per collective, mixed steps.

One rank of a DCP = 2 group (the e2e model's shape after TP = 2: 8 local Q heads, 1 stored KV head, head size
128, bf16, page 16), with a stand-in group whose collectives are local copies of the right sizes, each timed on the
host so it can be left out. Host times are CPU timers around calls while the GPU works through the queue (no
synchronisation inside the timed loop), medians of repeated runs.

- per layer: ``DcpAttention.forward`` of a decode step replayed by LAYERS layers, minus the time spent inside the
  stand-in collectives; the first layer's call apart, once preparing the step's plan and once replaying the last
  decode step's (the next step over the same batch tensors);
- per launch: each prepared launch of the step alone (paged attention, its split merge, the cross-rank merge, the cache
  write, the current chunk), and the checked public functions for comparison;
- allocations per layer (CUDA caching-allocator count) and the bytes each collective moves;
- a mixed step (many decodes plus one long chunk over a long context) against the decode-only and chunk-only steps,
  GPU time by CUDA events.

Writes ``benchmarks/results/host_overhead_h200.json`` (``summary.forward_host_us_dcp2_decode`` and
``summary.first_layer_host_us_planned_replayed``, merged into the file's other keys) and prints a table.

    python -m benchmarks.dcp.bench_host_overhead [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, gpu_name
import dcp_plugin as dp
from dcp_plugin import kernels

DTYPE, HEAD_DIM, PAGE = torch.bfloat16, 128, 16
TOTAL_Q, TOTAL_KV, TP, N = 16, 1, 2, 2
LAYERS = 32


class TimedCopyGroup:
    """One rank's view of an N-rank group: every collective is a local copy of the right size, timed on the host."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank_in_group = world_size, rank
        self.host_s, self.bytes = 0.0, {}

    def _timed(self, name, out, t, copy):
        began = time.perf_counter()
        copy()
        self.host_s += time.perf_counter() - began
        self.bytes[name] = self.bytes.get(name, 0) + t.numel() * t.element_size()

    def all_gather_into(self, out, t):
        self._timed("all_gather", out, t, lambda: out.view(self.world_size, -1).copy_(t.reshape(1, -1)))

    def reduce_scatter_into(self, out, t):
        self._timed("reduce_scatter", out, t, lambda: out.view(-1).copy_(t.reshape(self.world_size, -1)[0]))

    def all_to_all_into(self, out, t):
        self._timed("all_to_all", out, t, lambda: out.copy_(t))

    def all_gather(self, t, dim):  # the allocating API (unused by DcpAttention when *_into exists)
        return torch.cat([t] * self.world_size, dim=dim)

    def reduce_scatter(self, t, dim):
        return t.chunk(self.world_size, dim=dim)[self.rank_in_group].clone()

    def all_to_all(self, t):
        return t.clone()


def make_step(batch: int, ctx: int, query_len: int, gen, *, n: int = N, comm: str = "ag_rs", extra=None):
    """One rank's inputs for ``batch`` requests of ``query_len`` new tokens over ``ctx`` cached tokens (plus
    ``extra`` = (requests, query_len, ctx) more), a DcpAttention with a shared workspace."""
    parallel = dp.ParallelState.from_tp(tp_rank=0, tp_size=TP, dcp_size=n)
    heads = dp.HeadLayout.create(total_q_heads=TOTAL_Q, total_kv_heads=TOTAL_KV, parallel=parallel, kv_replication="tp")
    tokens = dp.TokenLayout(dcp_size=n, dcp_rank=0, interleave=1, block_size=PAGE)
    reqs = [(query_len, ctx)] * batch + ([(extra[1], extra[2])] * extra[0] if extra else [])
    pages = [math.ceil(tokens.max_local_len(q + c) / PAGE) for q, c in reqs]
    width = max(pages)
    kv = torch.randn(sum(pages) + 1, PAGE, heads.num_kv_heads, 2 * HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    table = torch.randperm(len(reqs) * width, generator=gen, device="cuda").remainder(sum(pages)).to(torch.int32)
    table = table.view(len(reqs), width)
    num_tokens = sum(q for q, _ in reqs)
    qsl = torch.tensor([0, *torch.tensor([q for q, _ in reqs]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.tensor([q + c for q, c in reqs], dtype=torch.int32, device="cuda")
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda")  # no writes: the shard stays valid
    batch_obj = dp.DcpBatch.build(query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots,
                                  tokens=tokens, max_query_len=max(q for q, _ in reqs), max_seq_len=int(seq.max()),
                                  max_context_len=max(c for _, c in reqs),
                                  num_decodes=batch if query_len == 1 else 0)
    group = TimedCopyGroup(n, 0) if n > 1 else None
    ws = dp.DcpWorkspace(heads=heads, head_dim=HEAD_DIM, dtype=DTYPE, device="cuda", max_num_tokens=num_tokens,
                         comm=comm, split_elements=kernels.split_capacity(HEAD_DIM, torch.device("cuda")))
    attn = dp.DcpAttention(heads=heads, tokens=tokens, group=group, scale=HEAD_DIM ** -0.5, comm=comm, workspace=ws)
    hq, hk = heads.num_q_heads, heads.num_kv_heads
    qkv = torch.randn(num_tokens, hq + 2 * hk, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)  # as in a model
    args = (qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], kv[..., :HEAD_DIM], kv[..., HEAD_DIM:])
    return attn, args, batch_obj, group, tokens


def host_per_layer(attn, args, batch, group, out, repeats: int) -> dict:
    """Median host µs per layer (minus the stand-in collectives) over ``repeats`` runs of LAYERS layers, the first
    layer's µs when it prepares the step's plan and when it replays the last decode step's (a step over the same
    batch tensors, as an engine's persistent buffers give), and CUDA allocations per layer."""
    attn.forward(*args, batch, out=out)  # compile, plan
    torch.cuda.synchronize()
    per_layer, first, steady = [], [], []
    allocs_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for _ in range(repeats):
        batch.plans.clear()
        attn._last_decode = None  # a step unlike the last decode step: its first layer prepares the plan
        began = time.perf_counter()
        attn.forward(*args, batch, out=out)
        first.append(time.perf_counter() - began)
        batch.plans.clear()  # the next step over the same tensors: its first layer replays that plan
        group_s = group.host_s if group else 0.0
        began = time.perf_counter()
        attn.forward(*args, batch, out=out)
        steady.append(time.perf_counter() - began - ((group.host_s - group_s) if group else 0.0))
        group_s = group.host_s if group else 0.0
        began = time.perf_counter()
        for _ in range(LAYERS):
            attn.forward(*args, batch, out=out)
        elapsed = time.perf_counter() - began - ((group.host_s - group_s) if group else 0.0)
        per_layer.append(elapsed / LAYERS)
        torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - allocs_before
    return {"forward_host_us": statistics.median(per_layer) * 1e6,
            "first_layer_host_us": statistics.median(first) * 1e6,
            "first_layer_replayed_host_us": statistics.median(steady) * 1e6,
            "allocations_per_layer": allocs / (repeats * (LAYERS + 2))}


def host_per_launch(plan, args, out, repeats: int = 200) -> dict:
    """Median host µs of each prepared launch of ``plan`` (a ``dcp_plugin.step_plan`` flow) called alone, on the
    tensors its ``run`` hands it (the GPU runs behind)."""
    from dcp_plugin.step_plan import A2aPlan, AgRsPlan, SingleRankPlan

    q, k, v, key_cache, value_cache = args
    views = plan.views if hasattr(plan, "views") else None
    calls = {}
    if plan.write is not None:
        calls["write_kv_cache"] = lambda: plan.write(k, v, key_cache, value_cache, plan.slot_mapping, None, None)
    if plan.chunk is not None:
        chunk_out = (out, plan.lse) if views is None else (views.chunk_out, views.chunk_lse)  # ChunkOnlyPlan: out
        calls["current chunk"] = lambda: plan.chunk(q, k, v, *chunk_out, plan.query_start_loc)
    if isinstance(plan, SingleRankPlan):
        prefix_out = (out, views.lse) if plan.merge is None else (views.prefix_out, views.prefix_lse)
        calls["prefix pass (stage 1 + split merge)"] = lambda: plan.prefix(
            q, key_cache, value_cache, plan.block_table, plan.prefix_lens, plan.query_start_loc, *prefix_out, None,
            None)
    elif isinstance(plan, (AgRsPlan, A2aPlan)):
        p = plan.prefix
        calls["prefix pass (stage 1 + split merge)"] = lambda: p.launch(
            p.q_group, key_cache, value_cache, p.block_table, p.lens, p.query_start_loc, p.out, p.lse, None, None)
    if isinstance(plan, AgRsPlan):
        calls["rescale"] = lambda: plan.rescale(*plan.rescale_args)
    if isinstance(plan, A2aPlan):
        calls["merge"] = lambda: plan.merge(*plan.merge_inputs, out, views.lse)
    return {name: host_us(call, repeats) for name, call in calls.items()}


def host_us(call, repeats: int) -> float:
    """Median host µs of ``call`` (compiled and warm first; the GPU runs behind, no sync inside the loop)."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def gpu_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def mixed_step(gen, decodes: int, ctx: int, chunk: int) -> dict:
    """GPU ms of decode-only, chunk-only and mixed steps (one rank, DCP = 2, collectives local)."""
    results = {}
    for name, (batch, qlen, extra) in {"decode_only": (decodes, 1, None), "chunk_only": (1, chunk, None),
                                       "mixed": (decodes, 1, (1, chunk, ctx))}.items():
        attn, args, step, _, _ = make_step(batch, ctx, qlen, gen, extra=extra)
        out = torch.empty_like(args[0])
        results[name] = gpu_ms(lambda: attn.forward(*args, step, out=out))
        attn = args = step = None  # freed before the next shape (the lambda above holds them)
        torch.cuda.empty_cache()
    results["mixed_over_sum"] = results["mixed"] / (results["decode_only"] + results["chunk_only"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_overhead_h200.json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    repeats = 5 if args.quick else 15
    rows = []
    for comm in ("ag_rs", "a2a"):
        for batch in ((1, 32) if args.quick else (1, 8, 32, 128)):
            for n in (1, N):
                attn, inputs, step, group, _ = make_step(batch, 8192, 1, gen, n=n, comm=comm)
                out = torch.empty_like(inputs[0])
                row = dict(comm=comm, dcp=n, batch=batch, ctx=8192, **host_per_layer(attn, inputs, step, group, out,
                                                                                     repeats))
                plan = next(iter(step.plans.values()))
                row["per_launch_host_us"] = host_per_launch(plan, inputs, out)
                if group:
                    group.bytes.clear()
                    attn.forward(*inputs, step, out=out)
                    row["collective_bytes_per_layer"] = dict(group.bytes)
                rows.append(row)
                print(f"{comm:5s} dcp {n} batch {batch:3d}: forward {row['forward_host_us']:6.1f} us/layer "
                      f"(first layer {row['first_layer_host_us']:6.1f}, replaying the last step's plan "
                      f"{row['first_layer_replayed_host_us']:6.1f}), allocs/layer "
                      f"{row['allocations_per_layer']:.2f}, launches {row['per_launch_host_us']}", flush=True)
    attn, inputs, step, _, _ = make_step(4, 2048, 64, gen, comm="a2a")  # a chunked-prefill step: its launches
    out = torch.empty_like(inputs[0])
    attn.forward(*inputs, step, out=out)
    prefill_launches = host_per_launch(next(iter(step.plans.values())), inputs, out)
    print(f"prefill step launches (a2a): {prefill_launches}", flush=True)
    public = public_launch_costs(gen)
    mixed = mixed_step(gen, decodes=200 if not args.quick else 64, ctx=32768, chunk=8192 if not args.quick else 2048)
    print(f"mixed step: {mixed}", flush=True)
    decode_dcp2 = [r["forward_host_us"] for r in rows if r["dcp"] == N]
    result = {"gpu": gpu_name(), "model": dict(q_heads=TOTAL_Q, kv_heads=TOTAL_KV, tp=TP, head_dim=HEAD_DIM,
                                                dtype=str(DTYPE)), "layers": LAYERS, "rows": rows,
              "prefill_step_launch_host_us": prefill_launches, "public_call_host_us": public, "mixed_step_ms": mixed,
              "fast_launch": kernels._launch.FAST_LAUNCH}
    merge(args.out, result, {"forward_host_us_dcp2_decode": max(decode_dcp2),
                             "forward_host_us_dcp2_decode_by_batch": {f"{r['comm']}_b{r['batch']}":
                                                                      round(r["forward_host_us"], 1)
                                                                      for r in rows if r["dcp"] == N},
                             "first_layer_host_us_planned_replayed": {
                                 f"{r['comm']}_dcp{r['dcp']}_b{r['batch']}":
                                     [round(r["first_layer_host_us"], 1), round(r["first_layer_replayed_host_us"], 1)]
                                 for r in rows},
                             "mixed_over_decode_plus_chunk": mixed["mixed_over_sum"]})


def public_launch_costs(gen) -> dict:
    """Host µs of the checked public functions (what a caller outside the core pays), for comparison."""
    attn, (q, k, v, kc, vc), step, _, tokens = make_step(32, 8192, 1, gen, n=1)
    calls = {
        "prefix_attention": lambda: kernels.prefix_attention(
            q, kc, vc, step.block_table, step.local_seq_lens, step.query_start_loc, scale=0.1, q_head_start=0,
            q_per_kv=q.shape[1], kv_head_start=0, max_kv_len=step.max_local_seq_len, max_query_len=1),
        "chunk_attention": lambda: kernels.chunk_attention(q, k, v, step.query_start_loc, 1, scale=0.1,
                                                           q_head_start=0, q_per_kv=q.shape[1], kv_head_start=0),
    }
    return {name: host_us(call, 100) for name, call in calls.items()}


def merge(path: Path, section: dict, summary: dict) -> None:
    """Write ``section`` under "host_overhead" and ``summary`` into "summary", keeping the file's other keys."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["host_overhead"] = section
    data.setdefault("summary", {}).update(summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}: summary {json.dumps(data['summary'], default=str)[:400]}", flush=True)


if __name__ == "__main__":
    main()
