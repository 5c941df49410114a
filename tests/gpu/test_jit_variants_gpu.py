"""Step sizes never trigger a Triton recompile: a serving engine sees a new token and request count almost every
step, and Triton would otherwise compile one variant per value class (== 1, divisible by 16, other) of each such
argument, stalling the engine for a second or more at a time mid-run. Every call is also checked against float64."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels.merge import merge_kernel, merge_states
from dcp_plugin.kernels.chunk_attention import chunk_attention, chunk_attention_kernel
from dcp_plugin.kernels.prefix_attention import prefix_attention, prefix_attention_kernel, split_merge_kernel
from tests.helpers.kernel_checks import assert_matches, gluon_kernels, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEP_SIZES = (1, 2, 15, 16, 17, 32, 33, 64, 100)  # every value class Triton specializes on
HEADS = dict(q_head_start=0, q_per_kv=4, kv_head_start=0)
HEAD_DIM, BLOCK_SIZE, MAX_CONTEXT = 128, 16, 700
DTYPE = torch.bfloat16


def compiled(kernel) -> int:
    """How many variants of ``kernel`` Triton has compiled for this GPU (its per-device kernel cache); at least one
    once it has run, or the lookup is reading the wrong cache and every comparison below would be vacuous."""
    count = len(kernel.device_caches[torch.cuda.current_device()][0])
    assert count >= 1, f"no compiled variant of {kernel.__name__} found: Triton's kernel cache layout changed"
    return count


def prefix_step(num_reqs: int, query_len: int, seed: int) -> None:
    """One step as an engine sends it: ``num_reqs`` requests of ``query_len`` rows, the block table as wide as the
    engine's (fixed), contexts up to MAX_CONTEXT; checked against float64."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-MAX_CONTEXT // BLOCK_SIZE)
    ctx = torch.randint(0, MAX_CONTEXT + 1, (num_reqs,), generator=gen, device="cuda", dtype=torch.int32)
    buf = torch.randn(num_reqs * width, BLOCK_SIZE, 2, 2 * HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    table = torch.randperm(num_reqs * width, generator=gen, device="cuda").to(torch.int32).view(num_reqs, width)
    q = torch.randn(num_reqs * query_len, 8, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    qsl = torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32, device="cuda")
    args = (q, buf[..., :HEAD_DIM], buf[..., HEAD_DIM:], table, ctx, qsl)
    out, lse = poisoned(q.shape, DTYPE, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    prefix_attention(*args, scale=HEAD_DIM ** -0.5, **HEADS, max_kv_len=MAX_CONTEXT, max_query_len=query_len,
                     num_splits=4, out=out, lse=lse)
    want_out, want_lse = reference.prefix_attention(*(a.double() if a.is_floating_point() else a for a in args),
                                                    scale=HEAD_DIM ** -0.5, **HEADS, max_kv_len=MAX_CONTEXT)
    assert_matches(out, want_out, DTYPE, f"paged out, {num_reqs} x {query_len}")
    assert_matches(lse, want_lse, DTYPE, f"paged lse, {num_reqs} x {query_len}")


@pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "spec-verify"])
def test_prefix_attention_compiles_once_for_all_step_sizes(query_len):
    kernels = (prefix_attention_kernel, split_merge_kernel)
    prefix_step(3, query_len, seed=0)  # compiles this configuration's variant
    before = [compiled(k) for k in kernels]
    for seed, num_reqs in enumerate(STEP_SIZES, start=1):
        prefix_step(num_reqs, query_len, seed)
    assert [compiled(k) for k in kernels] == before, f"step sizes {STEP_SIZES} compiled new variants"


def test_chunk_attention_and_merge_compile_once_for_all_step_sizes():
    def step(num_tokens: int, seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        lengths = [num_tokens // 2, num_tokens - num_tokens // 2]
        cu = torch.tensor([0, lengths[0], num_tokens], dtype=torch.int32, device="cuda")
        q = torch.randn(num_tokens, 8, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        k, v = (torch.randn(num_tokens, 2, HEAD_DIM, generator=gen, device="cuda").to(DTYPE) for _ in range(2))
        cur = chunk_attention(q, k, v, cu, max(lengths), scale=HEAD_DIM ** -0.5, **HEADS)
        prefix_out = torch.randn(num_tokens, 8, HEAD_DIM, generator=gen, device="cuda")
        prefix_lse = torch.randn(num_tokens, 8, generator=gen, device="cuda")
        out, lse = poisoned(q.shape, DTYPE, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
        merge_states(prefix_out, prefix_lse, *cur, out=out, lse=lse)
        want_cur = reference.chunk_attention(q.double(), k.double(), v.double(), cu, max(lengths),
                                             scale=HEAD_DIM ** -0.5, **HEADS)
        want_out, want_lse = reference.merge_states(prefix_out.double(), prefix_lse.double(), *want_cur)
        assert_matches(out, want_out, DTYPE, f"merged out, {num_tokens} tokens")
        assert_matches(lse, want_lse, DTYPE, f"merged lse, {num_tokens} tokens")

    kernels = (gluon_kernels()[:1] or (chunk_attention_kernel,)) + (merge_kernel,)  # the chunk kernel serving
    step(40, seed=0)
    before = [compiled(k) for k in kernels]
    for seed, num_tokens in enumerate((2, 15, 16, 17, 32, 33, 64, 100, 1000), start=1):
        step(num_tokens, seed)
    assert [compiled(k) for k in kernels] == before, "token counts compiled new variants"
