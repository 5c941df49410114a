"""Programmatic dependent launch (``kernels/_pdl.py``) off and in each of ``MODES``, side by side in one process:
decode's CUDA-graph replay time over L2-cold copies at the kernel table's shapes, over 64-token pages (the default
mode over 16-token pages too), with and without the cache write before it (a decode layer's kernels: write, split
pass, merge), against FA3 over 16-token pages.

Each variant is timed in ``--rounds`` rounds, the variants taking turns within a round; a row keeps each one's best
(``<name>_us``) and every round's time (``<name>_runs``). Every output is compared with float64 attention first,
its buffer filled with NaN before the call; the run exits 1 above ``bench_kernels.ERROR_BOUND`` or on NaN.

Writes ``benchmarks/results/kernels_h200_pdl.json`` (``rows``, ``gpu``, ``provenance``).

    python -m benchmarks.probes.probe_pdl [--shapes BxCTXxHQxHK,...] [--rounds 3] [--name STEM]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from benchmarks.common import gpu_name, graph_ms, save
from benchmarks.kernels import kernel_peers
from benchmarks.kernels.bench_kernels import ERROR_BOUND, HEAD_DIM, _as_pages, _prefix_error, _prefix_setup
from dcp_plugin.kernels import plan_write_kv
from dcp_plugin.kernels._pdl import programmatic_launches
from dcp_plugin.kernels.prefix_attention import plan_prefix

# name: (stage 1's trigger, the cache write's and the merge's), ``_pdl.TRIGGER`` keys or "off" (launched without).
MODES = {"start": ("start", "start"), "end": ("end", "start"), "exit": ("exit", "start"), "merge": ("off", "start"),
         "end_exit": ("end", "exit")}
SHAPES = [(b, c, 32, 8) for b in (1, 8, 32, 128) for c in (1024, 8192, 32768)] \
    + [(b, c, hq, hk) for hq, hk in ((32, 1), (40, 8)) for b in (1, 8, 32, 128) for c in (8192, 32768)]


def _variants(q, caches: dict, lens, qsl, ctx: int, modes: dict) -> tuple[dict, torch.Tensor]:
    """``({name: (fn(i), check)}, out)``: the decode (and the cache write before it) over each page size, PDL off
    and in each of ``modes`` (over 16-token pages only the first); ``check``: (key_cache, value_cache, tables) to
    compare the output against, or None (a write moves the cache)."""
    batch, hq, _ = q.shape
    hk = next(iter(caches.values()))[0].shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    new_kv = torch.randn(2, batch, hk, HEAD_DIM, dtype=q.dtype, device="cuda")
    kwargs = dict(scale=HEAD_DIM ** -0.5, q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=ctx,
                  max_query_len=1)
    found = {}
    for page, (kc, vc, tables) in caches.items():
        # Each request's last cached token: the slot a decode step writes before attending.
        last = (ctx - 1) // page
        slots = [tables[i][:, last].long() * page + (ctx - 1) % page for i in range(tables.shape[0])]
        for mode in ["off", *modes][: 2 if page < 64 else None]:
            stage1, short = modes.get(mode, ("off", "off"))
            with programmatic_launches(mode != "off", stage1=stage1, short=short):
                launch = plan_prefix(q, kc, vc, tables[0], lens, qsl, out, lse, **kwargs)
                write = plan_write_kv(new_kv[0], new_kv[1], kc, vc, slots[0])
            tag = f"p{page}_{mode}"

            def decode(i=0, launch=launch, kc=kc, vc=vc, tables=tables):
                launch(q, kc, vc, tables[i], lens, qsl, out, lse)

            def layer(i=0, launch=launch, write=write, kc=kc, vc=vc, tables=tables, slots=slots):
                write(new_kv[0], new_kv[1], kc, vc, slots[i], None, None)
                launch(q, kc, vc, tables[i], lens, qsl, out, lse)

            found[f"decode_{tag}"] = (decode, (kc, vc, tables))
            found[f"layer_{tag}"] = (layer, None)
    return found, out


def probe(shape, rounds: int, gen, modes: dict) -> dict:
    batch, ctx, hq, hk = shape
    kv_bytes, copies, q, kc, vc, tables, lens, qsl = _prefix_setup(batch, ctx, hq, hk, gen)
    caches = {16: (kc, vc, tables), 64: _as_pages(kc, vc, tables, 64, gen)}
    variants, out = _variants(q, caches, lens, qsl, ctx, modes)
    row = dict(batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, kv_bytes=kv_bytes, copies=copies)
    for name, (fn, check) in variants.items():
        if check is not None:  # before any write moves the cache
            out.fill_(float("nan"))
            fn()
            row[f"{name}_rel_err"] = _prefix_error(out, q, *check, lens, qsl, rows=2)
    fns = {name: fn for name, (fn, _) in variants.items()}
    fns.update(kernel_peers.fa3_paged(q, kc, vc, tables, lens, qsl, max_query_len=1, max_kv_len=ctx, causal=True))
    for r in range(rounds):
        for name, fn in fns.items():
            try:
                row.setdefault(f"{name}_runs", []).append(1e3 * graph_ms([lambda i=i, fn=fn: fn(i)
                                                                          for i in range(copies)]))
            except Exception as err:  # a peer failing must not lose our numbers
                row[f"{name}_error"] = repr(err)[:300]
    for name in fns:
        if row.get(f"{name}_runs"):
            row[f"{name}_us"] = min(row[f"{name}_runs"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help="BATCHxCTXxHQxHK,... (default: the kernel table's decode shapes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--name", default="kernels_h200_pdl", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    modes = {name: MODES[name] for name in args.modes.split(",")}
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, wrong = [], []
    for shape in shapes:
        row = probe(shape, args.rounds, gen, modes)
        rows.append(row)
        wrong += [k for k, v in row.items() if k.endswith("_rel_err") and not (v <= ERROR_BOUND)]
        times = {k[:-3]: round(v, 1) for k, v in row.items() if k.endswith("_us")}
        print(json.dumps(dict(shape="x".join(map(str, shape)), **times)), flush=True)
        save(args.name, dict(gpu=gpu_name(), rounds=args.rounds, modes=modes, rows=rows))
        torch.cuda.empty_cache()
    for kind in ("decode", "layer"):
        print(f"{kind}, 64-token pages, us: off / " + " / ".join(modes) + " (FA3 over 16, decode only)")
        for row in rows:
            times = " / ".join(f"{row.get(f'{kind}_p64_{m}_us', math.nan):6.1f}" for m in ("off", *modes))
            fa3 = f" ({row.get('fa3_us', math.nan):6.1f})" if kind == "decode" else ""
            print(f"{row['batch']:4d} x {row['ctx']:6d} {row['q_heads']}/{row['kv_heads']}: {times}{fa3}")
    if wrong:
        print(f"WRONG (relative error above {ERROR_BOUND} or NaN): {wrong}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
