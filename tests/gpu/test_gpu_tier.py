"""The GPU tier at real sizes (docs/design.md section 7, tier 4).

1. ``prefix_attention`` on a batch of 128 requests with contexts spread up to 32K tokens (decode, and a mixed batch
   with chunked-prefill rows) and ``chunk_attention`` on 2 x 4096 tokens: the kernel runs on the whole batch, a
   seeded sample of requests (heads) is checked against the float64 reference, and no output is left unwritten.
2. Every kernel gives bitwise identical results when run twice on the same inputs.
3. DCP attention of N = 2 and 4 ranks simulated in this process (one thread per rank, a group that moves real
   CUDA tensors between them) equals float64 single-rank causal attention, over a mixed batch and a decode loop.

Each check is a function of ``device`` and sizes, so the same code also runs on CPU at tiny sizes (interpreter).
"""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
import torch

from dcp_plugin import kernels
from dcp_plugin.kernels import reference
from dcp_plugin.testing import Case, shuffled_block_table
from tests.helpers.dcp_harness import ThreadGroup, run_case, run_threads
from tests.helpers.kernel_checks import assert_matches, poisoned

if not torch.cuda.is_available():
    pytest.skip("the GPU tier needs a CUDA GPU (run `pytest -m gpu tests/gpu` there)", allow_module_level=True)

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODEL = dict(heads=(32, 8), head_dim=128, block_size=16)  # Llama-3-8B-like attention, vLLM's page size


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _assert_written(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        nan = torch.isnan(t)
        assert not nan.any(), f"{name}: {int(nan.sum())} NaN left (unwritten or computed) of {t.numel()}"


def spread_contexts(batch: int, max_ctx: int, *, seed: int) -> list[int]:
    """Log-uniform contexts in [1, max_ctx], plus the edges 0, 1, one page +-1 and ``max_ctx`` itself."""
    rng = random.Random(seed)
    edges = [0, 1, 15, 16, 17, max_ctx][:batch]
    ctx = edges + [int(2 ** rng.uniform(0, math.log2(max_ctx))) for _ in range(batch - len(edges))]
    rng.shuffle(ctx)
    return ctx


def chunked_prefill_rows(kv_lens: list[int], chunks: list[int], *, seed: int) -> list[int]:
    """Query rows per request: 1 (decode) except ``len(chunks)`` random requests that continue a prefill."""
    q_lens = [1] * len(kv_lens)
    for b, rows in zip(random.Random(seed).sample(range(len(kv_lens)), len(chunks)), chunks):
        q_lens[b] = rows
    return q_lens


def make_prefix_inputs(kv_lens, q_lens, *, heads, head_dim, block_size, dtype, device, seed):
    """Random q and K/V caches (halves of one ``[..., 2 * D]`` buffer, like vLLM's) with shuffled pages."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-c // block_size) for c in kv_lens]
    num_pages = sum(pages) + 1  # the last page is never part of a context: unused table entries point at it
    buf = torch.randn(num_pages, block_size, heads[1], 2 * head_dim, generator=gen, dtype=dtype, device=device)
    table = shuffled_block_table(pages, generator=gen)
    q = torch.randn(sum(q_lens), heads[0], head_dim, generator=gen, dtype=dtype, device=device)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return dict(q=q, key_cache=buf[..., :head_dim], value_cache=buf[..., head_dim:], block_table=table,
                kv_lens=lens, query_start_loc=_cu(q_lens, device)), pages


def check_prefix_sample(kv_lens, q_lens, *, max_query_len, num_splits, dtype, device, heads, head_dim, block_size,
                        sample_size=8, seed=0) -> None:
    """The kernel on the whole batch; ``sample_size`` requests (always the longest context, an empty one and the
    most query rows) vs float64 on just those requests' pages."""
    inputs, pages = make_prefix_inputs(kv_lens, q_lens, heads=heads, head_dim=head_dim, block_size=block_size,
                                       dtype=dtype, device=device, seed=seed)
    q, scale, q_per_kv = inputs["q"], head_dim**-0.5, heads[0] // heads[1]
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    kernels.prefix_attention(*inputs.values(), scale=scale, q_head_start=0, q_per_kv=q_per_kv, kv_head_start=0,
                             max_kv_len=max(kv_lens), max_query_len=max_query_len, num_splits=num_splits,
                             out=out, lse=lse)
    _assert_written("prefix_attention (whole batch)", out, lse)

    batch = range(len(kv_lens))
    must = {max(batch, key=kv_lens.__getitem__), min(batch, key=kv_lens.__getitem__),
            max(batch, key=q_lens.__getitem__)}
    others = random.Random(seed).sample([b for b in batch if b not in must], max(0, sample_size - len(must)))
    bounds = inputs["query_start_loc"].tolist()
    for b in sorted(must | set(others)):
        rows = slice(bounds[b], bounds[b + 1])
        own = inputs["block_table"][b, :pages[b]].long()  # this request's pages, compacted to 0..pages[b]-1
        local_table = torch.arange(max(pages[b], 1), dtype=torch.int32, device=device).unsqueeze(0)
        want_out, want_lse = reference.prefix_attention(
            q[rows].double(), inputs["key_cache"][own].double(), inputs["value_cache"][own].double(), local_table,
            inputs["kv_lens"][b:b + 1], _cu([q_lens[b]], device), scale=scale, q_head_start=0,
            q_per_kv=q_per_kv, kv_head_start=0, max_kv_len=kv_lens[b])
        name = f"request {b} (context {kv_lens[b]}, {q_lens[b]} rows)"
        assert_matches(out[rows], want_out, dtype, f"out of {name}")
        assert_matches(lse[rows], want_lse, dtype, f"lse of {name}")


def check_chunk_sample(lengths, *, dtype, device, heads, head_dim, sample_size=6, seed=0) -> None:
    """The kernel on every head; ``sample_size`` Q heads (always the first and the last) vs float64."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(lengths), heads[0], head_dim, generator=gen, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lengths), heads[1], head_dim, generator=gen, dtype=dtype, device=device)
            for _ in range(2))
    cu, scale, q_per_kv = _cu(lengths, device), head_dim**-0.5, heads[0] // heads[1]
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    kernels.chunk_attention(q, k, v, cu, max(lengths), scale=scale, q_head_start=0, q_per_kv=q_per_kv,
                            kv_head_start=0, out=out, lse=lse)
    _assert_written("chunk_attention (every head)", out, lse)
    k64, v64 = k.double(), v.double()
    middle = random.Random(seed).sample(range(1, heads[0] - 1), max(0, sample_size - 2))
    for h in sorted({0, heads[0] - 1, *middle}):
        want_out, want_lse = reference.chunk_attention(q[:, h:h + 1].double(), k64, v64, cu, max(lengths),
                                                       scale=scale, q_head_start=h, q_per_kv=q_per_kv,
                                                       kv_head_start=0)
        assert_matches(out[:, h:h + 1], want_out, dtype, f"out of Q head {h}")
        assert_matches(lse[:, h:h + 1], want_lse, dtype, f"lse of Q head {h}")


PREFIX_MODES = {  # mode -> (chunked-prefill rows, max_query_len hint: "exact" as DcpAttention passes it, or None)
    "decode": ([], "exact"),
    "mixed": ([256, 200, 128, 100, 64, 17, 3, 2], "exact"),
    "mixed-no-max-hint": ([256, 200, 128, 100, 64, 17, 3, 2], None),
}


@pytest.mark.parametrize("num_splits", [None, 8], ids=["auto-splits", "8-splits"])
@pytest.mark.parametrize("mode", list(PREFIX_MODES))
def test_prefix_attention_batch_128_contexts_to_32k(mode, num_splits):
    chunks, hint = PREFIX_MODES[mode]
    ctx = spread_contexts(128, 32768, seed=11)
    q_lens = chunked_prefill_rows(ctx, chunks, seed=12)
    check_prefix_sample(ctx, q_lens, max_query_len=max(q_lens) if hint == "exact" else None, num_splits=num_splits,
                        dtype=torch.bfloat16, device="cuda", seed=13, **MODEL)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_chunk_attention_2x4096(dtype):
    check_chunk_sample((4096, 4096), dtype=dtype, device="cuda", heads=MODEL["heads"], head_dim=MODEL["head_dim"],
                       seed=21)


def repeatable_runs(device, dtype, *, batch=32, max_ctx=8192, tokens=3000, heads=(32, 8), head_dim=128,
                    block_size=16) -> dict:
    """name -> factory building fresh random inputs and returning ``run()``, which launches one kernel into fresh
    NaN-poisoned outputs and returns them."""
    hq, hk = heads
    q_per_kv, scale = hq // hk, head_dim**-0.5

    def rand(*shape, dtype=dtype, seed=0):
        return torch.randn(*shape, generator=torch.Generator(device=device).manual_seed(seed), dtype=dtype,
                           device=device)

    def prefix(num_splits, chunks):
        ctx = spread_contexts(batch, max_ctx, seed=31)
        q_lens = chunked_prefill_rows(ctx, chunks, seed=32)
        inputs, _ = make_prefix_inputs(ctx, q_lens, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                                       device=device, seed=33)

        def run():
            out, lse = poisoned(inputs["q"].shape, dtype, device), poisoned((sum(q_lens), hq), torch.float32, device)
            return kernels.prefix_attention(*inputs.values(), scale=scale, q_head_start=0, q_per_kv=q_per_kv,
                                            kv_head_start=0, max_kv_len=max(ctx), max_query_len=max(q_lens),
                                            num_splits=num_splits, out=out, lse=lse)
        return run

    def chunk():
        lengths = [tokens // 3, 1, tokens - tokens // 3 - 1]
        q = rand(tokens, hq, head_dim, seed=41)
        k, v = rand(tokens, hk, head_dim, seed=42), rand(tokens, hk, head_dim, seed=43)
        cu = _cu(lengths, device)
        return lambda: kernels.chunk_attention(
            q, k, v, cu, max(lengths), scale=scale, q_head_start=0, q_per_kv=q_per_kv, kv_head_start=0,
            out=poisoned(q.shape, dtype, device), lse=poisoned(q.shape[:2], torch.float32, device))

    def partials():
        parts = rand(4, tokens, hq, head_dim + 1, dtype=torch.float32, seed=51)  # a2a's packed (O, LSE) buffer
        parts[0, ::5, :, head_dim] = float("-inf")  # an empty shard
        extra_out, extra_lse = rand(tokens, hq, head_dim, seed=52), rand(tokens, hq, dtype=torch.float32, seed=53)
        return lambda: kernels.merge_partials(
            parts[..., :head_dim], parts[..., head_dim], extra_out=extra_out, extra_lse=extra_lse,
            out=poisoned((tokens, hq, head_dim), dtype, device), lse=poisoned((tokens, hq), torch.float32, device))

    def merge():
        out_a = rand(tokens, hq, head_dim, dtype=torch.float32, seed=61)  # a float32 prefix partial
        lse_a = rand(tokens, hq, dtype=torch.float32, seed=62)
        out_b, lse_b = rand(tokens, hq, head_dim, seed=63), rand(tokens, hq, dtype=torch.float32, seed=64)
        return lambda: kernels.merge_states(out_a, lse_a, out_b, lse_b, out=poisoned(out_b.shape, dtype, device),
                                            lse=poisoned(lse_b.shape, torch.float32, device))

    def rescale():
        part_out, lse_all = rand(tokens, hq, head_dim, seed=71), rand(4, tokens, hq, dtype=torch.float32, seed=72)
        return lambda: kernels.rescale_partial(
            part_out, lse_all, 2, out=poisoned(part_out.shape, torch.float32, device),
            lse=poisoned((tokens, hq), torch.float32, device))

    def write_kv():
        num_pages = tokens // block_size + 8
        base = rand(num_pages, block_size, hk, 2 * head_dim, seed=81)  # random, not zeros: a skipped row shows
        k, v = rand(tokens, hk, head_dim, seed=82), rand(tokens, hk, head_dim, seed=83)
        slots = torch.randperm(num_pages * block_size, generator=torch.Generator(device=device).manual_seed(84),
                               device=device)[:tokens]
        slots[::7] = -1  # tokens another rank owns

        def run():
            buf = base.clone()
            kernels.write_kv_cache(k, v, buf[..., :head_dim], buf[..., head_dim:], slots)
            want = base.clone()
            reference.write_kv_cache(k, v, want[..., :head_dim], want[..., head_dim:], slots)
            assert torch.equal(buf, want), "write_kv_cache differs from the reference write"
            return (buf,)
        return run

    return {
        **{f"prefix-decode-splits-{s}": (lambda s=s: prefix(s, [])) for s in (1, 3, 16)},
        "prefix-mixed-splits-4": lambda: prefix(4, [300, 77, 2]),
        "chunk_attention": chunk, "merge_partials": partials, "merge_states": merge, "rescale_partial": rescale,
        "write_kv_cache": write_kv,
    }


def check_repeatable(name: str, device, dtype, **sizes) -> None:
    run = repeatable_runs(device, dtype, **sizes)[name]()
    first, second = run(), run()
    _assert_written(name, *first)
    for i, (a, b) in enumerate(zip(first, second)):
        diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        assert torch.equal(a, b), f"{name}: output {i} differs between two runs at {int(diff.sum())} elements"


@pytest.mark.parametrize("name", list(repeatable_runs("cuda", torch.bfloat16)))
def test_repeated_runs_are_bitwise_identical(name):
    check_repeatable(name, "cuda", torch.bfloat16)


def run_dcp_threads(case: Case, n: int) -> list[int]:
    """Every rank of ``case`` on its own thread (``tests.helpers.dcp_harness.run_case``: each step's output, gathered
    over the group, vs float64 causal attention; then the caches bit for bit). Returns each rank's checked steps."""

    def rank_main(rank, exchange):
        group = ThreadGroup(exchange, rank)
        return run_case(case, n, rank, group, lambda out: group.all_gather(out, dim=1))

    return run_threads(n, rank_main, timeout_s=300)


# (cached context, new tokens): long decodes, a chunked prefill on a cached prefix, a fresh prompt, a one-token
# fresh prompt, and contexts shorter than N (empty shards on some ranks); then DECODE_STEPS steps of one token each.
DCP_REQUESTS = ((3071, 1), (1, 1), (2048, 257), (0, 300), (2, 2), (1500, 1), (3, 1), (0, 1), (4000, 1))
DECODE_STEPS = 3


def dcp_case(n: int, layout: str, comm: str, dtype: str, *, requests=DCP_REQUESTS, decode_steps=DECODE_STEPS,
             heads=(32, 8), head_dim=128, block_size=16, device="cuda") -> Case:
    """32 Q / 8 KV heads as DCP group 1 of TP 2N (``group``: the group's 16 Q heads read KV heads 4..7, stored on
    every rank), or as the last DCP group of TP 8N (``tp``, vLLM's rule: every rank stores KV head 7 only)."""
    if layout == "replicated":
        placement = dict(kv_replication="replicated", tp=2 * n, group_index=1)
    else:
        tp = heads[1] * n
        placement = dict(kv_replication="tp", tp=tp, group_index=tp // n - 1)
    name = f"N{n}-{layout}-{comm}-{dtype}"
    return Case(name=name, q_heads=heads[0], kv_heads=heads[1], block_size=block_size,
                head_dim=head_dim, requests=requests, comm=comm, dtype=dtype, kernel_impl="triton",
                decode_steps=decode_steps, seed=zlib.crc32(name.encode()), device=device, **placement)


# The single-kernel tolerances of tests/helpers/kernel_checks.py hold for the DCP output: the prefix partials and the
# cross-rank merge stay in float32, and its only rounding beyond one kernel's is the current chunk's output stored
# in the input dtype before the merge. Both roundings together are <= u * (w * |o_cur| + |out|), w the chunk's
# softmax weight, u = 2**-8 (bf16) / 2**-11 (fp16) ~ a quarter of the table's rtol: the |out| term fits in rtol,
# the other in atol since w * |o_cur| (a weighted average of N(0, 1) values) stays below 4.
# bf16: every (N, layout, comm); fp16: each N, layout and comm twice (every fp16 configuration costs compiles).
DCP_CONFIGS = [(n, layout, comm, "bfloat16") for n in (2, 4) for layout in ("replicated", "tp") for comm in ("ag_rs", "a2a")]
DCP_CONFIGS += [(2, "tp", "ag_rs", "float16"), (2, "replicated", "a2a", "float16"), (4, "replicated", "ag_rs", "float16"),
                (4, "tp", "a2a", "float16")]


@pytest.mark.parametrize("n, layout, comm, dtype", DCP_CONFIGS, ids=[dcp_case(*c).name for c in DCP_CONFIGS])
def test_dcp_single_gpu_simulation(n, layout, comm, dtype):
    case = dcp_case(n, layout, comm, dtype)
    assert run_dcp_threads(case, n) == [DECODE_STEPS + 1] * n
