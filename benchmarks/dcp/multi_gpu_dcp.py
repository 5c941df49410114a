"""DCP attention on N real ranks (NCCL; gloo on CPU): correctness vs single-device attention, and per-step time.

    torchrun --nproc-per-node N -m benchmarks.dcp.multi_gpu_dcp [--quick] [--contexts 8K,32K] [--batches 1,8]
    torchrun --nproc-per-node 2 -m benchmarks.dcp.multi_gpu_dcp --backend gloo --kernels reference --quick   # CPU

Correctness: DCP = N and, when N >= 4, every TP x DCP split (DCP groups of consecutive ranks, TP = N), both head
layouts, both comm modes, a decode step, a chunked-prefill step over a cached prefix (then a decode step), and
decode steps replayed from a CUDA graph captured with its collectives (``decode-graph``: what must pass before the
vLLM builder may declare full graphs at DCP > 1); the gathered outputs must match float64 attention over the full sequences within the dtype's tolerance, or the
script exits 1 (see multi_gpu_checks.py). Timing: one decode step of one layer (one query token per request),
``DcpAttention.forward`` including its collectives, vs DCP = 1 (every rank alone with the full context), and the
collectives alone with the same shapes; CUDA-graph replay when the step captures, else CUDA events. Rank 0 writes
<results-dir>/<out>.json and .png (default benchmarks/results/multi_gpu_dcp_<N>x<gpu>).
On CPU (gloo) the shapes are tiny and the times mean nothing: that mode only tests the script.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are
set below, before torch (and so NCCL) is imported; keep them set in any wrapper that launches this script.
"""

from __future__ import annotations

import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
OVERRIDDEN = {name: os.environ[name] for name, value in NO_MULTICAST.items() if os.environ.get(name, value) != value}
os.environ.update(NO_MULTICAST)

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import RESULTS, capture_graph, cold_copies, events_ms, gpu_name, replay_ms, save  # noqa: E402
from benchmarks.dcp.multi_gpu_checks import COMMS, CPU_SIZES, GPU_SIZES, all_cases, dcp_splits, run_case  # noqa: E402
import dcp_plugin as dp  # noqa: E402

# Timed (contexts, batches) by (device, --quick). On CPU only the script is tested, so the shapes are tiny.
GRID = {
    ("cuda", False): ((8192, 32768, 131072, 262144), (1, 8, 32, 64)),
    ("cuda", True): ((8192, 65536), (1, 32)),
    ("cpu", False): ((16, 64, 256), (1, 4)),
    ("cpu", True): ((16, 64), (1, 2)),
}


