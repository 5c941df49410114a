"""Compile, without a GPU, every kernel variant a serving engine runs, for an H100/H200 (sm_90), and report each
one's registers, spills and steady-state loop (instructions per warp and iteration, from the SASS).

The variants are the ones ``dcp_plugin.warmup`` compiles: the dummy steps run through ``DcpAttention`` on CPU
tensors with kernel plans that record their launches instead of running them (at DCP = 1 and DCP = 2, both comm
modes, caches in the model dtype and in fp8 e4m3 / e5m2, pages of 16 and 64 tokens; over e4m3 also with the products
in fp8, ``DCP_TRITON_FP8_DOT`` 1 and 2; over e4m3 and e5m2 also with a prefill's pages widened into a 16-bit copy,
``DCP_TRITON_FP8_PREFILL=copy``), with the Hopper selections (tensor descriptors) on, as an sm_90 GPU would answer:
the ``tl`` kernels (``DCP_TRITON_GLUON=0``), then with Triton 3.6 a second time with the Gluon kernels on (the
default there). Each recorded launch is compiled ahead of time with Triton's own compiler for ``cuda:90``,
specialized the way Triton's dispatch specializes it (integer arguments equal to 1 become constants, multiples of 16
and pointers are marked 16-divisible). A kernel that does not compile for the GPU fails here, on any machine with
Triton.

    TRITON_INTERPRET=0 python -m scripts.compile_for_hopper [--dtype bfloat16] [--head-dim 128] [--json OUT]

``--json``: ``variants`` (one row per variant: registers, local_bytes, shared, main_loop) and ``provenance``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the kernels must be defined for the compiler, not the interpreter")
os.environ["TRITON_INTERPRET"] = "0"  # before dcp_plugin.kernels decides (no GPU would pick the interpreter)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402

import dcp_plugin as dp  # noqa: E402
from dcp_plugin import kernels  # noqa: E402
from dcp_plugin.kernels import _gluon, _launch, _pdl, _prefix_tile, split_kv  # noqa: E402
from dcp_plugin.kernels._prefix_config import FP8_DOT_ENV  # noqa: E402
from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV  # noqa: E402
from dcp_plugin.warmup import warm_up  # noqa: E402

H100_SMS = 132
_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
          torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


class NoCollectives:
    """One rank of a group whose collectives do nothing (only the launches between them are recorded)."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank_in_group = world_size, 0

    def all_gather_into(self, out, t):
        pass

    reduce_scatter_into = all_to_all_into = all_gather_into


def record_launches(record: dict) -> None:
    """Make every ``Launch`` record its variant (keyed by what Triton specializes on) instead of running."""

    def call(launch, *tensors):
        key = _variant(launch, launch.kernel_tensors(tensors))
        record.setdefault((key[0], key[1], key[2]), (launch, key))

    _launch.Launch.__call__ = call


