"""One H200 call for the Gluon kernels: the current chunk's prototype (``gluon_chunk_prototype.py``) and the current
chunk and prefix pass dcp-triton ships on sm_90 (``dcp_plugin.kernels.gluon_chunk``,
``dcp_plugin.kernels.gluon_prefix``, the latter checked and timed by ``gluon_prefix_check.py``): are they right, and
faster than the ``tl`` kernels and FA3?

Each config of ``CONFIGS`` runs in a child process with a time limit (a wrong mbarrier phase hangs a
GPU, and the parent must still report): first against float64 attention on a varlen batch (lengths 1 .. 1,000,
32 Q / 8 KV heads, and 8 local Q heads of 32 over 2 KV heads), outputs poisoned with NaN first, then timed by graph
replay on each of ``SHAPES`` beside ``plan_chunk`` and FA3 (when vLLM's FA3 imports) in the same process. A call's
configs are appended to the results file's ``runs`` with the call's provenance.

    python -m benchmarks.probes.gluon_chunk_probe [--name kernels_h200_gluon_probe] [--configs JSON]
    TRITON_INTERPRET=0 python -m benchmarks.probes.gluon_chunk_probe --compile-only   # any machine, Triton 3.6

``--compile-only`` compiles the prototype's schedules (``PROTOTYPE_SCHEDULES``) and the shipped kernels' configs
of ``CONFIGS`` for sm_90 with Triton's own compiler (no GPU) and prints their registers, spills, shared
memory, the instructions a warp issues per key tile (the steady loop's SASS), and whether ptxas serialized the
warpgroup MMAs (its C751x notes: a register an MMA in flight reads or writes is touched, or too few registers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path


# (BLOCK_N, STAGES, OVERLAP, PINGPONG[, PERSISTENT]): gluon_chunk_prototype.py's, one program per block; OVERLAP 1:
# tile i + 1's QK^T under tile i's softmax, 2: FA3's order (QK^T of tile i + 1 with P x V of tile i, the softmax
# under P x V); PINGPONG: the warpgroups take turns issuing (FA3). PERSISTENT 1 (the third call's configs): one
# program per SM over every tile, the prototype of the shipped kernel below, since replaced by it.
# ("prefix", PAGES, STAGES): the prefix pass with key tiles of PAGES 64-token pages; (1, 3), (1, 4) and (2, 2) ran
# as a prototype, (2, 2) won and ships (dcp_plugin.kernels.gluon_prefix; gluon_prefix_check.py checks and times it).
# OVERLAP 3: OVERLAP 2 with the accumulator's rescale between the two issues (FA3's place, under QK^T).
# ("chunk", ORDER[, HEAD_DIM[, STAGES, PRODUCER_FIX[, OVERLAP]]]): the shipped current chunk (gluon_chunk:
# the persistent loop with the V rows past a request zeroed), its tiles dealt round-robin (0), in rounds of
# alternating direction (1, SNAKE) or as pairs of blocks of equal summed cost (2, PAIRS); head size 128 unless given
# (64 too); two stages, the V rows zeroed by each consumer, unless given, whatever the module's defaults
# (PRODUCER_FIX 1: by the producer in place, which leaves room for three stages); OVERLAP 1: FA3's order in each
# warpgroup, the softmax under the previous tile's P x V (unlike the prototype's OVERLAP 2, the diagonal tile's mask
# outside the loop). ("prefix", 2, STAGES[, HEAD_DIM[, PRODUCER_FIX, OVERLAP]]): the shipped prefix pass
# (gluon_prefix_check.py), e.g. at head size 64, or with three stages, the V rows zeroed by the producer and FA3's
# order. The earlier calls' configs are in kernels_h200_gluon_probe.json.
# ("wide", BLOCK_N, STAGES, OVERLAP, PINGPONG): the prototype at head size 256 (Qwen3-Next / Qwen3.5's attention,
# timed at 16 Q / 2 KV heads), where the shipped Gluon chunk does not serve: Q from shared memory (OVERLAP >= 1),
# 64-key tiles two stages deep (192 KiB of shared memory with the two Q buffers). Run them with --configs.
CONFIGS = [("chunk", 1), ("chunk", 0), ("chunk", 2), ("chunk", 2, 128, 3, 1), ("chunk", 2, 128, 2, 0, 1),
           ("chunk", 1, 128, 3, 1, 1), ("chunk", 2, 128, 3, 1, 1), ("chunk", 2, 64), ("chunk", 2, 64, 3, 1, 1),
           ("prefix", 2, 2), ("prefix", 2, 2, 128, 0, 1), ("prefix", 2, 3, 128, 1, 0), ("prefix", 2, 3, 128, 1, 1),
           ("prefix", 2, 2, 64), ("prefix", 2, 3, 64, 1, 1)]
PROTOTYPE_SCHEDULES = [(128, 2, o, p) for o in (0, 1, 2, 3) for p in (0, 1) if not p or o >= 2]  # --compile-only
WIDE_CONFIGS = [("wide", 64, 2, 1, 0), ("wide", 64, 2, 2, 0), ("wide", 64, 2, 3, 0), ("wide", 64, 2, 2, 1),
                ("wide", 64, 2, 3, 1)]  # --compile-only; --configs for a GPU run
SHAPES = [(16, 1024), (4, 2048), (2, 4096), (1, 16384)]  # (sequences, length), 32 Q / 8 KV heads
CHECK_LENS = [1, 17, 64, 127, 128, 129, 300, 1000]
ERROR_BOUND = 1e-2  # relative Frobenius error of a bf16 output (bench_kernels.py's bound)
CHILD_TIMEOUT_S = 60  # a config compiles and runs in about 15 s


def launch(q, k, v, out, lse, cu, max_len, *, scale, q_head_start, q_per_kv, kv_head_start, config):
    from benchmarks.probes.gluon_chunk_prototype import chunk_prototype_kernel

    from dcp_plugin.kernels._schedule import flat_programs

    if config[0] == "chunk":  # the shipped kernel, its tiles dealt in the order config[1] names
        from dcp_plugin.kernels.gluon_chunk import plan_gluon_chunk

        stages, producer_fix, overlap = [*config[3:], *(2, 0, 0)[len(config[3:]):]]  # the missing ones: defaults
        return plan_gluon_chunk(q, k, v, out, lse, cu, scale=scale, q_head_start=q_head_start, q_per_kv=q_per_kv,
                                kv_head_start=kv_head_start, order=config[1], stages=stages,
                                producer_fix=bool(producer_fix), overlap=bool(overlap))(q, k, v, out, lse, cu)
    if config[0] == "wide":  # the prototype at head size 256 (q's)
        config = config[1:]
    block_n, stages, overlap, pingpong, *_ = config  # a fifth entry, PERSISTENT, is the shipped kernel's ancestor
    num_tokens, num_reqs = q.shape[0], cu.shape[0] - 1
    num_q_programs = flat_programs(num_tokens, num_reqs, 128)
    grid = (num_q_programs + 1, q.shape[1])  # + 1: the padding rows' program
    chunk_prototype_kernel[grid](
        q, k, v, out, lse, cu, num_tokens, num_reqs, num_q_programs, scale * 1.4426950408889634, q_head_start,
        q_per_kv, kv_head_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1), HEAD_DIM=q.shape[2], BLOCK_N=block_n, STAGES=stages, OVERLAP=int(overlap),
        PINGPONG=bool(pingpong), num_warps=4)


def chunk_head_dim(config) -> int:
    """A chunk config's head size: its third entry, 128 without one; prototype configs 128, ``wide`` ones 256."""
    if config[0] == "wide":
        return 256
    return config[2] if config[0] == "chunk" and len(config) > 2 else 128


