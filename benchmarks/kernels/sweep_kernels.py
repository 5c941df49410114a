"""Tuning sweeps for the attention kernels on one GPU: each candidate launch config timed in one process, with the
default (``None``: the kernels' own table) first, so a row's gain is read against the default of the same run.

- ``prefill``: ``chunk_attention`` configs ``(block_m, block_n, num_warps, num_stages, tma)`` per head size
  (``--prefill-dims``, 128 and 64 unless given) on each of ``--prefill-shapes`` (2 x 4096 unless given) causal,
  32 Q / 8 KV heads unless ``--prefill-heads`` says otherwise, in TFLOP/s (``tma``: K/V
  through tensor descriptors; 47214dc:benchmarks/results/kernels_h200_sweep2.json timed it as a separate candidate
  kernel, 6-tuples with warp specialization, which gained nothing, before it became this option);
- ``prefix``: ``prefix_attention`` configs ``(block_n, block_m, num_warps, num_stages[, tma[, rows_ahead]])`` on the
  DCP prefix pass; ``fp8prefix``: the same pass over an e4m3 cache (a prefill step's chunk reading its prefix from an
  fp8 cache, as vLLM's chunked prefill does), configs ``(... rows_ahead[, fp8_widen[, fp8_dot]])``, each shape's
  first row the default over the bf16 cache the e4m3 one was rounded from (``fp8: false``, the Gluon prefix pass
  where it serves), for the fp8 / bf16 time, and the row ``config: "copy"`` the pass through a 16-bit copy of the
  pages (``DCP_TRITON_FP8_PREFILL=copy``);
- ``decode`` / ``fp8``: decode configs ``(block_n, num_warps, num_stages[, tma[, rows_ahead[, min_rows[,
  fp8_widen[, max_registers[, last_split_merges]]]]]])`` crossed with split counts, graph replay, GB/s of cache
  bytes read (bf16 / e4m3 cache); ``min_rows`` 64 pads a tile's Q heads to 64 rows, which ``tl.dot`` runs as
  warpgroup MMAs on sm_90;
  ``fp8_widen`` (``PrefixConfig.fp8_widen``): 1 widens an fp8 cache's V tiles to fp16 before their shared-memory
  round trip, 2 K's too; ``max_registers`` caps registers per thread (0: no cap); ``last_split_merges`` 1: a
  balanced decode's last split to finish merges them (no merge launch).

``--page`` sets the cache's page size for both (16, vLLM's default, unless given; ``tma``: whole tiles of one page
through tensor descriptors, which needs pages of at least ``block_n`` tokens).

Each sweep's output is checked against float64 attention before it is timed (an error above the bound drops the
row). Results in ``benchmarks/results/<name>.json``; the chosen configs go into the kernels' tables by hand, each
citing the file.

    python -m benchmarks.kernels.sweep_kernels --only prefill,prefix,decode,fp8 [--name kernels_h200_sweep]
    python -m benchmarks.kernels.sweep_kernels --only prefill --prefill-dims 256 --prefill-heads 16x2 \
        --prefill-shapes 16x1024,4x4096 --name kernels_h200_sweep_d256      # Qwen3-Next / Qwen3.5's attention
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

from benchmarks.common import gpu_name, graph_ms, median_ms, repo_relative, save
from benchmarks.kernels.bench_kernels import (
    DTYPE, ERROR_BOUND, HEAD_DIM, _prefix_error, _prefix_setup,
)
from dcp_plugin.kernels import chunk_attention, prefix_attention


def decode_config(fields: tuple, *, block_m: int):
    """A decode candidate ``(block_n, num_warps, num_stages[, tma[, rows_ahead[, min_rows[, fp8_widen[,
    max_registers[, last_split_merges]]]]]])`` (``--decode-configs``' ``BNxWxS...``, split at ``x``) as a
    ``PrefixConfig``."""
    from dcp_plugin.kernels.prefix_attention import PrefixConfig

    bn, warps, stages, tma, ahead, rows, widen, regs, merges = (*fields, *(0, 0, 16, 0, 0, 0)[len(fields) - 3:])
    return PrefixConfig(block_n=bn, block_m=block_m, num_warps=warps, num_stages=stages, tma=bool(tma),
                        rows_ahead=bool(ahead), min_rows=rows, fp8_widen=widen, max_registers=regs,
                        last_split_merges=bool(merges))


def sweep_decode(shapes, splits_list, configs, *, fp8: bool = False) -> list[dict]:
    """Tuning data: graph-replay time of each launch config (None: the table's) crossed with each split count
    (None: the automatic one); ``config`` is recorded as ``[block_n, num_warps, num_stages, tma, rows_ahead,
    min_rows, fp8_widen, max_registers, last_split_merges]``. ``fp8``: over an e4m3 cache (GB/s of its bytes)."""
    from dcp_plugin.kernels.prefix_attention import pick_config

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    block_m = pick_config(HEAD_DIM, decode=True).block_m
    cfgs = [None, *(decode_config(c, block_m=block_m) for c in configs)]
    for batch, ctx, hq, hk in shapes:
        kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen, page=PAGE_SIZE[0])
        scales = {}
        if fp8:
            scales = dict(k_scale=torch.ones(1, device="cuda"), v_scale=torch.ones(1, device="cuda"))
            kc, vc, kv_bytes = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), kv_bytes // 2
        out = torch.empty_like(q)
        first = len(rows)
        for cfg in cfgs:
            for splits in [None, *splits_list]:
                def call(i, splits=splits, cfg=cfg):
                    prefix_attention(q, kc, vc, tables[i], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0,
                                     q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=1,
                                     num_splits=splits, out=out, config=cfg, **scales)
                row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, fp8=fp8, splits=splits, page=PAGE_SIZE[0],
                           config=None if cfg is None else [cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma,
                                                            cfg.rows_ahead, cfg.min_rows, cfg.fp8_widen,
                                                            cfg.max_registers, cfg.last_split_merges])
                try:
                    out.fill_(float("nan"))
                    call(0)
                    row["rel_err"] = _prefix_error(out, q, kc, vc, tables, lens, qsl, rows=2, **scales)
                    if row["rel_err"] <= ERROR_BOUND:  # NaN fails too: the row keeps its error and no time
                        row["graph_ms"] = graph_ms([lambda i=i: call(i) for i in range(copies)])
                        row["gbs"] = kv_bytes / row["graph_ms"] / 1e6
                except Exception as err:
                    row["error"] = repr(err)[:200]
                rows.append(row)
        best = max((r for r in rows[first:] if "gbs" in r), key=lambda r: r["gbs"], default={})
        print(f"sweep b={batch} ctx={ctx} {hq}/{hk}: auto {rows[first].get('gbs', 0):.0f} GB/s, best "
              f"{best.get('gbs', 0):.0f} GB/s at splits={best.get('splits')} config={best.get('config')}", flush=True)
        torch.cuda.empty_cache()
    return rows


def _check_then_time(row: dict, call, out, error, *, flops: float) -> None:
    """``row["rel_err"]`` of one call into a NaN-poisoned ``out``, then its median time and TFLOP/s if the error is
    within ERROR_BOUND; a config that fails records its error instead."""
    try:
        out.fill_(float("nan"))
        call()
        row["rel_err"] = error()
        if row["rel_err"] <= ERROR_BOUND:
            row["ms"] = median_ms(call)
            row["tflops"] = flops / row["ms"] / 1e9
    except Exception as err:
        row["error"] = repr(err)[:200]


def prefix_config(consts: tuple):
    """A prefix candidate ``(block_n, block_m, num_warps, num_stages[, tma[, rows_ahead[, fp8_widen[, fp8_dot]]]])``
    as a ``PrefixConfig``; None stays None (the kernels' own table)."""
    from dcp_plugin.kernels.prefix_attention import PrefixConfig

    if consts is None:
        return None
    flag = lambda i: len(consts) > i and bool(consts[i])  # noqa: E731
    return PrefixConfig(*consts[:4], tma=flag(4), rows_ahead=flag(5), fp8_widen=consts[6] if len(consts) > 6 else 0,
                        fp8_dot=consts[7] if len(consts) > 7 else None)


@contextlib.contextmanager
def fp8_prefill_setting(value: str):
    """``DCP_TRITON_FP8_PREFILL`` set to ``value`` within, as it was after."""
    from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV

    before = os.environ.get(FP8_PREFILL_ENV)
    os.environ[FP8_PREFILL_ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FP8_PREFILL_ENV)
        else:
            os.environ[FP8_PREFILL_ENV] = before


def sweep_prefix(shapes, configs, *, fp8: bool = False) -> list[dict]:
    """TFLOP/s of each prefix candidate (``prefix_config``) on each ``(batch, q_rows, ctx, hq, hk)``; ``fp8``: over
    an e4m3 cache (unit scales), after the default over the bf16 cache it was rounded from, and then through the
    16-bit copy (``FP8_COPY``, ``DCP_TRITON_FP8_PREFILL=copy``: the copy and the pass over it timed together)."""
    rows = []
    for shape in shapes:
        batch, q_rows, ctx, hq, hk = shape
        _, _, q, kc16, vc16, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk,
                                                               torch.Generator("cuda").manual_seed(6),
                                                               q_rows=q_rows, page=PAGE_SIZE[0])
        out = torch.empty_like(q)
        runs = [(False, None, {})] if fp8 else []
        scales = dict(k_scale=torch.ones(1, device="cuda"), v_scale=torch.ones(1, device="cuda")) if fp8 else {}
        runs += [(fp8, consts, scales) for consts in [None, *([FP8_COPY] if fp8 else []), *configs]]
        for on_fp8, consts, kw in runs:
            kc, vc = (kc16.to(torch.float8_e4m3fn), vc16.to(torch.float8_e4m3fn)) if on_fp8 else (kc16, vc16)
            row = dict(shape=list(shape), page=PAGE_SIZE[0], fp8=on_fp8, config=consts)

            def call(consts=consts, kc=kc, vc=vc, kw=kw):
                with fp8_prefill_setting("copy" if consts == FP8_COPY else "tiles"):
                    prefix_attention(q, kc, vc, tables[0], lens, qsl, scale=HEAD_DIM ** -0.5, q_head_start=0,
                                     q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx, max_query_len=q_rows,
                                     out=out, config=None if consts == FP8_COPY else prefix_config(consts), **kw)
            _check_then_time(row, call, out, lambda kc=kc, vc=vc, kw=kw: _prefix_error(
                out, q, kc, vc, tables, lens, qsl, rows=1, q_limit=128, **kw),
                flops=4 * batch * q_rows * ctx * hq * HEAD_DIM)
            rows.append(row)
            print(f"sweep prefix {shape} fp8={on_fp8} config={row['config']}: {row.get('tflops', 0):.0f} TFLOP/s "
                  f"err {row.get('rel_err', float('nan')):.1e} {row.get('error', '')}", flush=True)
        torch.cuda.empty_cache()
    return rows


def sweep_prefill(head_dims, configs_by_dim, shapes, *, hq: int = 32, hk: int = 8) -> list[dict]:
    """TFLOP/s of each ``(block_m, block_n, num_warps, num_stages, tma)`` per head size on each ``(seqs, seq_len)``
    (causal, every sequence ``seq_len`` long)."""
    from dcp_plugin.kernels.chunk_attention import ChunkConfig

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(9)
    for d in head_dims:
        for seqs, seq_len in shapes:
            rows += _sweep_prefill_shape(d, configs_by_dim[d], seqs, seq_len, hq, hk, gen, ChunkConfig)
            torch.cuda.empty_cache()
    return rows


def _sweep_prefill_shape(d, configs, seqs, seq_len, hq, hk, gen, config_type) -> list[dict]:
    rows = []
    total = seqs * seq_len
    q = torch.randn(total, hq, d, dtype=DTYPE, device="cuda", generator=gen)
    k = torch.randn(total, hk, d, dtype=DTYPE, device="cuda", generator=gen)
    v = torch.randn(total, hk, d, dtype=DTYPE, device="cuda", generator=gen)
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(1, seq_len, -1, d).transpose(1, 2).double() for t in (q[:seq_len], k[:seq_len], v[:seq_len])),
        is_causal=True, enable_gqa=True)
    for consts in [None, *configs]:
        cfg = None if consts is None else config_type(*consts)
        row = dict(head_dim=d, shape=[seqs, seq_len, hq, hk], config=consts)

        def call(cfg=cfg):
            chunk_attention(q, k, v, cu, seq_len, scale=d ** -0.5, q_head_start=0, q_per_kv=hq // hk,
                            kv_head_start=0, out=out, config=cfg)

        def error():
            mine = out[:seq_len].view(1, seq_len, hq, d).transpose(1, 2).double()
            return ((mine - ref[:1]).norm() / ref[:1].norm()).item()

        _check_then_time(row, call, out, error, flops=2 * seqs * seq_len * seq_len * hq * d)
        rows.append(row)
        print(f"sweep prefill D{d} {seqs}x{seq_len} config={consts}: {row.get('tflops', 0):.0f} TFLOP/s "
              f"err {row.get('rel_err', float('nan')):.1e} {row.get('error', '')}", flush=True)
    return rows