def _variant(launch, tensors) -> tuple:
    """What Triton's dispatch would specialize a launch on: pointer dtypes, scalars (1 / 16-divisible), constants."""
    fn = launch.kernel
    names = list(fn.arg_names)
    dns = {names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    unaligned = {names[i] if isinstance(i, int) else i for i in fn.do_not_specialize_on_alignment}
    dtypes = [t.dtype for t in tensors]
    signature, constants, attrs = {}, dict(launch.constexprs), {}
    values = [None] * len(dtypes) + list(launch.scalars)
    for i, name in enumerate(names[:len(values)]):
        value = values[i]
        if i < len(dtypes):
            signature[name] = _TYPES[dtypes[i]]
            if name not in unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif name not in dns and value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
            if name not in dns and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in launch.constexprs:
        signature[name] = "constexpr"
    frozen = tuple(sorted((k, str(v)) for k, v in constants.items()))
    return (fn.__name__, tuple(signature.items()), frozen, constants, attrs, dict(launch.options))


def _sm90_pdl(device, role: str = "short") -> int:
    """``_pdl.pdl_for`` as an sm_90 GPU answers it by default."""
    return _pdl.TRIGGER[_pdl.DEFAULT_TRIGGERS[role]]


def collect(dtype: torch.dtype, head_dim: int, cache_dtypes: tuple) -> dict:
    """Every launch the warm-up steps prepare at DCP = 1 and 2 (8 local Q heads, 1 stored KV head), for caches of
    each of ``cache_dtypes`` (None: the model dtype)."""
    record: dict = {}
    record_launches(record)
    for n, comm, cache_dtype, page in [(n, c, d, p) for n in (1, 2) for c in ("ag_rs", "a2a") for d in cache_dtypes
                                       for p in (16, 64)]:
        parallel = dp.ParallelState.from_tp(tp_rank=0, tp_size=2, dcp_size=n)
        heads = dp.HeadLayout.create(total_q_heads=16, total_kv_heads=1, parallel=parallel, kv_replication="tp")
        tokens = dp.TokenLayout.create(parallel=parallel, block_size=page)
        attn = dp.DcpAttention(heads=heads, tokens=tokens, group=NoCollectives(n) if n > 1 else None,
                               scale=head_dim ** -0.5, comm=comm, kernel_impl="triton")
        qkv = torch.zeros(4, heads.num_q_heads + 2, head_dim, dtype=dtype)
        kv = torch.zeros(8, page, 1, 2 * head_dim, dtype=cache_dtype or dtype)
        scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) if cache_dtype else {}
        warm_up(attn, query=qkv[:, :-2], key=qkv[:, -2:-1], value=qkv[:, -1:], key_cache=kv[..., :head_dim],
                value_cache=kv[..., head_dim:], output=torch.zeros(4, heads.num_q_heads, head_dim, dtype=dtype),
                **scales)
    return record