def timed_heads(d: int) -> tuple[int, int]:
    """Q and KV heads of the timed shapes: 16 / 2 at head size 256 (the hybrid models'), else 32 / 8."""
    return (16, 2) if d == 256 else (32, 8)


def check(config) -> dict:
    import torch

    from dcp_plugin.kernels import reference

    d = chunk_head_dim(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = {}
    for hq, hk, q_head_start, q_per_kv in ((32, 8, 0, 4), (8, 2, 8, 16)):
        cu = torch.tensor([0] + CHECK_LENS, device="cuda").cumsum(0).to(torch.int32)
        total, pad = int(cu[-1]), 5  # rows past cu[-1]: a CUDA graph's padding, written as (0, -inf)
        q = torch.randn(total + pad, hq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        k = torch.randn(total + pad, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        v = torch.randn(total + pad, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((total + pad, hq), float("nan"), dtype=torch.float32, device="cuda")
        kw = dict(scale=d ** -0.5, q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=0)
        launch(q, k, v, out, lse, cu, max(CHECK_LENS), config=config, **kw)
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.chunk_attention(q[:total].double(), k[:total].double(), v[:total].double(), cu,
                                                     max(CHECK_LENS), **kw)
        rel = ((out[:total].double() - ref_out).norm() / ref_out.norm()).item()
        lse_err = (lse[:total].double() - ref_lse).abs().max().item()
        nan = bool(out[:total].isnan().any() or lse[:total].isnan().any())
        padding = bool((out[total:] == 0).all() and (lse[total:] == float("-inf")).all())
        errors[f"{hq}q{hk}kv"] = dict(rel_err=rel, lse_max_abs=lse_err, nan=nan, padding_ok=padding)
    return errors


def time_shapes(config) -> list[dict]:
    import torch

    from benchmarks.kernels import kernel_peers
    from benchmarks.common import graph_ms
    from dcp_plugin.kernels.chunk_attention import _pick_config, plan_chunk

    rows, d = [], chunk_head_dim(config)
    hq, hk = timed_heads(d)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for seqs, length in SHAPES:
        total = seqs * length
        q = torch.randn(total, hq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        k = torch.randn(total, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        v = torch.randn(total, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(total, hq, dtype=torch.float32, device="cuda")
        kw = dict(scale=d ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0)
        flops = 2 * 2 * seqs * length * length * hq * d / 2
        tl_launch = plan_chunk(q, k, v, out, lse, cu, length, **kw,  # the tl kernel, whatever DCP_TRITON_GLUON says
                               config=_pick_config(d, torch.bfloat16, None, length))
        fns = {"gluon": lambda: launch(q, k, v, out, lse, cu, length, config=config, **kw),
               "ours_tl": lambda: tl_launch(q, k, v, out, lse, cu)}
        fns.update({name: (lambda fn=fn: fn(0)) for name, fn in kernel_peers.fa3_prefill(q, k, v, cu, length).items()})
        row = dict(num_seqs=seqs, seq_len=length, head_dim=d, heads=[hq, hk])
        for name, fn in fns.items():
            try:
                ms = graph_ms([fn])
                row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
            except Exception as err:  # one peer failing must not lose the others
                row[f"{name}_error"] = repr(err)[:300]
        rows.append(row)
    return rows


def child(config: tuple, out_path: str) -> None:
    import torch
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if config[0] == "prefix":
        from benchmarks.probes.gluon_prefix_check import check_prefix as check_fn, time_prefix as time_fn
    else:
        check_fn, time_fn = check, time_shapes
    result = dict(config=list(config), check=check_fn(config))
    worst = max(e["rel_err"] for e in result["check"].values())
    nan = any(e["nan"] for e in result["check"].values())
    padding = all(e["padding_ok"] for e in result["check"].values())
    result["ok"] = worst <= ERROR_BOUND and not nan and padding
    if result["ok"]:
        result["timing"] = time_fn(config)
    Path(out_path).write_text(json.dumps(result))


def _sm90_report(compiled) -> str:
    """Registers, spills, shared memory, the steady loop's instructions and MMAs (per warp and key tile), and the
    ptxas notes (C751x) that say it serialized the warpgroup MMAs, of a kernel compiled for sm_90."""
    import re
    import tempfile

    import triton

    from scripts import compile_for_hopper as ch

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    loop = ch.main_loop(ch.cuobjdump(compiled.asm["cubin"], "-sass"))
    notes = sorted(set(re.findall(r"C751\d", log))) or "no"
    return (f"{ch.resource_usage(compiled.asm['cubin'])} shared {compiled.metadata.shared} loop "
            f"{loop.get('instructions')} instructions / {loop.get('mma')} MMAs, serialized {notes}")


def compile_only() -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from scripts import compile_for_hopper as ch
    from benchmarks.probes.gluon_chunk_prototype import chunk_prototype_kernel

    from dcp_plugin.kernels import gluon_chunk

    target = GPUTarget("cuda", 90, 32)
    for config in [*PROTOTYPE_SCHEDULES, *WIDE_CONFIGS]:
        head_dim = chunk_head_dim(config)
        block_n, stages, overlap, pingpong = config[1:] if config[0] == "wide" else config
        fn = chunk_prototype_kernel
        signature, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name.endswith("_ptr"):
                signature[name] = {"lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "table_ptr": "*i32",
                                   "kv_lens_ptr": "*i32"}.get(name, "*bf16")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "constexpr" if name.isupper() or name == "stride_lh" else (
                    "fp32" if name == "qk_scale" else "i32")
                if name.startswith("stride_") and name != "stride_lh":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        constants = dict(HEAD_DIM=head_dim, STAGES=stages, stride_lh=1, BLOCK_N=block_n, OVERLAP=overlap,
                         PINGPONG=bool(pingpong))
        compiled = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                                  target=target, options=dict(num_warps=4))
        print("prototype", config, _sm90_report(compiled), flush=True)
    gluon_chunk.num_sms = lambda device_index: 132  # an H100 / H200 (no GPU here to ask)
    for config in [c for c in CONFIGS if c[0] == "chunk"]:  # the shipped kernel, as launch() plans it
        d, cu = chunk_head_dim(config), torch.tensor([0, 100, 300], dtype=torch.int32)
        q, k = torch.zeros(300, 8, d, dtype=torch.bfloat16), torch.zeros(300, 2, d, dtype=torch.bfloat16)
        out, lse = torch.zeros_like(q), torch.zeros(300, 8)
        stages, producer_fix, overlap = [*config[3:], *(2, 0, 0)[len(config[3:]):]]
        plan = gluon_chunk.plan_gluon_chunk(q, k, k, out, lse, cu, scale=0.1, q_head_start=0, q_per_kv=4,
                                            kv_head_start=0, order=config[1], stages=stages,
                                            producer_fix=bool(producer_fix), overlap=bool(overlap))
        _, signature, _, constants, attrs, options = ch._variant(plan, plan.kernel_tensors((q, k, k, out, lse, cu)))
        compiled = triton.compile(GluonASTSource(fn=plan.kernel, signature=dict(signature), constexprs=constants,
                                                 attrs=attrs), target=target, options=options)
        print("shipped", config, _sm90_report(compiled), flush=True)
    from dcp_plugin.kernels import gluon_prefix

    for config in [c for c in CONFIGS if c[0] == "prefix"]:  # as gluon_prefix_check.launch_prefix plans it
        d = config[3] if len(config) > 3 else 128
        q, buf = torch.zeros(300, 8, d, dtype=torch.bfloat16), torch.zeros(20, 64, 2, 2 * d, dtype=torch.bfloat16)
        table, lens = torch.zeros(2, 10, dtype=torch.int32), torch.tensor([100, 600], dtype=torch.int32)
        out, lse, cu = torch.zeros_like(q), torch.zeros(300, 8), torch.tensor([0, 100, 300], dtype=torch.int32)
        producer_fix, overlap = [*config[4:], 0, 0][:2]
        plan = gluon_prefix.plan_gluon_prefix(q, buf[..., :d], buf[..., d:], table, lens, cu, out, lse, scale=0.1,
                                              q_head_start=0, q_per_kv=4, kv_head_start=0, stages=config[2],
                                              producer_fix=bool(producer_fix), overlap=bool(overlap))
        tensors = plan.kernel_tensors((q, buf[..., :d], buf[..., d:], table, lens, cu, out, lse, q, q))
        _, signature, _, constants, attrs, options = ch._variant(plan, tensors)
        compiled = triton.compile(GluonASTSource(fn=plan.kernel, signature=dict(signature), constexprs=constants,
                                                 attrs=attrs), target=target, options=options)
        print("shipped", config, _sm90_report(compiled), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="kernels_h200_gluon_probe")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 here (no GPU) and report")
    parser.add_argument("--configs", help="a JSON list of configs to run instead of CONFIGS, e.g. "
                        "'[[\"wide\", 64, 2, 2, 0]]' (WIDE_CONFIGS: the prototype at head size 256)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        configs = [tuple(c) for c in json.loads(args.configs)] if args.configs else CONFIGS
    except (ValueError, TypeError) as error:
        parser.error(f"--configs must be a JSON list of config lists, e.g. '[[\"wide\", 64, 2, 2, 0]]': {error}")
    if args.compile_only:
        return compile_only()
    if args.child:
        return child(tuple(json.loads(args.child[0])), args.child[1])
    from benchmarks.common import RESULTS, child_env, gpu_name, module_command, provenance

    path = RESULTS / f"{args.name}.json"  # this call's configs join the file's earlier calls (runs[])
    record = json.loads(path.read_text()) if path.exists() else dict(gpu=gpu_name(), runs=[])
    results = []
    record["runs"].append(dict(provenance=provenance(), configs=results))
    for config in configs:
        out = Path(f"/tmp/gluon_probe_{'_'.join(map(str, config))}.json")
        out.unlink(missing_ok=True)
        try:
            done = subprocess.run(module_command(__spec__.name, "--child", json.dumps(config), str(out)),
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=child_env())
            result = json.loads(out.read_text()) if out.exists() else dict(
                config=list(config), error=(done.stdout + done.stderr)[-2000:], returncode=done.returncode)
        except subprocess.TimeoutExpired:
            result = dict(config=list(config), error=f"timed out after {CHILD_TIMEOUT_S} s (a hang?)")
        results.append(result)
        print(json.dumps(result)[:1500], flush=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
