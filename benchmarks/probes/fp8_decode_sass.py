"""The fp8 decode's compiled loop for an H100/H200 (sm_90), without a GPU: per launch config, what each warp issues
per iteration of the steady-state KV-tile loop (``scripts/compile_for_hopper.py``'s count), above all its byte-wide
shared-memory loads (``LDS.U8``: V, the second operand of P x V along its tokens, read one byte at a time) against
the same config over a bf16 cache.

A decode of 8 requests, 32 Q / 8 KV heads, head size 128, bf16 queries over an e4m3 (or bf16) cache of 64-token
pages, planned by ``plan_prefix`` as an sm_90 GPU would plan it; configs as ``sweep_kernels.py --fp8-configs`` names
them (``BNxWxSxTMAxAHEADxROWS[xWIDEN[xREGS]]``; ``default``: the kernels' own table). Needs Triton 3.6 (the
device's) and ``TRITON_INTERPRET=0``; writes ``benchmarks/results/<--name>.json``.

    TRITON_INTERPRET=0 python -m benchmarks.probes.fp8_decode_sass [--configs default,128x4x3x0x0x64]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the kernels must be defined for the compiler, not the interpreter")
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.common import repo_relative, save  # noqa: E402
from benchmarks.kernels.sweep_kernels import decode_config  # noqa: E402
from dcp_plugin.kernels import _prefix_tile, split_kv  # noqa: E402
from dcp_plugin.kernels._prefix_config import PrefixConfig  # noqa: E402
from scripts import compile_for_hopper as hopper  # noqa: E402

paged = importlib.import_module("dcp_plugin.kernels.prefix_attention")
paged.num_sms = split_kv.num_sms = lambda device_index: hopper.H100_SMS  # what an sm_90 GPU answers
_prefix_tile.tma_available = lambda device: True
CONFIGS = "default,128x4x3x0x0x64,64x4x4x1x0x64,64x4x6x1x0x64,128x4x2x0x0x64"


def parse(name: str) -> PrefixConfig | None:
    if name == "default":
        return None
    return decode_config(tuple(int(x) for x in name.split("x")), block_m=64)


def decode_loop(config: PrefixConfig | None, cache_dtype: torch.dtype) -> dict:
    """Compile stage 1 of the decode ``config`` plans (CPU tensors stand in) and count its loop."""
    batch, hq, hk, d, page = 8, 32, 8, 128, 64
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
    kv = torch.zeros(64, page, hk, 2 * d, dtype=cache_dtype)
    tables = torch.zeros(batch, 32, dtype=torch.int32)
    lens, qsl = torch.full((batch,), 1024, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)
    out, lse = torch.zeros_like(q), torch.zeros(batch, hq)
    launch = paged.plan_prefix(q, kv[..., :d], kv[..., d:], tables, lens, qsl, out, lse, scale=d ** -0.5,
                               q_head_start=0, q_per_kv=hq // hk, kv_head_start=0, max_kv_len=1024, max_query_len=1,
                               config=config)
    record: dict = {}
    hopper.record_launches(record)
    scales = [torch.ones(1), torch.ones(1)] if cache_dtype != torch.bfloat16 else []
    launch(q, kv[..., :d], kv[..., d:], tables, lens, qsl, out, lse, *scales)
    (stage1, (name, signature, _, constants, attrs, options)), = [
        v for v in record.values() if v[1][0] == "prefix_attention_kernel"]
    compiled = triton.compile(ASTSource(fn=stage1.kernel, signature=dict(signature), constexprs=constants,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options)
    return dict(**hopper.resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                block_n=int(constants["BLOCK_N"]), use_tma=constants["USE_TMA"] is True,
                main_loop=hopper.main_loop(hopper.cuobjdump(compiled.asm["cubin"], "-sass")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=CONFIGS,
                        help="comma-separated: default or BNxWxSxTMAxAHEADxROWS[xWIDEN[xREGS]]")
    parser.add_argument("--name", default="hopper_sass_sm90_fp8_decode", help="results file stem")
    args = parser.parse_args()
    rows = []
    for name in args.configs.split(","):
        for cache in (torch.float8_e4m3fn, torch.bfloat16):
            row = dict(config=name, cache=str(cache).removeprefix("torch."), **decode_loop(parse(name), cache))
            rows.append(row)
            print(f"{name:18s} {row['cache']:13s} tile {row['block_n']:3d} regs {row.get('registers', '?'):>3} "
                  f"loop {row['main_loop']}", flush=True)
    print(f"wrote {repo_relative(save(args.name, dict(target='cuda:90', variants=rows)))}")


if __name__ == "__main__":
    main()
