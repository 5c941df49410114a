"""The attention kernels where dcp-triton trails FA3, each launched once inside a profiler range, for Nsight Compute
(``ncu``, which the H200 machine has): the current chunk (2 x 4096, causal; the ``tl`` kernel, the Gluon
prototype's drifting schedule with one program per tile, the shipped persistent Gluon kernel, and FA3), the prefix
pass (2 x 4096 rows over 32K cached tokens, 64-token pages; dcp-triton as it runs there, its tl kernel, and FA3)
and decode (128 requests x 8K, 32 Q / 1 KV heads, 64-token pages; dcp-triton's split pass and merge, FA3). Every
kernel runs once before the range (compiles, warm-up), so ncu sees only the timed launch.

    PYTHONPATH=/tmp/dcp:REPO ncu --clock-control none --profile-from-start off --set full -o OUT/attention -f \\
        python3 -m benchmarks.probes.ncu_attention     # from /tmp, dcp-triton installed in /tmp/dcp (run_h200.sh)
    ncu --import OUT/attention.ncu-rep --page details --csv > OUT/attention_details.csv

Without ncu it prints each kernel's time (CUDA events, after the warm-up), so a call that cannot profile still says
what ran.
"""

from __future__ import annotations


import torch

from benchmarks.kernels import kernel_peers
from benchmarks.kernels.bench_kernels import DTYPE, HEAD_DIM, _prefix_setup
from dcp_plugin.kernels import prefix_attention
from dcp_plugin.kernels.chunk_attention import _pick_config, plan_chunk


def current_chunk(gen) -> dict:
    seqs, length, hq, hk = 2, 4096, 32, 8
    total = seqs * length
    q, k, v = (torch.randn(total, h, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen) for h in (hq, hk, hk))
    cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(total, hq, dtype=torch.float32, device="cuda")
    kw = dict(scale=HEAD_DIM ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0)
    launch = plan_chunk(q, k, v, out, lse, cu, length, **kw,  # the tl kernel, whatever DCP_TRITON_GLUON says
                        config=_pick_config(HEAD_DIM, DTYPE, None, length))
    fns = {"chunk_tl": lambda: launch(q, k, v, out, lse, cu)}
    try:
        from benchmarks.probes.gluon_chunk_probe import launch as gluon_launch

        fns["chunk_gluon"] = lambda: gluon_launch(q, k, v, out, lse, cu, length, config=(128, 2, 0, 0), **kw)
        fns["chunk_gluon_persistent"] = lambda: gluon_launch(q, k, v, out, lse, cu, length, config=("chunk", 1),
                                                             **kw)  # the shipped one
    except Exception as err:  # a Triton without Gluon's Hopper API: the others still run
        print(f"gluon prototype unavailable: {err!r}"[:300], flush=True)
    fns.update({f"chunk_{name}": (lambda fn=fn: fn(0)) for name, fn in
                kernel_peers.fa3_prefill(q, k, v, cu, length).items()})
    return fns


def prefix(gen, *, batch: int, q_rows: int, ctx: int, hq: int, hk: int, label: str) -> dict:
    _, _, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen, q_rows=q_rows, page=64)
    out = torch.empty_like(q)

    def ours():
        prefix_attention(q, kc, vc, tables[0], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0, q_per_kv=hq // hk,
                         kv_head_start=0, max_kv_len=ctx, max_query_len=q_rows, out=out)

    peers = kernel_peers.fa3_paged(q, kc, vc, tables, lens, qsl, max_query_len=q_rows, max_kv_len=ctx,
                                   causal=False)
    fns = {f"{label}_ours": ours, **{f"{label}_{name}": (lambda fn=fn: fn(0)) for name, fn in peers.items()}}
    if q_rows > 1:  # the tl prefix kernel too: on sm_90 with Triton 3.6 prefix_attention runs the Gluon one
        from dcp_plugin.kernels.prefix_attention import GPU_CONFIGS

        fns[f"{label}_tl"] = lambda: prefix_attention(
            q, kc, vc, tables[0], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0, q_per_kv=hq // hk,
            kv_head_start=0, max_kv_len=ctx, max_query_len=q_rows, out=out, config=GPU_CONFIGS[128, False])
    return fns


def main() -> None:
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    fns = {**current_chunk(gen),
           **prefix(gen, batch=2, q_rows=4096, ctx=32768, hq=32, hk=8, label="prefix"),
           **prefix(gen, batch=128, q_rows=1, ctx=8192, hq=32, hk=1, label="decode")}
    for fn in fns.values():  # compile and warm every kernel outside the profiled range
        fn()
    torch.cuda.synchronize()
    times = {}
    for name, fn in fns.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end)
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for name, ms in times.items():
        print(f"{name:24s} {ms * 1e3:9.1f} us (one launch, events)", flush=True)


if __name__ == "__main__":
    main()