def best(rows: list[dict], key: str, group) -> dict:
    """The fastest row of each group (``group(row)`` -> hashable), with its gain over the group's default row."""
    out = {}
    for row in rows:
        if key not in row:
            continue
        g = json.dumps(group(row))
        base = out.setdefault(g, {"default": None, "best": None})
        if row["config"] is None and row.get("splits") is None:
            base["default"] = row[key]
        if base["best"] is None or row[key] > base["best"][key]:
            base["best"] = row
    return out


# Candidates. prefill: (block_m, block_n, num_warps, num_stages, tma); prefix: (block_n, block_m, num_warps,
# num_stages[, tma[, rows_ahead]]); decode: (block_n, num_warps, num_stages[, tma[, rows_ahead[, min_rows[,
# fp8_widen[, max_registers[, last_split_merges]]]]]]).
PREFILL_CONFIGS = {
    128: [(128, 128, 8, 3, False), (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 64, 8, 4, True)],
    64: [(128, 128, 8, 3, True), (128, 64, 4, 3, True), (128, 128, 4, 3, True), (128, 64, 4, 4, False)],
    # D=256 (Qwen3-Next / Qwen3.5: --prefill-dims 256 --prefill-heads 16x2): the default's tiles through tensor
    # descriptors, and smaller ones (Q 128 x 256 bf16 is 64 KiB of the 227 alone; compiled for sm_90 on a CPU each
    # takes 160-224 KiB of shared memory, 128-key tiles two stages deep 288 KiB, which does not fit)
    256: [(128, 64, 8, 2, True), (64, 64, 4, 2, True), (64, 64, 4, 3, True), (128, 32, 8, 3, True),
          (64, 32, 4, 4, True), (64, 64, 8, 3, True)],
}
PREFILL_DIMS = [128, 64]  # --prefill-dims
PREFILL_HEADS = [32, 8]  # Q and KV heads of the prefill sweep, --prefill-heads
PREFILL_SHAPES = [(2, 4096)]  # (sequences, tokens each), --prefill-shapes
PAGE_SIZE = [16]  # the cache's page size for the prefix and decode sweeps (--page)
PREFIX_CONFIGS = [(32, 128, 4, 5), (64, 256, 8, 2), (32, 128, 4, 6), (64, 128, 4, 4), (128, 256, 8, 2)]
PREFIX_SHAPES = [(2, 4096, 32768, 32, 8), (1, 2048, 131072, 32, 8)]
# Over an e4m3 cache (--only fp8prefix, --page 64 as vLLM's blocks for dcp-triton): the default (tl, 64-token tiles
# through descriptors, the fp8 tiles widened in registers), V / K and V widened before their shared-memory round trip,
# and Q x K in fp8; 8 x 2K over 32K: a 32K prompt's late chunk in vLLM's long load.
FP8_PREFIX_CONFIGS = [(64, 128, 4, 2, 1, 1, 1), (64, 128, 4, 2, 1, 1, 2), (64, 128, 4, 3, 1, 1, 1),
                      (64, 64, 4, 3, 1, 1, 1), (64, 128, 8, 2, 1, 1, 1), (64, 128, 4, 2, 1, 1, 1, 1)]
