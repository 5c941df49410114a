"""The shipped Gluon prefix pass's (``dcp_plugin.kernels.gluon_prefix``) launch, float64 check and timing against
the ``tl`` kernel and FA3, for ``gluon_chunk_probe.py`` (which runs each config in a child process): config
``("prefix", 2, STAGES[, HEAD_DIM[, PRODUCER_FIX, OVERLAP]])`` (two 64-token pages a key tile, the kernel's own;
``STAGES`` key tiles in flight; head size 128 unless given; ``gluon_prefix.PRODUCER_FIX`` and ``OVERLAP`` off unless
given)."""

from __future__ import annotations

PREFIX_SHAPES = [(2, 4096, 32768), (1, 2048, 131072)]  # (requests, query rows each, cached tokens), 32 Q / 8 KV
CHECK_Q_LENS = [1, 17, 130, 300]
CHECK_KV_LENS = [0, 5, 64, 700]  # none, part of a page, one page, 10 pages and a part
PAGE = 64


def head_dim(config) -> int:
    """A prefix config's head size: its fourth entry, 128 without one."""
    return config[3] if len(config) > 3 else 128


def launch_prefix(q, kc, vc, table, kv_lens, cu, out, lse, *, scale, q_head_start, q_per_kv, kv_head_start,
                  config):
    """The shipped Gluon prefix pass (``dcp_plugin.kernels.gluon_prefix``), launched directly as ``config`` says."""
    from dcp_plugin.kernels.gluon_prefix import plan_gluon_prefix

    producer_fix, overlap = [*config[4:], 0, 0][:2]
    plan_gluon_prefix(q, kc, vc, table, kv_lens, cu, out, lse, scale=scale, q_head_start=q_head_start,
                      q_per_kv=q_per_kv, kv_head_start=kv_head_start, stages=config[2],
                      producer_fix=bool(producer_fix), overlap=bool(overlap))(q, kc, vc, table, kv_lens, cu, out, lse,
                                                                              None, None)


def check_prefix(config) -> dict:
    """Against float64 on a varlen batch whose caches hold NaN everywhere but at each request's cached tokens (a
    kernel that lets a row past a context count turns NaN), outputs poisoned, 5 padding rows."""
    import torch

    from dcp_plugin.kernels import reference

    d = head_dim(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = {}
    for hq, hk, q_head_start, q_per_kv in ((32, 8, 0, 4), (8, 2, 8, 16)):
        cu = torch.tensor([0] + CHECK_Q_LENS, device="cuda").cumsum(0).to(torch.int32)
        total, pad = int(cu[-1]), 5
        kv_lens = torch.tensor(CHECK_KV_LENS, dtype=torch.int32, device="cuda")
        width = max(1, -(-max(CHECK_KV_LENS) // PAGE))
        num_pages = width * len(CHECK_KV_LENS) + 3
        kc = torch.full((num_pages, PAGE, hk, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        vc = torch.full_like(kc, float("nan"))
        table = torch.randperm(num_pages, generator=gen, device="cuda")[:width * len(CHECK_KV_LENS)]
        table = table.to(torch.int32).view(len(CHECK_KV_LENS), width)
        for b, n in enumerate(CHECK_KV_LENS):  # real tokens only where the request has them
            pos = torch.arange(n, device="cuda")
            rows = table[b, pos // PAGE].long()
            kc[rows, pos % PAGE] = torch.randn(n, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
            vc[rows, pos % PAGE] = torch.randn(n, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
        q = torch.randn(total + pad, hq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((total + pad, hq), float("nan"), dtype=torch.float32, device="cuda")
        kw = dict(scale=d ** -0.5, q_head_start=q_head_start, q_per_kv=q_per_kv, kv_head_start=0)
        launch_prefix(q, kc, vc, table, kv_lens, cu, out, lse, **kw, config=config)
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.prefix_attention(q[:total].double(), kc.double(), vc.double(), table, kv_lens,
                                                      cu, max_kv_len=max(CHECK_KV_LENS), **kw)
        rel = ((out[:total].double() - ref_out).norm() / ref_out.norm()).item()
        got_lse = lse[:total].double()
        finite = torch.isfinite(ref_lse)
        lse_err = (got_lse[finite] - ref_lse[finite]).abs().max().item()
        inf_ok = bool((got_lse[~finite] == ref_lse[~finite]).all())  # no cached token: -inf, exactly
        nan = bool(out[:total].isnan().any() or lse[:total].isnan().any())
        padding = bool((out[total:] == 0).all() and (lse[total:] == float("-inf")).all())
        errors[f"{hq}q{hk}kv"] = dict(rel_err=rel, lse_max_abs=lse_err, nan=nan or not inf_ok, padding_ok=padding)
    return errors


def time_prefix(config) -> list[dict]:
    """TFLOP/s of ``PREFIX_SHAPES`` over 64-token pages, median of ``do_bench`` (``bench_kernels.bench_prefix``'s
    timing: a call of several ms makes its launch negligible): the prototype, the shipped kernel
    (``prefix_attention``) and FA3, in one process."""
    import torch

    from benchmarks.kernels import kernel_peers
    from benchmarks.kernels.bench_kernels import _prefix_setup
    from benchmarks.common import median_ms

    from dcp_plugin.kernels import prefix_attention
    from dcp_plugin.kernels.prefix_attention import GPU_CONFIGS

    rows, d = [], head_dim(config)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for batch, q_rows, ctx in PREFIX_SHAPES:
        _, _, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, 32, 8, gen, q_rows=q_rows, page=PAGE,
                                                           head_dim=d)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        kw = dict(scale=d ** -0.5, q_head_start=0, q_per_kv=4, kv_head_start=0)
        fns = {"gluon": lambda: launch_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, **kw, config=config),
               "ours_tl": lambda: prefix_attention(q, kc, vc, tables[0], lens, qsl, max_kv_len=ctx,
                                                   max_query_len=q_rows, out=out, config=GPU_CONFIGS[d, False],
                                                   **kw)}
        fns.update({name: (lambda fn=fn: fn(0)) for name, fn in kernel_peers.fa3_paged(
            q, kc, vc, tables, lens, qsl, max_query_len=q_rows, max_kv_len=ctx, causal=False).items()})
        flops = 4 * batch * q_rows * ctx * 32 * d
        row = dict(batch=batch, q_rows=q_rows, ctx=ctx, page=PAGE, head_dim=d)
        for name, fn in fns.items():
            try:
                ms = median_ms(fn)
                row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
            except Exception as err:  # one peer failing must not lose the others
                row[f"{name}_error"] = repr(err)[:300]
        rows.append(row)
        fns = kc = vc = q = None  # the next shape's caches in their memory
        torch.cuda.empty_cache()
    return rows