class Run:
    """What every part needs: this rank, its device, dtype, kernels and its DCP subgroup for every split."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world < 2:
            raise ValueError("run it on at least 2 ranks: torchrun --nproc-per-node N with N >= 2")
        if args.backend == "gloo" and args.kernels == "triton" and args.dtype == "bfloat16":
            raise ValueError("--dtype bfloat16 with --backend gloo runs the Triton interpreter, which computes bf16 "
                             "matrix products wrongly; use --dtype float32/float16 or --kernels reference")
        if args.backend == "nccl":
            if torch.cuda.device_count() <= local_rank:
                raise ValueError(f"--backend nccl needs a CUDA GPU per rank (local rank {local_rank}, "
                                 f"{torch.cuda.device_count()} GPUs); use --backend gloo on CPU")
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl", device_id=self.device, timeout=timedelta(minutes=10))
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
            dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        self.cuda = self.device.type == "cuda"
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if self.cuda else "float32"))
        self.sizes = GPU_SIZES if self.cuda else CPU_SIZES
        self.use_graphs = self.cuda and not args.no_graphs and args.kernels == "triton"
        self.ops = args.kernels  # a kernel name: DcpAttention(kernel_impl=...) takes it
        self.splits = dcp_splits(self.world)
        self.groups: dict[int, dp.TorchDcpGroup | None] = {1: None}
        for d in self.splits:  # every rank creates every subgroup, in the same order
            for first in range(0, self.world, d):
                group = dist.new_group(list(range(first, first + d)))
                if first <= self.rank < first + d:
                    self.groups[d] = dp.TorchDcpGroup(group)
        self.gen = torch.Generator(device=self.device).manual_seed(self.rank)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def agree(self, ok: bool) -> bool:
        """True only when every rank says ``ok`` (so no rank enters a collective the others skip)."""
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def slowest(self, ms: float) -> float:
        value = torch.tensor([ms], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())


def time_fns(run: Run, fns: list) -> tuple[float, str]:
    """(slowest rank's median ms per call, timer) of ``fns`` called back to back on every rank."""
    if run.use_graphs:
        graph = None
        try:
            graph = capture_graph(fns)
        except Exception:  # noqa: BLE001 - every rank falls back together below
            print(f"rank {run.rank}: CUDA-graph capture failed, every rank times with events:\n"
                  f"{traceback.format_exc(limit=3)}", flush=True)
        if run.agree(graph is not None):
            return run.slowest(replay_ms(graph, len(fns))), "graph"
    calls = dict(iters=10, repeats=5) if run.cuda else dict(iters=2, repeats=3)  # interpreted kernels are slow
    ms = events_ms(lambda: [fn() for fn in fns], before=dist.barrier, **calls) / len(fns)
    return run.slowest(ms), "events"


def decode_step(run: Run, dcp: int, comm: str, ctx: int, batch: int) -> list:
    """One decode step of ``batch`` requests at context ``ctx`` on this rank, as closures over KV copies.

    Model per rank: ``local_q_heads`` Q heads and one KV head (TP = N, vLLM's ``tp`` layout: the KV head is the
    same across the DCP group), the shape of a GQA model whose TP duplicates its KV heads.
    """
    sizes, device = run.sizes, run.device
    dim, block = sizes.head_dim, sizes.block_size
    parallel = dp.ParallelState.from_tp(tp_rank=run.rank, tp_size=run.world, dcp_size=dcp)
    heads = dp.HeadLayout.create(total_q_heads=sizes.local_q_heads * run.world, total_kv_heads=1, parallel=parallel,
                                 kv_replication="tp")
    tokens = dp.TokenLayout(dcp_size=dcp, dcp_rank=parallel.dcp_rank, block_size=block)
    pages = -(-tokens.max_local_len(ctx + 1) // block)
    table = torch.randperm(batch * pages, device=device, generator=run.gen).to(torch.int32).view(batch, pages)
    index = int(tokens.local_index(ctx))  # the new token (position ctx) of every request
    slots = table[:, index // block].long() * block + index % block
    owned = int(tokens.owner(ctx)) == tokens.dcp_rank
    step = dp.DcpBatch.build(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx + 1, dtype=torch.int32, device=device), block_table=table,
        slot_mapping=slots if owned else torch.full_like(slots, -1), tokens=tokens,
        max_query_len=1, max_seq_len=ctx + 1, max_context_len=ctx)
    attn = dp.DcpAttention(heads=heads, tokens=tokens, group=run.groups[dcp], scale=dim**-0.5, comm=comm,
                           kernel_impl=run.ops)
    q = torch.randn(batch, heads.num_q_heads, dim, dtype=run.dtype, device=device, generator=run.gen)
    k = torch.randn(batch, 1, dim, dtype=run.dtype, device=device, generator=run.gen)
    v, out = torch.randn_like(k), torch.empty_like(q)
    kv_bytes = batch * pages * block * 2 * dim * q.element_size()
    copies = cold_copies(kv_bytes) if run.cuda else 1
    fns = []
    for _ in range(copies):
        kv = torch.randn(batch * pages, block, 1, 2 * dim, dtype=run.dtype, device=device, generator=run.gen)
        fns.append(lambda kv=kv: attn.forward(q, k, v, kv[..., :dim], kv[..., dim:], step, out=out))
    return fns


def collectives(run: Run, dcp: int, comm: str, batch: int):
    """The collectives of that decode step alone, same group, shapes, dtypes and layouts as DcpAttention's."""
    group, dim, local_q = run.groups[dcp], run.sizes.head_dim, run.sizes.local_q_heads
    q = torch.randn(batch, local_q, dim, dtype=run.dtype, device=run.device, generator=run.gen)
    if comm == "ag_rs":
        lse = torch.randn(batch, dcp * local_q, device=run.device, generator=run.gen)
        scaled = torch.randn(dcp * local_q, batch, dim, device=run.device, generator=run.gen).transpose(0, 1)

        def ag_rs() -> None:
            group.all_gather(q, dim=1)
            group.all_gather(lse.unsqueeze(0), dim=0)
            group.reduce_scatter(scaled, dim=1)
        return ag_rs
    packed = torch.randn(batch, dcp, local_q, dim + 1, device=run.device, generator=run.gen)

    def a2a() -> None:
        group.all_gather(q, dim=1)
        group.all_to_all(packed.transpose(0, 1))
    return a2a


def timing(run: Run, contexts: list[int], batches: list[int]) -> list[dict]:
    configs = [(1, "none")] + [(d, comm) for d in sorted(run.splits) for comm in COMMS]
    rows = []
    for ctx in contexts:
        for batch in batches:
            base = None
            for dcp, comm in configs:
                row = dict(ctx=ctx, batch=batch, dcp=dcp, comm=comm)
                fns = None
                try:
                    fns = decode_step(run, dcp, "ag_rs" if dcp == 1 else comm, ctx, batch)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                if not run.agree(fns is not None):
                    rows.append({**row, "skipped": "out of memory"})
                    run.log(f"ctx {ctx:7d} batch {batch:3d} dcp {dcp} {comm:5s}: skipped (out of memory)")
                    continue
                row["step_ms"], row["timer"] = time_fns(run, fns)
                row["copies"] = len(fns)
                del fns
                if dcp == 1:
                    base = row["step_ms"]
                    row["coll_ms"] = 0.0
                else:
                    row["coll_ms"] = time_fns(run, [collectives(run, dcp, comm, batch)])[0]
                row["coll_share"] = row["coll_ms"] / row["step_ms"]
                row["speedup_vs_dcp1"] = base / row["step_ms"] if base else None
                rows.append(row)
                run.log(f"ctx {ctx:7d} batch {batch:3d} dcp {dcp} {comm:5s}: {row['step_ms'] * 1e3:9.1f} us/step "
                        f"({row['timer']}), collectives {row['coll_ms'] * 1e3:8.1f} us "
                        f"({100 * row['coll_share']:4.1f}%), vs DCP 1: {row['speedup_vs_dcp1'] or 0:5.2f}x")
                if run.cuda:
                    torch.cuda.empty_cache()
    return rows


def crossovers(rows: list[dict]) -> list[dict]:
    """Per (DCP, comm, batch): the smallest measured context from which DCP's step is faster than DCP = 1's at
    every larger measured context (None: never)."""
    found = []
    timed = [r for r in rows if r.get("speedup_vs_dcp1") and r["dcp"] > 1]
    for key in sorted({(r["dcp"], r["comm"], r["batch"]) for r in timed}):
        points = sorted((r["ctx"], r["speedup_vs_dcp1"]) for r in timed if (r["dcp"], r["comm"], r["batch"]) == key)
        pays_from = None
        for ctx, speedup in reversed(points):
            if speedup <= 1.0:
                break
            pays_from = ctx
        found.append(dict(dcp=key[0], comm=key[1], batch=key[2], dcp_pays_from_ctx=pays_from))
    return found


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "step_ms" in r]
    batches, contexts = sorted({r["batch"] for r in timed}), sorted({r["ctx"] for r in timed})
    fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 7), squeeze=False, sharex=True)
    for col, batch in enumerate(batches):
        top, bottom = axes[0][col], axes[1][col]
        for dcp, comm in sorted({(r["dcp"], r["comm"]) for r in timed}):
            pts = sorted((r["ctx"], r["step_ms"], r["coll_share"]) for r in timed
                         if (r["batch"], r["dcp"], r["comm"]) == (batch, dcp, comm))
            label = "DCP 1" if dcp == 1 else f"DCP {dcp} {comm}"
            top.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=label,
                     color="k" if dcp == 1 else None)
            if dcp > 1:
                bottom.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", label=label)
        top.set_title(f"batch {batch}")
        top.set_yscale("log")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        bottom.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("attention per step and layer (us)")
    axes[1][0].set_ylabel("collectives alone / step (%)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def finite(value):
    """JSON-safe: non-finite floats become None (a NaN output is also counted in ``nan_count``)."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def sizes_arg(text: str) -> list[int]:
    try:
        values = [int(part[:-1]) * 1024 if part.upper().endswith("K") else int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list like 8K,32K or 1,8; got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller timing grid: GPU contexts "
                        f"{GRID['cuda', True][0]} x batches {GRID['cuda', True][1]}")
    parser.add_argument("--contexts", type=sizes_arg, help="timed contexts, e.g. 8K,32K (GPU default "
                        f"{GRID['cuda', False][0]}; tiny on CPU)")
    parser.add_argument("--batches", type=sizes_arg, help=f"timed batch sizes (GPU default {GRID['cuda', False][1]})")
    parser.add_argument("--backend", choices=("nccl", "gloo"),
                        default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--kernels", choices=("triton", "reference"), default="triton",
                        help="Triton kernels (interpreted on CPU) or the torch references")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 on GPU, float32 on CPU (the interpreter gets bf16 wrong)")
    parser.add_argument("--no-graphs", action="store_true", help="time with CUDA events, never CUDA graphs")
    parser.add_argument("--no-timing", action="store_true", help="correctness only")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--out", help="file name without extension (default multi_gpu_dcp_<N>x<gpu>)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    run = Run(args)
    run.log(f"{run.world} ranks, backend {args.backend}, kernels {args.kernels}, {run.dtype}, DCP splits "
            f"{run.splits}, NVLink multicast off ({', '.join(f'{k}={v}' for k, v in NO_MULTICAST.items())})")
    for name, value in OVERRIDDEN.items():
        run.log(f"note: {name}={value} from the environment was overridden")

    checks = []
    for case in all_cases(run.world):
        result = run_case(case, sizes=run.sizes, groups=run.groups, rank=run.rank, world=run.world,
                          dtype=run.dtype, device=run.device, ops=run.ops)
        if result is not None:
            checks.append(result)
            run.log(f"{result['case']:40s} max rel err {result['max_rel_err']:.2e}  max abs err "
                    f"{result['max_abs_err']:.2e}  {'ok' if result['passed'] else 'FAILED'}")
    passed = run.agree(run.rank != 0 or all(c["passed"] for c in checks))

    default_contexts, default_batches = GRID[run.device.type, args.quick]
    contexts, batches = args.contexts or list(default_contexts), args.batches or list(default_batches)
    rows = timing(run, contexts, batches) if passed and not args.no_timing else []

    if run.rank == 0:
        device_name = gpu_name() if run.cuda else "cpu"
        slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower().replace("nvidia", "")).strip("_")
        name = args.out or f"multi_gpu_dcp_{run.world}x{slug}"
        payload = dict(
            device=device_name, world_size=run.world, backend=args.backend, kernels=args.kernels,
            dtype=str(run.dtype).removeprefix("torch."), torch=torch.__version__,
            nccl=str(torch.cuda.nccl.version()) if run.cuda else None,
            env={name: os.environ.get(name) for name in NO_MULTICAST},
            sizes=vars(run.sizes), passed=passed, correctness=checks,
            timing=dict(model=dict(local_q_heads=run.sizes.local_q_heads, stored_kv_heads=1, tp=run.world,
                                   head_dim=run.sizes.head_dim, block_size=run.sizes.block_size),
                        rows=rows, crossover=crossovers(rows),
                        skipped=None if rows else "correctness failed" if not passed else "--no-timing"),
        )
        path = save(name, finite(payload), results_dir=args.results_dir)
        print(f"wrote {path}", flush=True)
        if rows:
            try:
                plot(rows, f"DCP attention per step, {run.world} x {device_name}, {args.backend}",
                     path.with_suffix(".png"))
                print(f"wrote {path.with_suffix('.png')}", flush=True)
            except ImportError as exc:
                print(f"no plot: {exc}", flush=True)
        for c in crossovers(rows):
            print(f"DCP {c['dcp']} {c['comm']:5s} batch {c['batch']:3d}: pays from context "
                  f"{c['dcp_pays_from_ctx'] or 'never (in the measured range)'}", flush=True)
        if not passed:
            print("CORRECTNESS FAILED: " + ", ".join(c["case"] for c in checks if not c["passed"]), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