# FP8_COPY: the default table's pass through a 16-bit copy of the pages (``DCP_TRITON_FP8_PREFILL=copy``), which
# serves copies of up to 256 MiB (``fp8_prefill.COPY_MAX_BYTES``: not 8 x 32K, the first shape; 2 x 32K and 1 x 16K).
FP8_COPY = "copy"
FP8_PREFIX_SHAPES = [(8, 2048, 32768, 32, 8), (2, 4096, 32768, 32, 8), (1, 16384, 16384, 32, 8)]
DECODE_SHAPES = [(1, 1024, 32, 8), (8, 1024, 32, 8), (32, 1024, 32, 8), (1, 8192, 32, 8), (8, 8192, 32, 8),
                 (32, 8192, 32, 1), (128, 8192, 32, 1), (8, 32768, 32, 1), (128, 1024, 32, 8)]  # 32 x 1K: 0.81x FA3
DECODE_SPLITS = [1, 2, 4, 8, 16, 32]
# The last three: tiles through tensor descriptors (pages of at least block_n tokens: --page 64) with more copies in
# flight than the default's four stages of 64 tokens, for the rows where FA3 reads more of the copy bandwidth. Tiles
# padded to 64 rows (min_rows 64: warpgroup MMAs on sm_90) were the best of no shape over 64-token pages
# (47214dc:benchmarks/results/kernels_h200_sweep_p64.json); --decode-configs times them again (e.g. 128x4x2x0x0x64).
DECODE_CONFIGS = [(64, 4, 3), (128, 4, 4), (128, 8, 3), (32, 4, 4), (64, 4, 6, 1), (128, 4, 3, 1), (64, 8, 5, 1)]
FP8_SHAPES = [(8, 8192, 32, 8), (8, 32768, 32, 8), (32, 8192, 32, 1), (128, 8192, 32, 8)]
FP8_SPLITS = [4, 8, 16, 32]
# (128, 4, 3): the pointer tiles 16-token pages get, over 64-token pages (which take descriptor tiles by default).
FP8_CONFIGS = [(64, 4, 3), (128, 8, 3), (64, 8, 3), (256, 8, 3), (64, 4, 5), (128, 4, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="prefill,prefix,decode,fp8", help="comma-separated sweeps")
    parser.add_argument("--name", default="kernels_h200_sweep", help="results file stem under benchmarks/results/")
    parser.add_argument("--page", type=int, default=16, help="page size of the prefix and decode sweeps' caches")
    parser.add_argument("--prefix-configs", help="replace the prefix candidates: BNxBMxWxS[xTMA[xAHEAD]],... "
                        "(e.g. 64x256x8x2, 64x128x4x2x1x1; AHEAD: descriptor rows read a chunk ahead)")
    parser.add_argument("--decode-configs", help="replace the decode candidates: "
                        "BNxWxS[xTMA[xAHEAD[xROWS[xWIDEN[xREGS[xMERGE]]]]]],... (e.g. 64x4x3x1x1, 64x4x4x1x0x64, "
                        "128x4x3x0x0x16x1x168; MERGE 1: the last split merges, no merge launch)")
    parser.add_argument("--fp8-configs", help="replace the fp8 decode candidates, as --decode-configs")
    parser.add_argument("--fp8-prefix-configs", help="replace the fp8prefix candidates: "
                        "BNxBMxWxSxTMAxAHEADxWIDENxDOT,... (WIDEN 0-2, DOT 0-2)")
    parser.add_argument("--decode-shapes", help="replace the decode shapes: BATCHxCTXxHQxHK,... (also fp8's)")
    parser.add_argument("--splits", help="replace the fixed split counts timed beside the automatic one (decode and "
                        "fp8): N,N,... or 'none' for the automatic one alone")
    parser.add_argument("--prefill-configs", help="replace the prefill candidates of every --prefill-dims head size: "
                        "BMxBNxWxSxTMA,... (TMA 0/1, e.g. 128x128x8x3x1)")
    parser.add_argument("--prefill-dims", help="the prefill sweep's head sizes: D,... (default 128,64; 256 too)")
    parser.add_argument("--prefill-heads", help="the prefill sweep's Q and KV heads: HQxHK (default 32x8)")
    parser.add_argument("--prefill-shapes", help="replace the prefill shapes: SEQSxLEN,... (e.g. 16x1024,2x4096)")
    args = parser.parse_args()
    PAGE_SIZE[0] = args.page
    if args.prefill_shapes:
        PREFILL_SHAPES[:] = [tuple(int(x) for x in c.split("x")) for c in args.prefill_shapes.split(",")]
    if args.decode_configs:
        DECODE_CONFIGS[:] = [tuple(int(x) for x in c.split("x")) for c in args.decode_configs.split(",")]
    if args.fp8_configs:
        FP8_CONFIGS[:] = [tuple(int(x) for x in c.split("x")) for c in args.fp8_configs.split(",")]
    if args.decode_shapes:
        DECODE_SHAPES[:] = FP8_SHAPES[:] = [tuple(int(x) for x in c.split("x")) for c in args.decode_shapes.split(",")]
    if args.splits:
        DECODE_SPLITS[:] = FP8_SPLITS[:] = [] if args.splits == "none" else [int(x) for x in args.splits.split(",")]
    if args.fp8_prefix_configs:
        FP8_PREFIX_CONFIGS[:] = [tuple(int(x) for x in c.split("x")) for c in args.fp8_prefix_configs.split(",")]
    if args.prefix_configs:
        PREFIX_CONFIGS[:] = [tuple(int(x) for x in c.split("x")) for c in args.prefix_configs.split(",")]
    if args.prefill_dims:
        PREFILL_DIMS[:] = [int(d) for d in args.prefill_dims.split(",")]
        unknown = [d for d in PREFILL_DIMS if d not in PREFILL_CONFIGS]
        if unknown and not args.prefill_configs:
            parser.error(f"--prefill-dims {unknown}: no candidates for that head size; give --prefill-configs or "
                         f"one of {sorted(PREFILL_CONFIGS)}")
    if args.prefill_heads:
        PREFILL_HEADS[:] = [int(x) for x in args.prefill_heads.split("x")]
    if args.prefill_configs:
        for d in PREFILL_DIMS:
            PREFILL_CONFIGS[d] = [(*(int(x) for x in c.split("x")[:4]), c.split("x")[4] == "1")
                                  for c in args.prefill_configs.split(",")]
    results = dict(gpu=gpu_name(), torch=torch.__version__)
    sweeps = {
        "prefill": (lambda: sweep_prefill(PREFILL_DIMS, PREFILL_CONFIGS, PREFILL_SHAPES, hq=PREFILL_HEADS[0],
                                          hk=PREFILL_HEADS[1]), "tflops",
                    lambda r: [r["head_dim"], *r["shape"][:2]]),
        "prefix": (lambda: sweep_prefix(PREFIX_SHAPES, PREFIX_CONFIGS), "tflops", lambda r: r["shape"]),
        "fp8prefix": (lambda: sweep_prefix(FP8_PREFIX_SHAPES, FP8_PREFIX_CONFIGS, fp8=True), "tflops",
                      lambda r: [*r["shape"], r["fp8"]]),
        "decode": (lambda: sweep_decode(DECODE_SHAPES, DECODE_SPLITS, DECODE_CONFIGS), "gbs",
                   lambda r: [r["batch"], r["ctx"], r["q_heads"], r["kv_heads"]]),
        "fp8": (lambda: sweep_decode(FP8_SHAPES, FP8_SPLITS, FP8_CONFIGS, fp8=True), "gbs",
                lambda r: [r["batch"], r["ctx"], r["q_heads"], r["kv_heads"]]),
    }
    for name in args.only.split(","):
        run, key, group = sweeps[name]
        try:
            results[name] = run()
            results[f"{name}_best"] = best(results[name], key, group)
        except Exception as err:
            results[f"{name}_error"] = repr(err)[:500]
            print(results[f"{name}_error"], flush=True)
        save(args.name, results)
    path = save(args.name, results)
    for name in args.only.split(","):
        for group, b in results.get(f"{name}_best", {}).items():
            top = b["best"] or {}
            print(f"BEST {name} {group}: default {b['default']} -> {top.get('tflops', top.get('gbs'))} at "
                  f"config={top.get('config')} splits={top.get('splits')}", flush=True)
    print(f"wrote {repo_relative(path)}")


if __name__ == "__main__":
    main()