def fp8_copy_collect(dtype: torch.dtype, head_dim: int) -> dict:
    """``collect`` over fp8 caches with a prefill step's pages widened into a 16-bit copy first
    (``DCP_TRITON_FP8_PREFILL=copy``, the default): the copy's kernel and the passes over the copy; the other
    ``collect`` calls read the fp8 tiles in the pass (``tiles``)."""
    os.environ[FP8_PREFILL_ENV] = "copy"
    try:
        return collect(dtype, head_dim, (torch.float8_e4m3fn, torch.float8_e5m2))
    finally:
        os.environ[FP8_PREFILL_ENV] = "tiles"


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump ``flag`` on the cubin ('' if it cannot run)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            return subprocess.run([tool, flag, f.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return ""


def resource_usage(cubin: bytes) -> dict:
    """Registers and local-memory bytes (spills) per thread, from the cubin."""
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", cuobjdump(cubin, "--dump-resource-usage"))
    return {"registers": int(found[1]), "local_bytes": int(found[2])} if found else {}


def main_loop(sass: str) -> dict:
    """What each warp issues per iteration of the kernel's steady-state loop: the smallest loop (a backward branch
    and its target, the branch before the kernel's last EXIT: the wait-and-retry blocks placed after it jump back
    into loops too) that holds tensor-core instructions, the attention kernels' unmasked KV-tile loop. Where that
    loop sits inside a chunk loop (decode's rows read ahead), the chunk's own work is not counted. ``{}`` for
    kernels without one. Also its program-wide barriers (``cta_barriers``) and its waits for tensor-core work
    (``mma_waits``)."""
    code = [(int(m[1], 16), m[2].split()[0]) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*[^;]*);", sass)]
    last_exit = max((addr for addr, op in code if op == "EXIT"), default=float("inf"))
    branches = [(int(m[1], 16), int(m[2], 16)) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?(0x[0-9a-f]+)", sass)]
    loops = []
    for end, start in [(end, start) for end, start in branches if end < last_exit]:
        body = [op for addr, op in code if start <= addr <= end]
        if start < end and any("MMA" in op for op in body):
            loops.append(body)
    if not loops:
        return {}
    body = min(loops, key=len)
    return {"instructions": len(body), "mma": sum("MMA" in op for op in body),
            "shared_byte_loads": sum(op.startswith("LDS.U8") or op.startswith("LDS.S8") for op in body),
            "fp8_converts": sum(op.startswith("F2FP") and ("E4M3" in op or "E5M2" in op) for op in body),
            # Program-wide barriers: every warp of the program waits at each, so its warpgroups move in lockstep.
            "cta_barriers": sum(op.startswith("BAR.SYNC") for op in body),
            # Waits for tensor-core work (wgmma groups): how often the loop stops until its products are done.
            "mma_waits": sum(op.startswith("WARPGROUP.DEPBAR") for op in body)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", help="write the per-variant report here")
    args = parser.parse_args()
    for module in (sys.modules[kernels.prefix_attention.__module__], split_kv):  # no GPU to ask
        module.num_sms = lambda device_index: H100_SMS
    for module in (_prefix_tile, sys.modules[kernels.chunk_attention.__module__]):  # what an sm_90 GPU answers
        module.tma_available = lambda device: True
    for module in (sys.modules[kernels.prefix_attention.__module__], split_kv,
                   sys.modules[kernels.write_kv_cache.__module__]):  # programmatic dependent launches: sm_90 takes them
        module.pdl_for = _sm90_pdl
    dtype, cache_dtypes = getattr(torch, args.dtype), (None, torch.float8_e4m3fn, torch.float8_e5m2)
    os.environ.pop(FP8_DOT_ENV, None)  # the default products first
    os.environ[FP8_PREFILL_ENV] = "tiles"  # each fp8 tile read in the pass; the copy apart (fp8_copy_collect)
    _gluon.gluon_enabled = lambda device: False  # the tl selections first (DCP_TRITON_GLUON=0)
    record = collect(dtype, args.head_dim, cache_dtypes)
    for products in ("1", "2"):  # an e4m3 cache's prefix-pass products in fp8 (DCP_TRITON_FP8_DOT, off by default)
        os.environ[FP8_DOT_ENV] = products
        record = {**record, **collect(dtype, args.head_dim, (torch.float8_e4m3fn,))}
    os.environ.pop(FP8_DOT_ENV)
    record = {**record, **fp8_copy_collect(dtype, args.head_dim)}
    if triton.__version__.startswith(_gluon.GLUON_TRITON):  # then with the Gluon kernels on (the default on sm_90)
        from dcp_plugin.kernels import gluon_chunk, gluon_decode

        gluon_chunk.num_sms = gluon_decode.num_sms = lambda device_index: H100_SMS
        gluon_decode.pdl_for = _sm90_pdl
        _gluon.gluon_enabled = lambda device: True
        record = {**collect(dtype, args.head_dim, cache_dtypes), **fp8_copy_collect(dtype, args.head_dim), **record}
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for launch, (name, signature, _, constants, attrs, options) in record.values():
        began = time.perf_counter()
        source = GluonASTSource if isinstance(launch.kernel, GluonJITFunction) else ASTSource
        src = source(fn=launch.kernel, signature=dict(signature), constexprs=constants, attrs=attrs)
        compiled = triton.compile(src, target=target, options=options)
        usage = resource_usage(compiled.asm["cubin"])
        loop = main_loop(cuobjdump(compiled.asm["cubin"], "-sass"))
        rows.append(dict(kernel=name, constants={k: str(v) for k, v in constants.items()},
                         kv_cache=dict(signature).get("key_cache_ptr"), **options, **usage,
                         shared=compiled.metadata.shared, main_loop=loop,
                         pdl_wait="griddepcontrol.wait" in compiled.asm["ptx"],
                         seconds=round(time.perf_counter() - began, 1)))
        print(f"{name:30s} regs {usage.get('registers', '?'):>3} local {usage.get('local_bytes', '?'):>4} "
              f"smem {compiled.metadata.shared:6d} loop {loop.get('instructions', '-'):>4} {options} "
              f"{ {k: v for k, v in constants.items() if k.isupper()} }", flush=True)
    print(f"{len(rows)} variants compiled for sm_90 (Triton {triton.__version__})")
    if args.json:  # with the provenance benchmarks/common.py gives every results file
        from benchmarks.common import provenance

        with open(args.json, "w") as f:
            json.dump({"target": "cuda:90", "dtype": args.dtype, "head_dim": args.head_dim,
                       "provenance": provenance(), "variants": rows}, f, indent=1)


if __name__ == "__main__":
    main()
