"""One H200 call for the Gluon decode kernel (``dcp_plugin.kernels.gluon_decode``): is it right, which key tile and
ring depth serve it best, and is it faster than the ``tl`` decode kernel and FA3?

Each config of ``CONFIGS`` (pages per key tile, stages) runs in a child process with a time limit (a wrong mbarrier
phase hangs a GPU, and the parent must still report). A child first checks the kernel through ``plan_prefix`` (its
split partials and their merge included) against float64 attention on batches of varied context lengths (0 to
5,000 tokens, so empty requests, empty splits and partial last tiles), 64-token pages whose rows past each context
and whose unused table entries hold NaN, outputs poisoned with NaN first, CUDA-graph padding rows, several head
layouts (a group of 32, 128 Q heads over one KV head, a rank's 8 Q heads from the middle of a group of 16, groups
of 4 and 5, rank-major outputs, head size 64), split counts 1, 3 and automatic, and 2-3 programs over all the work
items (each program then runs many in turn; by default one program per SM). Only a config that passes is timed,
by graph replay over L2-cold copies (``bench_kernels.py``'s inputs), beside the same config with a program per item,
the ``tl`` decode kernel (``DCP_TRITON_GLUON=0``) and FA3 over 16-token pages: on ``SWEEP_SHAPES``, or for the first
config (unless ``--sweep``) on ``FULL_SHAPES`` (every decode shape of ``bench_kernels.py``, 16 Q / 1 KV heads, large
batches of short contexts, batches of varied contexts) with half and twice the automatic split count and FA3 over
64-token pages too. A call's configs are appended to the results file's ``runs`` with the call's provenance.

    python -m benchmarks.probes.gluon_decode_probe [--name kernels_h200_gluon_decode]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
from pathlib import Path

# (pages per key tile, stages); the first: gluon_decode's own
CONFIGS = [(1, 4), (1, 3), (2, 3)]
SWEEP_SHAPES = [(8, 1024, 32, 8), (8, 8192, 32, 8), (128, 1024, 32, 8), (128, 8192, 32, 8), (1, 32768, 32, 1),
                (32, 8192, 32, 1), (128, 8192, 32, 1), (128, 8192, 32, 8, "mixed")]  # (batch, context, Q, KV heads)
FULL_SHAPES = [(b, c, 32, 8) for b in (1, 8, 32, 128) for c in (1024, 8192, 32768)] + [
    (b, c, hq, hk) for hq, hk in ((32, 1), (40, 8), (16, 1)) for b in (1, 8, 32, 128) for c in (8192, 32768)] + [
    (256, 1024, 32, 8), (128, 1024, 16, 1), (256, 1024, 16, 1), (8, 1024, 16, 1), (128, 8192, 32, 8, "mixed"),
    (128, 8192, 32, 1, "mixed"), (32, 32768, 32, 8, "mixed")]  # "mixed": contexts drawn from ctx / 8 .. ctx
CHECK_LENS = [0, 1, 63, 64, 65, 127, 128, 129, 1000, 5000]
# (Q heads, stored KV heads, q_head_start, q_per_kv, ranks of a rank-major output, head size)
CHECK_LAYOUTS = [(32, 1, 0, 32, 0, 128), (128, 1, 0, 128, 0, 128), (8, 2, 8, 16, 0, 128), (32, 8, 0, 4, 2, 128),
                 (40, 8, 0, 5, 0, 128), (32, 1, 0, 32, 2, 64)]
ERROR_BOUND = 1e-2  # relative Frobenius error of a bf16 output (bench_kernels.py's bound)
PAGE, PAD = 64, 3  # 64-token pages; CUDA-graph padding rows after the last request
CHILD_TIMEOUT_S = 150


def _check_inputs(hq, hk, d, gen):
    """A batch over ``CHECK_LENS`` whose cache holds NaN past each context and in page 0 (where unused table
    entries point): ``(q, key_cache, value_cache, table, lens, qsl)``."""
    import torch

    lens = torch.tensor(CHECK_LENS, dtype=torch.int32, device="cuda")
    per_req = max(1, -(-max(CHECK_LENS) // PAGE))
    pages = 1 + len(CHECK_LENS) * per_req
    kc, vc = torch.randn(2, pages, PAGE, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    table = torch.zeros(len(CHECK_LENS), per_req, dtype=torch.int32, device="cuda")
    perm = 1 + torch.randperm(pages - 1, device="cuda", generator=gen).to(torch.int32)
    for b, length in enumerate(CHECK_LENS):
        used = -(-length // PAGE)
        table[b, :used] = perm[b * per_req: b * per_req + used]
        if length % PAGE:
            for cache in (kc, vc):
                cache[table[b, used - 1], length % PAGE:] = float("nan")
    kc[0], vc[0] = float("nan"), float("nan")
    q = torch.randn(len(CHECK_LENS) + PAD, hq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    qsl = torch.arange(len(CHECK_LENS) + 1, dtype=torch.int32, device="cuda")
    return q, kc, vc, table, lens, qsl


def check(config) -> dict:
    import torch

    from dcp_plugin.kernels import reference
    from dcp_plugin.kernels.prefix_attention import plan_prefix

    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = {}
    for hq, hk, q_head_start, q_per_kv, ranks, d in CHECK_LAYOUTS:
        q, kc, vc, table, lens, qsl = _check_inputs(hq, hk, d, gen)
        kw = dict(scale=d ** -0.5, q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=0,
                  max_kv_len=max(CHECK_LENS))
        ref_out, ref_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl, **kw)
        for splits, programs in ((1, None), (3, None), (None, None), (1, 2), (3, 3)):  # 2-3 programs: each loops
            t = q.shape[0]
            if ranks:
                out = torch.full((ranks, t, hq // ranks, d), float("nan"), dtype=q.dtype, device="cuda")
                lse = torch.full((ranks, t, hq // ranks), float("nan"), device="cuda")
            else:
                out, lse = torch.full_like(q, float("nan")), torch.full((t, hq), float("nan"), device="cuda")
            launch = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, max_query_len=1, num_splits=splits,
                                 gluon_decode=(*config, programs), **kw)
            assert type(launch.stage1.kernel).__name__ == "GluonJITFunction", "not the Gluon kernel"
            launch(q, kc, vc, table, lens, qsl, out, lse)
            torch.cuda.synchronize()
            if ranks:  # back to [T, H, D] / [T, H]
                out, lse = out.transpose(0, 1).reshape(t, hq, d), lse.transpose(0, 1).reshape(t, hq)
            live = ref_lse > float("-inf")
            rel = ((out.double() - ref_out).norm() / ref_out.norm()).item()
            lse_err = (lse.double()[live] - ref_lse[live]).abs().max().item()
            empty_ok = bool((out[~live] == 0).all() and (lse[~live] == float("-inf")).all())
            nan = bool(out.isnan().any() or lse.isnan().any())
            errors[f"{hq}q{hk}kv_from{q_head_start}_r{ranks}_d{d}_s{splits}_p{programs}"] = dict(
                rel_err=rel, lse_max_abs=lse_err, nan=nan, padding_ok=empty_ok, splits=launch.num_splits)
    return errors


def time_shapes(config, shapes, full: bool) -> list[dict]:
    import torch

    from benchmarks.kernels import kernel_peers
    from benchmarks.kernels.bench_kernels import _as_pages, _prefix_setup
    from benchmarks.common import graph_ms
    from dcp_plugin.kernels.prefix_attention import plan_prefix

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for batch, ctx, hq, hk, *mixed in shapes:
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen)
        if mixed:  # varied contexts: what a static deal of items over programs meets in serving
            lens = torch.randint(ctx // 8, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
            kv_bytes = kv_bytes * int(lens.sum()) // (batch * ctx)
        kc64, vc64, tables64 = _as_pages(kc, vc, tables, PAGE, gen)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        kw = dict(scale=q.shape[-1] ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx,
                  max_query_len=1)
        plans = {"gluon": plan_prefix(q, kc64, vc64, tables64[0], lens, qsl, out, lse, gluon_decode=tuple(config),
                                      **kw)}
        auto = plans["gluon"].num_splits
        plans["gluon_items"] = plan_prefix(q, kc64, vc64, tables64[0], lens, qsl, out, lse,
                                           gluon_decode=(*config, 0), **kw)  # the same config, a program per item
        if full:
            for name, splits in (("gluon_half", max(1, auto // 2)), ("gluon_double", min(256, 2 * auto))):
                if splits != auto:
                    plans[name] = plan_prefix(q, kc64, vc64, tables64[0], lens, qsl, out, lse, num_splits=splits,
                                              gluon_decode=tuple(config), **kw)
        os.environ["DCP_TRITON_GLUON"] = "0"  # the tl kernel, as DCP_TRITON_GLUON=0 ships it
        plans["tl"] = plan_prefix(q, kc64, vc64, tables64[0], lens, qsl, out, lse, **kw)
        del os.environ["DCP_TRITON_GLUON"]
        fns = {name: [lambda i=i, p=p: p(q, kc64, vc64, tables64[i], lens, qsl, out, lse) for i in range(copies)]
               for name, p in plans.items()}
        for suffix, caches in (("", (kc, vc, tables)), ("_p64", (kc64, vc64, tables64)))[:2 if full else 1]:
            for name, fn in kernel_peers.fa3_paged(q, *caches, lens, qsl, max_query_len=1, max_kv_len=ctx,
                                                   causal=True).items():
                fns[name + suffix] = [lambda i=i, fn=fn: fn(i) for i in range(copies)]
        row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, kv_bytes=kv_bytes, mixed=bool(mixed),
                   splits={name: p.num_splits for name, p in plans.items()})
        # Timed once and dropped: a shape's first timing read up to 22% slower at four shapes of runs[3] (the same
        # launch timed again right after), so no variant is timed first any more.
        row["dropped_first_graph_ms"] = graph_ms(next(iter(fns.values())))
        for name, calls in fns.items():
            try:
                row[f"{name}_graph_ms"] = graph_ms(calls)
            except Exception as err:  # one variant failing must not lose the others
                row[f"{name}_error"] = repr(err)[:300]
        if "fa3_graph_ms" in row and "gluon_graph_ms" in row:
            row["gluon_vs_fa3"] = row["fa3_graph_ms"] / row["gluon_graph_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def child(config: tuple, full: bool, out_path: str) -> None:
    import torch
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    result = dict(config=list(config), check=check(config))
    checks = result["check"].values()
    result["ok"] = all(e["rel_err"] <= ERROR_BOUND and not e["nan"] and e["padding_ok"] for e in checks)
    if result["ok"]:
        result["timing"] = time_shapes(config, FULL_SHAPES if full else SWEEP_SHAPES, full)
    Path(out_path).write_text(json.dumps(result))


def compile_only(configs) -> None:
    """Each config compiled for sm_90 here (Triton 3.6, no GPU needed), as ``plan_prefix`` plans it for a group of
    32 and one of 4, with the report ``gluon_chunk_probe.py --compile-only`` prints."""
    import torch
    import triton
    from benchmarks.probes.gluon_chunk_probe import _sm90_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from scripts import compile_for_hopper as ch
    from dcp_plugin.kernels import _gluon, gluon_decode, split_kv

    prefix_attention = importlib.import_module("dcp_plugin.kernels.prefix_attention")  # the package exports a function

    prefix_attention.num_sms = lambda device_index: 132  # an H100 / H200 (no GPU here to ask)
    gluon_decode.num_sms = split_kv.num_sms = prefix_attention.num_sms
    _gluon.decode_takes_gluon = lambda *args: True
    prefix_attention.decode_takes_gluon = _gluon.decode_takes_gluon
    for config in configs:
        for hq, hk in ((32, 1), (32, 8)):
            kc, vc = torch.zeros(2, 40, PAGE, hk, 128, dtype=torch.bfloat16)
            q, table = torch.zeros(4, hq, 128, dtype=torch.bfloat16), torch.zeros(3, 10, dtype=torch.int32)
            lens, qsl = torch.tensor([100, 600, 0], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
            out, lse = torch.zeros_like(q), torch.zeros(4, hq)
            plan = prefix_attention.plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, q_head_start=0,
                                                q_per_kv=hq // hk, kv_head_start=0, max_kv_len=600, max_query_len=1,
                                                num_splits=3, gluon_decode=tuple(config))
            tensors = plan.stage1.kernel_tensors((q, kc, vc, table, lens, qsl, plan.part_out, plan.part_lse, q, q))
            _, signature, _, constants, attrs, options = ch._variant(plan.stage1, tensors)
            compiled = triton.compile(GluonASTSource(fn=plan.stage1.kernel, signature=dict(signature),
                                                     constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            print(config, f"{hq}q{hk}kv", _sm90_report(compiled), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="kernels_h200_gluon_decode")
    parser.add_argument("--configs", help="e.g. '1,4,1 1,4,0' (default: CONFIGS)")
    parser.add_argument("--sweep", action="store_true", help="every config on SWEEP_SHAPES only")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 here (no GPU) and report")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(tuple(json.loads(args.child[0])), args.child[1] == "full", args.child[2])
    configs = [tuple(map(int, c.split(","))) for c in args.configs.split()] if args.configs else CONFIGS
    if args.compile_only:
        return compile_only(configs)
    from benchmarks.common import RESULTS, child_env, gpu_name, module_command, provenance

    path = RESULTS / f"{args.name}.json"  # this call's configs join the file's earlier calls (runs[])
    record = json.loads(path.read_text()) if path.exists() else dict(gpu=gpu_name(), runs=[])
    results = []
    record["runs"].append(dict(provenance=provenance(), configs=results))
    for n, config in enumerate(configs):
        out = Path(f"/tmp/gluon_decode_{'_'.join(map(str, config))}.json")
        out.unlink(missing_ok=True)
        mode = "full" if n == 0 and not args.sweep else "sweep"
        try:
            done = subprocess.run(module_command(__spec__.name, "--child", json.dumps(config), mode, str(out)),
                                  capture_output=True, text=True, env=child_env(),
                                  timeout=CHILD_TIMEOUT_S * (3 if mode == "full" else 1))
            result = json.loads(out.read_text()) if out.exists() else dict(
                config=list(config), error=(done.stdout + done.stderr)[-3000:], returncode=done.returncode)
        except subprocess.TimeoutExpired as err:
            result = dict(config=list(config), error=f"timed out after {err.timeout} s (a hang?)",
                          output=str(err.stdout or "")[-2000:])
        results.append(result)
        print(json.dumps(result)[:3000], flush=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
