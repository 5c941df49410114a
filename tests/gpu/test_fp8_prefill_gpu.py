"""``DCP_TRITON_FP8_PREFILL=copy`` on the GPU: a prefill step over an fp8 cache (e4m3 / e5m2, pages of 16 and 64
tokens, NaN in the rows past each context) widens its pages into a 16-bit copy and runs the 16-bit pass over it (the
Gluon one where it serves: sm_90, Triton 3.6); the output equals float64 attention over the dequantized cache to the
model dtype's bounds, and a decode in the same process reads the fp8 cache directly."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import _plan_cache, reference
from dcp_plugin.kernels._gluon import GLUON_HEAD_DIMS, gluon_enabled
from dcp_plugin.kernels.fp8_prefill import FP8_PREFILL_ENV, CopiedPrefix
from dcp_plugin.kernels.prefix_attention import plan_prefix
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches, nan_past_context, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = (0.037, 0.011)  # not powers of two: value x scale rounds in the copy


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8", list(FP8))
def test_a_prefill_through_the_copy_equals_float64(fp8, dtype, head_dim, block_size, mode, monkeypatch):
    monkeypatch.setenv(FP8_PREFILL_ENV, "copy")
    _plan_cache.clear()
    gen = torch.Generator(device="cuda").manual_seed(6)
    # Enough query blocks for one split, as a prefill chunk brings (the Gluon pass reads in one split only).
    q_lens = {"prefill": [1024, 64, 640, 768], "decode": [1, 1, 1, 1]}[mode]
    ctx = [4097, 300, 0, 2000]
    pages = [max(1, -(-c // block_size)) for c in ctx]
    k_scale, v_scale = (torch.tensor([s], dtype=torch.float32, device="cuda") for s in SCALES)
    q = torch.randn(sum(q_lens), 32, head_dim, device="cuda", generator=gen).to(dtype)
    raw = torch.randn(sum(pages) + 3, block_size, 8, 2 * head_dim, device="cuda", generator=gen)
    buf = (raw * 0.1 / torch.cat([k_scale.expand(head_dim), v_scale.expand(head_dim)])).to(FP8[fp8])
    kc, vc = buf[..., :head_dim], buf[..., head_dim:]
    table = shuffled_block_table(pages, generator=gen, first_page=3, fill=0)
    nan_past_context((kc, vc), table, ctx, block_size)  # a last page's rows past the context: the copy must not carry them
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    heads = dict(scale=head_dim**-0.5, q_head_start=0, q_per_kv=4, kv_head_start=0, max_kv_len=max(ctx))
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    plan = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, **heads, max_query_len=max(q_lens))
    assert isinstance(plan, CopiedPrefix) == (mode == "prefill")
    if mode == "prefill" and head_dim in GLUON_HEAD_DIMS and gluon_enabled(q.device):
        assert plan.over_copy.stage1.kernel.__name__ == "gluon_prefix_kernel"
    plan(q, kc, vc, table, lens, qsl, out, lse, k_scale, v_scale)
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double() * k_scale.double(),
                                                    vc.double() * v_scale.double(), table, lens, qsl, **heads)
    assert_matches(out, want_out, dtype, f"fp8 {fp8} {mode} out through the copy")
    assert_matches(lse, want_lse, dtype, f"fp8 {fp8} {mode} lse through the copy")


def test_the_warm_up_compiles_the_copy_and_every_pass_over_it(monkeypatch):
    """With the copy asked for, an engine's warm-up over an fp8 cache compiles the copy's kernel and the passes over
    the copy: a prefill step (a 1,024-row chunk over 2,000 cached tokens beside a fresh prompt and a 64-row chunk),
    then decodes, compile nothing, take the copy, and equal float64 attention over the dequantized cache."""
    from dcp_plugin import DcpAttention, DcpWorkspace, kernels
    from dcp_plugin.kernels.fp8_prefill import widen_pages_kernel
    from dcp_plugin.testing import Case, RankState, World
    from dcp_plugin.warmup import warm_up
    from tests.gpu.test_warmup_gpu import KERNELS
    from tests.helpers.dcp_harness import serial
    from tests.helpers.fp8_checks import fp8_round_trip

    monkeypatch.setenv(FP8_PREFILL_ENV, "copy")
    fp8 = torch.float8_e4m3fn
    case = Case(name="fp8-copy-warm", q_heads=32, kv_heads=8, head_dim=128, block_size=64,
                requests=((2000, 1024), (0, 700), (3000, 64)), dtype="bfloat16", kernel_impl="triton", seed=9,
                decode_steps=2, device="cuda")
    world = World(case)
    k_scale, v_scale = (torch.tensor([s], dtype=torch.float32, device="cuda") for s in SCALES)
    fp8_round_trip(world, fp8, k_scale, v_scale)
    state = RankState.create(case, world, 1, 0)
    caches = [(c / s).to(fp8) for c, s in ((state.key_cache, k_scale), (state.value_cache, v_scale))]
    ws = DcpWorkspace(heads=state.heads, head_dim=128, dtype=torch.bfloat16, device="cuda", max_num_tokens=2048,
                      comm="ag_rs", split_elements=kernels.split_capacity(128, torch.device("cuda")))
    attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=world.scale, workspace=ws))
    like = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    kv_like = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    watched = (*KERNELS, widen_pages_kernel)
    counts = lambda: [len(k.device_caches[torch.cuda.current_device()][0]) for k in watched]  # noqa: E731
    for kernel in watched:  # what earlier tests of this process compiled: the warm-up must compile it again
        kernel.device_caches[torch.cuda.current_device()][0].clear()
    warm_up(attn, query=like, key=kv_like, value=kv_like, key_cache=caches[0], value_cache=caches[1], output=like,
            k_scale=k_scale, v_scale=v_scale)
    before = counts()
    assert before[-1] >= 1, "the warm-up never compiled the copy's kernel"
    copies = []
    original = CopiedPrefix.__call__
    monkeypatch.setattr(CopiedPrefix, "__call__", lambda self, *a: copies.append(1) or original(self, *a))
    for step, new_tokens in enumerate([[new for _, new in case.requests], [1, 1, 1], [1, 1, 1]]):
        q, k, v, batch, positions = state.step(new_tokens)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        attn.forward(q, k, v, *caches, batch, out=out, k_scale=k_scale, v_scale=v_scale)
        want = torch.cat([world.causal_attention_f64(b, p, range(32)) for b, p in enumerate(positions)])
        assert_matches(out, want, torch.bfloat16, f"fp8 through the copy, step {step}")
    assert copies, "the prefill step must have read the copy"
    assert counts() == before, f"serving steps compiled new variants: {before} -> {counts()}"
