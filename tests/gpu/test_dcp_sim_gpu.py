"""DCP simulated on one GPU (one thread per rank, ``tests.helpers.dcp_harness.ThreadGroup`` moving CUDA tensors), beyond
the GPU tier's mixed batches (``tests/gpu/test_gpu_tier.py``), every output gathered over the group and compared with
float64 single-rank causal attention:

1. speculative-decoding verify steps (k + 1 query rows over a sharded prefix, random acceptance, rejected entries
   written over by the next step) mixed with decodes and prefill chunks, at N = 2 and 4: both head layouts, both
   comm modes, interleave 1 and 16, bf16, head size 128 (the cases and their runner: ``tests/helpers/verify_steps.py``);
2. an fp8 KV cache (e4m3 and e5m2, scales that are not powers of two) at N = 1, 2 and 4, against float64 over the
   dequantized cache: DCP = N and DCP = 1 meet the same bound;
3. 128K cached tokens per rank (N = 2 over a 262K-token context), decode, verify and chunk rows.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dcp_plugin import kernels
from dcp_plugin.testing import Case
from tests.helpers.dcp_harness import ThreadGroup, run_case, run_threads
from tests.helpers.fp8_checks import run_fp8_dcp
from tests.helpers.verify_steps import head_layouts, run_verify_case, verify_case

if not torch.cuda.is_available():
    pytest.skip("the GPU simulation needs a CUDA GPU (run `pytest -m gpu tests/gpu` there)", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _threads(case: Case, n: int, runner) -> list:
    def rank_main(rank, exchange):
        group = ThreadGroup(exchange, rank)
        return runner(case, n, rank, group, lambda out: group.all_gather(out, dim=1))

    return run_threads(n, rank_main, timeout_s=300)


# Every (N, layout, comm, interleave) runs the long mix; N = 2 also runs two of the small mixes (decodes before
# verify rows, a step with verify rows only then a quiet step).
VERIFY = [(n, layout, comm, interleave, "long") for n in (2, 4) for layout in ("tp", "replicated")
          for comm in ("ag_rs", "a2a") for interleave in (1, 16)]
VERIFY += [(2, layout, comm, 16, mix) for layout in ("tp", "replicated") for comm in ("ag_rs", "a2a")
           for mix in ("decodes-first", "verify-only")]
# Draft trees (the batch's chunk_mask): the long mix and verify rows only, both layouts, N = 2 and 4.
VERIFY += [(n, layout, "a2a" if layout == "replicated" else "ag_rs", 1, f"{mix}-trees") for n in (2, 4)
           for layout in ("tp", "replicated") for mix in ("long", "verify-only")]


@pytest.mark.parametrize("n, layout, comm, interleave, mix", VERIFY,
                         ids=["N{}-{}-{}-I{}-{}".format(*c) for c in VERIFY])
def test_verify_steps(n, layout, comm, interleave, mix):
    name = f"N{n}-{layout}-{comm}-I{interleave}-{mix}"
    trees = mix.endswith("-trees")
    case = verify_case(name, mix.removesuffix("-trees"), seed=zlib.crc32(name.encode()), comm=comm,
                       interleave=interleave, head_dim=128, dtype="bfloat16", kernel_impl="triton", device="cuda",
                       trees=trees, **({"expect": ("verify", "rejected", "tree")} if trees else {}),
                       **head_layouts(n)[layout])
    assert _threads(case, n, run_verify_case) == [case.steps + 1] * n


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("fp8, comm", [("e4m3", "ag_rs"), ("e5m2", "a2a")])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_dcp_over_fp8_shards(n, fp8, comm):
    # 32 Q / 8 KV heads, each rank storing every KV head; long decodes, a verify-sized row, a fresh prompt, a chunk
    case = Case(name=f"fp8-{fp8}", q_heads=32, kv_heads=8, block_size=16, head_dim=128, dtype="bfloat16",
                requests=((3000, 1), (1500, 1), (2048, 5), (0, 300), (4000, 64)), comm=comm, kernel_impl="triton",
                decode_steps=2, seed=31, device="cuda")
    k_scale, v_scale = (torch.tensor([s], dtype=torch.float32, device="cuda") for s in (0.037, 0.011))
    assert run_fp8_dcp(case, n, FP8[fp8], k_scale, v_scale, kernels, label=case.name) == [3] * n


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_128k_tokens_per_rank(comm):
    # 16 Q heads over one KV head (vLLM's layout at TP = 2: every rank stores it), interleave 16; requests of
    # 262K, 131K (a verify-sized row) and 200K cached tokens (a 128-token chunk), then two decode steps
    case = Case(name=f"128k-{comm}", q_heads=16, kv_heads=1, kv_replication="tp", tp=2, interleave=16,
                block_size=16, head_dim=128, dtype="bfloat16", requests=((262_000, 1), (131_072, 5), (200_000, 128)),
                comm=comm, kernel_impl="triton", decode_steps=2, seed=zlib.crc32(comm.encode()), device="cuda")
    assert _threads(case, 2, run_case) == [3, 3]
    torch.cuda.empty_cache()
